"""What a version of an online model holds and serves: the `tf.Module` that ncf-online
exports and ncf-serve serves (one implementation of the scoring for both, and for
TensorFlow Serving loading the same SavedModel).

A version holds, of each hash table (users, items), its live rows as the trainer
lays them out (`ServedTable`: row r's id, the rows, the live count, the id -> row
index) and NeuMF's dense layers, behind raw-id signatures:

- ``serving_default(user_id int64 [n], item_id int64 [n])`` -> ``logits``, ``scores``
  (probabilities) float32 `[n]`, ``known`` bool `[n]` (both ids hold a row; an id
  without one scores with the default row, as the trainer scores a new id);
- ``recommend(user_id int64 [n], k int32)`` -> ``item_ids`` int64 `[n, k]`,
  ``scores`` float32 `[n, k]`, best first, ``known`` bool `[n]`: every item that holds
  a row ranked for each user. An unknown user is ``known`` false with item ids -1 and
  NaN scores, as offline; k above the number of items is cut to it. `k` is a scalar
  or one value per user (what TensorFlow Serving's ``instances`` form sends), and a
  user's row is padded with -1 / NaN past its own k.

The trainer fills a version from its tables (`OnlineVersion.copy_from`, at a step
boundary; `reindex` may then run on another thread), and where it publishes, keeps it
up to date with its publications' rows (`follow`); a server builds the same module
from the version's ``export_info.json`` (`from_config`), reads its variables, and
applies publications in place (`ServedTable.apply`, `OnlineVersion.apply`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.online import online_ncf
from recommendation.online.online_ncf import OnlineNeuMF
from recommendation.online.tables import id_index, masks, row_shards
from recommendation.serving.publications import TABLES

# Per-pair values `recommend` holds at once (a block of users times the catalogue):
# about 4 M pairs of the first MLP layer's output, 64 MB at 16 columns.
_PAIRS_PER_BLOCK = 2**22
# Rows a served table adds beyond those it needs when it grows, as a fraction: its
# memory stays within an eighth of its rows', for a copy of the table every eighth.
_GROWTH = 0.125
# The most an index is filled when rebuilt: a served table's ids mostly arrive (the
# DenseHashTable doubles past 80%), where a trainer's churn wants room for tombstones.
_INDEX_LOAD = 0.75


class ServedTable(tf.Module):
    """One hash table as served: `keys` (row r's raw id; row 0 is the default row, zeros,
    for ids without a row), `rows` (float32), `size` (rows ``1..size`` are live) and the
    id -> row `index`. A server's table may hold rows past `size` allocated ahead.

    Args:
        width: Columns of a row.
        name: Module name.
    """

    def __init__(self, width: int, name: str) -> None:
        super().__init__(name=name)
        self.keys = tf.Variable(tf.zeros([1], tf.int64), shape=[None], trainable=False, name="keys")
        self.rows = tf.Variable(
            tf.zeros([1, width]), shape=[None, width], trainable=False, name="rows"
        )
        self.size = tf.Variable(0, dtype=tf.int64, trainable=False, name="size")
        self.index = id_index.make_table(tf.int64, -1)

    def slots(self, ids: tf.Tensor) -> tf.Tensor:
        """Rows `(n,)` of raw `ids`, 0 (the default row) for ids without one."""
        return tf.maximum(tf.reshape(self.index.lookup(ids), [-1]), 0)

    def live(self) -> tuple[tf.Tensor, tf.Tensor]:
        """`(keys, rows)` of the live rows, ``1..size``."""
        end = self.size + 1
        return self.keys[1:end], self.rows[1:end]

    @tf.function(autograph=False)
    def reindex(self) -> tf.Tensor:
        """Rebuilds the index from `keys` (after `keys` and `size` were set whole, or once
        removals wore it: `id_index.worn`); returns its buckets."""
        live = tf.range(1, self.size + 1)
        keys = tf.gather(self.keys, live)
        return id_index.rebuild(self.index, keys, live[:, None], 1, _INDEX_LOAD)

    def apply(
        self, slots: tf.Tensor, keys: tf.Tensor, rows: tf.Tensor, size: tf.Tensor
    ) -> tf.Tensor:
        """Makes rows `slots` hold `keys` and `rows` and the live rows ``1..size``, as the
        trainer's table changed since the state held; returns how many ids left the
        index (evicted, or moved to another row).

        Only rows whose id changed touch the index: the ids that left a changed or a
        dropped row (past the new `size`) are removed where the index still points
        there, then the changed rows' new ids are inserted. An id that moved left a row
        that is changed or dropped too, so no id is held twice.
        """
        self._reserve(tf.maximum(size, tf.reduce_max(tf.concat([slots, [0]], 0))))
        held = self.size
        dropped = tf.range(size + 1, tf.maximum(held, size) + 1)
        touched = tf.concat([slots, dropped], 0)
        old = tf.gather(self.keys, touched)
        new = tf.concat([keys, tf.fill(tf.shape(dropped), id_index.EMPTY_KEY)], 0)
        # Rows past the state's size held no id; an id that stays in its row stays put.
        moved = (touched <= held) & (old != new)
        moved_old, moved_from = masks.keep(moved, old, touched)  # mostly none: no lookup
        leaving = tf.reshape(self.index.lookup(moved_old), [-1]) == moved_from
        self.index.remove(masks.keep(leaving, moved_old))
        arriving = moved[: tf.size(slots)] | (slots > held)
        self.index.insert(*masks.keep(arriving, keys, slots))
        self.keys.scatter_update(tf.IndexedSlices(keys, slots))
        self.rows.scatter_update(tf.IndexedSlices(rows, slots))
        self.size.assign(size)
        return tf.reduce_sum(tf.cast(leaving, tf.int64))

    def follow(self, slots: tf.Tensor, keys: tf.Tensor, rows: tf.Tensor, size: tf.Tensor) -> None:
        """`apply` without the index: the trainer's copy of a version, whose index is
        rebuilt (`reindex`) before it is written, follows the publications at the cost
        of their rows alone."""
        self._reserve(tf.maximum(size, tf.reduce_max(tf.concat([slots, [0]], 0))))
        self.keys.scatter_update(tf.IndexedSlices(keys, slots))
        self.rows.scatter_update(tf.IndexedSlices(rows, slots))
        self.size.assign(size)

    @tf.function(autograph=False)
    def trim(self) -> None:
        """Drops the rows allocated ahead (`apply` grows by `_GROWTH`): a version's files
        hold the live rows only."""
        for variable in (self.keys, self.rows):
            row_shards.resize(variable, self.size + 1)

    def _reserve(self, rows: tf.Tensor) -> None:
        """Allocates rows up to `rows` (by `_GROWTH` more than needed at a time)."""
        allocated = row_shards.variable_shape(self.keys)[0] - 1

        def grow():
            target = rows + tf.cast(tf.cast(rows, tf.float64) * _GROWTH, tf.int64)
            extra = target - allocated
            self.keys.assign(tf.concat([self.keys, tf.zeros([extra], tf.int64)], 0))
            width = row_shards.variable_shape(self.rows)[1]
            self.rows.assign(tf.concat([self.rows, tf.zeros(tf.stack([extra, width]))], 0))
            return tf.constant(True)

        tf.cond(rows > allocated, grow, lambda: tf.constant(False))


def dense_weights(network: OnlineNeuMF) -> list:
    """`network`'s weights outside its tables, in a fixed order (a version's, a
    publication's)."""
    layers = (network.gmf, *network.mlp, network.logit)
    return [weight for layer in layers if layer is not None for weight in layer.weights]


class OnlineVersion(tf.Module):
    """An online NeuMF for serving (module docstring).

    Args:
        config: The trained network's config (`OnlineNeuMF.get_config`): the dense
            layers and the scoring are built from it.
    """

    def __init__(self, config: dict) -> None:
        super().__init__(name="online_version")
        network = online_ncf.network_from_config(config)
        # Not tracked: only the dense layers and the tables below are the version's.
        object.__setattr__(self, "_network", network)
        self.config = config
        width = network.user_embedding.embedding_size
        self.users = ServedTable(width, "users")
        self.items = ServedTable(width, "items")
        self.layers = [
            layer for layer in (network.gmf, *network.mlp, network.logit) if layer is not None
        ]
        object.__setattr__(self, "_apply", self._make_apply())
        object.__setattr__(self, "_follow", self._make_apply(follow=True))

    @property
    def dense_variables(self) -> list:
        """The dense layers' weights, in the order publications hold them."""
        return dense_weights(self._network)

    def signatures(self) -> dict:
        """The SavedModel's signatures."""
        return {"serving_default": self.serve, "recommend": self.recommend}

    def _as_looked_up(self, rows: tf.Tensor) -> tf.Tensor:
        """`rows` as the trainer's tables hand them out (clipped to `max_norm`, cast)."""
        embedding = self._network.user_embedding
        if embedding.max_norm is not None:
            rows = tf.clip_by_norm(rows, embedding.max_norm, axes=[-1])
        return tf.cast(rows, embedding.compute_dtype)

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64, constants.USER_COLUMN),
            tf.TensorSpec([None], tf.int64, constants.ITEM_COLUMN),
        ],
        autograph=False,
    )
    def serve(self, user_id: tf.Tensor, item_id: tf.Tensor) -> dict[str, tf.Tensor]:
        """``serving_default``: probabilities of (user, item) pairs given by raw id."""
        users, items = self.users.slots(user_id), self.items.slots(item_id)
        user = self._as_looked_up(tf.gather(self.users.rows, users))
        item = self._as_looked_up(tf.gather(self.items.rows, items))
        logits = tf.cast(self._network.score_rows(user, item), tf.float32)
        return {"logits": logits, "scores": tf.sigmoid(logits), "known": (users > 0) & (items > 0)}

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64, constants.USER_COLUMN),
            tf.TensorSpec(None, tf.int32, "k"),
        ],
        autograph=False,
    )
    def recommend(self, user_id: tf.Tensor, k: tf.Tensor) -> dict[str, tf.Tensor]:
        """``recommend``: each user's top-k of every item that holds a row."""
        count = tf.size(user_id)
        wanted = tf.broadcast_to(tf.reshape(k, [-1]), [count])
        tf.debugging.assert_positive(wanted, message="k must be at least 1")
        users = self.users.slots(user_id)
        known = users > 0
        item_keys, item_rows = self.items.live()
        catalogue = tf.shape(item_keys)[0]
        positions = tf.broadcast_to(tf.range(catalogue)[None], tf.stack([count, catalogue]))
        block = tf.maximum(1, _PAIRS_PER_BLOCK // tf.maximum(catalogue, 1))
        logits = self._network.score_row_candidates(
            self._as_looked_up(tf.gather(self.users.rows, users)),
            self._as_looked_up(item_rows),
            positions,
            block,
        )
        most = tf.reduce_max(tf.concat([wanted, [0]], 0))
        top = tf.math.top_k(logits, tf.minimum(most, catalogue))
        columns = tf.range(tf.shape(top.indices)[1])
        valid = known[:, None] & (columns[None] < wanted[:, None])
        return {
            "item_ids": tf.where(valid, tf.gather(item_keys, top.indices), -1),
            "scores": tf.where(valid, tf.sigmoid(top.values), np.nan),
            "known": known,
        }

    # -- the trainer's side ----------------------------------------------------

    def copy_from(self, network: OnlineNeuMF) -> None:
        """Makes this version hold `network`'s live rows and dense weights (between
        steps; the indexes are rebuilt by `reindex`, which may run on another thread)."""
        tables = (network.user_embedding, network.item_embedding)
        for served, table in zip((self.users, self.items), tables, strict=True):
            keys, rows = table.live_rows()
            served.keys.assign(keys)
            served.rows.assign(rows)
            served.size.assign(table.size)
        for mine, theirs in zip(self.dense_variables, dense_weights(network), strict=True):
            mine.assign(theirs)

    def reindex(self) -> None:
        """Rebuilds both indexes from the ids `copy_from` copied."""
        for name in TABLES:
            getattr(self, name).reindex()

    def trim(self) -> None:
        """Drops the rows both tables allocated ahead as publications were applied
        (before the version is written)."""
        for name in TABLES:
            getattr(self, name).trim()

    # -- the server's side -----------------------------------------------------

    def prepare(self, tables: dict[str, dict[str, np.ndarray]], dense: list[np.ndarray]) -> tuple:
        """One publication's changes (`publications.Publication`: each table's changed
        rows and size, the dense weights) as the tensors `apply_prepared` takes: made
        before a server stops its readers."""
        return (
            {
                name: (
                    tf.constant(tables[name]["slots"], tf.int64),
                    tf.constant(tables[name]["keys"], tf.int64),
                    tf.constant(tables[name]["rows"], tf.float32),
                    tf.constant(tables[name]["size"], tf.int64),
                )
                for name in TABLES
            },
            [tf.constant(weight, tf.float32) for weight in dense],
        )

    def apply_prepared(self, prepared: tuple) -> dict[str, int]:
        """Applies `prepare`'s tensors in one graph call; returns, by table, the ids that
        left its index. Callers make it atomic for readers (`live_model`)."""
        left = self._apply(*prepared)
        return {name: int(count) for name, count in left.items()}

    def apply(
        self, tables: dict[str, dict[str, np.ndarray]], dense: list[np.ndarray]
    ) -> dict[str, int]:
        """`prepare` then `apply_prepared`."""
        return self.apply_prepared(self.prepare(tables, dense))

    def follow(self, tables: dict[str, dict[str, np.ndarray]], dense: list[np.ndarray]) -> None:
        """Applies a publication's changes but not to the indexes (`ServedTable.follow`):
        `reindex` before the version is read or written."""
        self._follow(*self.prepare(tables, dense))

    def _make_apply(self, follow: bool = False):
        """The graph function of `apply_prepared`, or with `follow` of `follow` (not part
        of the SavedModel)."""
        row = [
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None, self.users.rows.shape[1]], tf.float32),
            tf.TensorSpec([], tf.int64),
        ]
        dense = [tf.TensorSpec(weight.shape, tf.float32) for weight in self.dense_variables]

        def apply(tables: dict, weights: list) -> dict:
            change = "follow" if follow else "apply"
            left = {name: getattr(getattr(self, name), change)(*tables[name]) for name in TABLES}
            for variable, value in zip(self.dense_variables, weights, strict=True):
                variable.assign(value)
            return left

        signature = [{name: tuple(row) for name in TABLES}, dense]
        return tf.function(apply, input_signature=signature, autograph=False)

    def warm_up(self) -> None:
        """Traces both signatures and `apply_prepared` (a server's first requests and
        publications then wait for no tracing): an empty publication, which changes
        nothing."""
        self.serve(tf.constant([0], tf.int64), tf.constant([0], tf.int64))
        self.recommend(tf.constant([0], tf.int64), tf.constant(1))
        width = self.users.rows.shape[1]
        empty = {
            name: {
                "slots": np.zeros(0, np.int64),
                "keys": np.zeros(0, np.int64),
                "rows": np.zeros((0, width), np.float32),
                "size": int(getattr(self, name).size.numpy()),
            }
            for name in TABLES
        }
        self.apply(empty, [weight.numpy() for weight in self.dense_variables])
