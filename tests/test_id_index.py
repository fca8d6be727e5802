"""The id-to-row index's hash tables: what TensorFlow's DenseHashTable does with a key
past a tombstone, and `id_index.put`, which every write of a held key goes through."""

import pytest
import tensorflow as tf

from recommendation.online.tables import id_index

# Two int64 ids that share a bucket of a 1024-bucket index: the second one's probe
# sequence passes the first one's bucket.
FIRST, SECOND = 5, 5 + 1024


def _two_ids_then_the_first_removed():
    table = id_index.make_table(tf.int64, -1)
    table.insert(tf.constant([FIRST, SECOND], tf.int64), tf.constant([10, 20], tf.int64))
    table.remove(tf.constant([FIRST], tf.int64))  # a tombstone before SECOND's bucket
    return table


def test_a_dense_hash_table_insert_of_a_held_key_past_a_tombstone_holds_it_twice():
    """Why `put` exists: TensorFlow's insert writes the key into the tombstone, and once
    the key is removed its old entry answers again. If this starts failing, TensorFlow
    has fixed its table and `put` may go back to a plain insert."""
    table = _two_ids_then_the_first_removed()
    table.insert(tf.constant([SECOND], tf.int64), tf.constant([30], tf.int64))
    assert int(table.size()) == 2  # one key, two entries
    table.remove(tf.constant([SECOND], tf.int64))
    assert table.lookup(tf.constant([FIRST, SECOND], tf.int64)).numpy().tolist() == [-1, 20]


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_put_replaces_a_held_key_and_counts_what_it_held(key_dtype):
    if key_dtype == "int64":
        table, keys = _two_ids_then_the_first_removed(), [SECOND, 7]
    else:
        table, keys = id_index.make_table(tf.string, -1), [b"b", b"c"]
        table.insert(tf.constant([b"a", b"b"]), tf.constant([10, 20], tf.int64))
        table.remove(tf.constant([b"a"]))
    keys = tf.constant(keys, tf.as_dtype(key_dtype))
    held = id_index.put(table, keys, tf.constant([30, 40], tf.int64))
    assert int(held) == (1 if key_dtype == "int64" else 0)  # strings leave no tombstones
    assert int(table.size()) == 3 - 1
    assert table.lookup(keys).numpy().tolist() == [30, 40]
    table.remove(keys)
    assert table.lookup(keys).numpy().tolist() == [-1, -1] and int(table.size()) == 0


def test_put_inside_a_tf_function_removes_before_it_inserts():
    table = _two_ids_then_the_first_removed()
    put = tf.function(lambda keys, values: id_index.put(table, keys, values))
    assert int(put(tf.constant([SECOND], tf.int64), tf.constant([30], tf.int64))) == 1
    table.remove(tf.constant([SECOND], tf.int64))
    assert int(table.size()) == 0 and table.lookup(tf.constant([SECOND], tf.int64)).numpy() == -1
