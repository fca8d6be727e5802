"""The id-to-row index of a hash embedding: TensorFlow's mutable hash tables, and the
rebuild that keeps an int64 one working under churn.

A ``DenseHashTable`` (open addressing, the fast one for int64 ids) marks the bucket of
a removed key with a tombstone and re-buckets only as its live keys grow. When ids
come and go, tombstones fill every free bucket within a few rounds of the table's
size, and from then on a lookup of an absent id fails ("Internal error in
MutableDenseHashTable lookup"). `rebuild` replaces the buckets with new, empty ones
and inserts the live entries again; its owner calls it once the removals since the
last rebuild reach an eighth of the buckets then (`worn`), O(1) a removal amortised.

A DenseHashTable's ``insert`` of a key it holds is not always an update: the kernel writes
the key into the first empty *or tombstone* bucket of the key's probe sequence, so a
key whose bucket lies past a tombstone is then held twice. Lookups find the new entry
first, until the key is removed, when the old one, with its old value, answers again
(a row another id now holds, or past the live rows). `put` removes before it inserts:
every write of a key that may be held goes through it.
"""

from __future__ import annotations

import tensorflow as tf

from recommendation.online.tables import masks

# Reserved keys of the int64 DenseHashTable; ids must not take these two values.
EMPTY_KEY = -(2**63)
DELETED_KEY = -(2**63) + 1
INITIAL_BUCKETS = 1024


def make_table(key_dtype: tf.DType, default_value) -> tf.lookup.experimental.MutableHashTable:
    """An int64-keyed DenseHashTable or, for strings, a MutableHashTable (a hash map,
    which has no tombstones)."""
    if key_dtype == tf.int64:
        return tf.lookup.experimental.DenseHashTable(
            tf.int64,
            tf.int64,
            default_value=default_value,
            empty_key=EMPTY_KEY,
            deleted_key=DELETED_KEY,
            initial_num_buckets=INITIAL_BUCKETS,  # grows as needed; small checkpoints
        )
    return tf.lookup.experimental.MutableHashTable(key_dtype, tf.int64, default_value)


def worn(removals: tf.Tensor, buckets: tf.Tensor) -> tf.Tensor:
    """Whether an index with `removals` since its rebuild into `buckets` needs another."""
    return removals * 8 >= buckets


def live_entries(table, width: int) -> tuple[tf.Tensor, tf.Tensor]:
    """`(keys, values)` of every key `table` holds (values `(n, width)`)."""
    keys, values = table.export()
    keys, values = tf.reshape(keys, [-1]), tf.reshape(values, [-1, width])
    if keys.dtype == tf.int64:
        live = (keys != EMPTY_KEY) & (keys != DELETED_KEY)
        keys, values = masks.keep(live, keys, values)
    return keys, values


def rebuild(table, keys: tf.Tensor, values: tf.Tensor, width: int, load: float = 0.4) -> tf.Tensor:
    """Empties the DenseHashTable `table` into new buckets (room for `keys` at a load
    of `load` at most, a power of two: a table that churns wants room for tombstones, a
    server's that mostly grows less) and inserts `keys` -> `values` (its live
    entries); returns the bucket count.

    The import of buckets copies them as given (all empty here): what clears the
    tombstones. The churn test of `HashEmbedding` fails if that changes.
    """
    wanted = tf.maximum(tf.cast(tf.size(keys), tf.float64) / load, INITIAL_BUCKETS)
    two = tf.constant(2.0, tf.float64)
    buckets = tf.cast(tf.pow(two, tf.math.ceil(tf.math.log(wanted) / tf.math.log(two))), tf.int64)

    def shaped(value, shape):
        # The kernel takes (buckets, 1) keys and (buckets, width) values; the op's
        # shape function wants rank-1 keys: a shape of unknown length passes both.
        dims = tf.stack(shape)
        return tf.reshape(value, masks.keep(tf.ones_like(dims, tf.bool), dims))

    tf.raw_ops.LookupTableImportV2(
        table_handle=table.resource_handle,
        keys=shaped(tf.fill([buckets], tf.constant(EMPTY_KEY, tf.int64)), [buckets, 1]),
        values=shaped(tf.zeros([buckets * width], tf.int64), [buckets, width]),
    )
    table.insert(keys, values if width > 1 else tf.reshape(values, [-1]))
    return buckets


def put(table, keys: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """Makes `table` map `keys` to `values`, whether it holds them or not; returns
    how many of them it held (each may leave a tombstone: count them as removals)."""
    if not isinstance(table, tf.lookup.experimental.DenseHashTable):
        table.insert(keys, values)
        return tf.constant(0, tf.int64)
    held = table.size()
    table.remove(keys)
    held -= table.size()
    table.insert(keys, values)
    return held


def replace(table, keys: tf.Tensor, values: tf.Tensor) -> None:
    """Makes the MutableHashTable `table` hold exactly `keys` -> `values`."""
    tf.raw_ops.LookupTableImportV2(table_handle=table.resource_handle, keys=keys, values=values)


def clear(table) -> None:
    """Empties `table` (of scalar int64 values)."""
    if isinstance(table, tf.lookup.experimental.DenseHashTable):
        rebuild(table, tf.zeros([0], tf.int64), tf.zeros([0, 1], tf.int64), 1)
    else:
        replace(table, tf.zeros([0], table.key_dtype), tf.zeros([0], tf.int64))
