"""NeuMF behind raw-id signatures, the `tf.Module` a serving export saves.

The SavedModel speaks the dataset's raw ids (the ids of the ratings file), mapped
through the id maps of preprocessing:

- ``serving_default(user_id int64 [n], item_id int64 [n])`` -> ``logits``, ``scores``
  (probabilities) float32 `[n]` and ``known`` bool `[n]`;
- ``recommend(user_id int64 [n], k int32 [], exclude_seen bool [])`` -> ``item_ids``
  int64 `[n, k]` and ``scores`` float32 `[n, k]`, best first, and ``known`` bool `[n]`.
  With ``exclude_seen`` the user's training items are never returned.

Unknown ids are never looked up as some other row: their ``known`` is False, their
logits and scores are NaN and their recommended item ids -1. Slots past the last
item a user can still be recommended also hold -1 and NaN; k above the number of
items is cut to it.

Everything serving needs is inside the export: the id maps as assets
(``assets/user_ids.txt``, ``assets/item_ids.txt``: line i holds the raw id of index i),
the training interactions (CSR ``train_offsets`` / ``train_items``) and the index ->
raw item id map as variables beside the weights, and with ``--export_onnx`` the
scoring signature converted by tf2onnx as ``model.onnx`` (same inputs and outputs,
id maps included), checked against the SavedModel with onnxruntime before the export
is renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.model.network import NeuMF
from recommendation.serving.export_files import ITEM_IDS_FILE, USER_IDS_FILE


class ServingModule(tf.Module):
    """NeuMF behind the raw-id signatures described in the module docstring.

    Args:
        model: The trained model (its variables are shared, not copied).
        predict: ``features -> {"logits", "scores"}`` for dense indexes (the runner's
            PREDICT computation).
        data: The preprocessed data the model was trained on.
        asset_dir: Where the id-map files are written before the export copies them.
    """

    def __init__(
        self,
        model: NeuMF,
        predict: Callable[[dict], dict],
        data: PreprocessedData,
        asset_dir: str,
    ) -> None:
        super().__init__()
        self.model = model
        self._predict = predict
        self.num_items = data.num_items
        self.user_table = _id_table(_write_ids(asset_dir, USER_IDS_FILE, data.user_ids))
        self.item_table = _id_table(_write_ids(asset_dir, ITEM_IDS_FILE, data.item_ids))
        self.item_ids = tf.Variable(data.item_ids, trainable=False, name="item_ids")
        self.train_offsets = tf.Variable(data.train_offsets, trainable=False, name="offsets")
        self.train_items = tf.Variable(data.train_items, trainable=False, name="train_items")

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64, constants.USER_COLUMN),
            tf.TensorSpec([None], tf.int64, constants.ITEM_COLUMN),
        ],
        autograph=False,
    )
    def score(self, user_id: tf.Tensor, item_id: tf.Tensor) -> dict[str, tf.Tensor]:
        """``serving_default``: probabilities of (user, item) pairs given by raw id."""
        users, user_known = _lookup(self.user_table, user_id)
        items, item_known = _lookup(self.item_table, item_id)
        known = user_known & item_known
        predictions = self._predict({constants.USER_COLUMN: users, constants.ITEM_COLUMN: items})
        # Adds 0 (0 / 1) to known pairs and NaN (0 / 0) to unknown ones. tf2onnx turns
        # tf.where into a multiply-add, which would spread the NaN to every pair.
        nan_if_unknown = 0.0 / tf.cast(known, tf.float32)
        outputs = {key: value + nan_if_unknown for key, value in predictions.items()}
        return {**outputs, "known": known}

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64, constants.USER_COLUMN),
            tf.TensorSpec([], tf.int32, "k"),
            tf.TensorSpec([], tf.bool, "exclude_seen"),
        ],
        autograph=False,
    )
    def recommend(
        self, user_id: tf.Tensor, k: tf.Tensor, exclude_seen: tf.Tensor
    ) -> dict[str, tf.Tensor]:
        """``recommend``: each user's top-k items, scored against every item at once."""
        tf.debugging.assert_positive(k, message="k must be at least 1")
        users, known = _lookup(self.user_table, user_id)
        logits = tf.cast(self.model.score_all_items(users), tf.float32)
        logits = tf.where(self._seen(users) & exclude_seen, -np.inf, logits)
        top = tf.math.top_k(logits, tf.minimum(k, self.num_items))
        valid = (top.values > -np.inf) & known[:, None]
        return {
            "item_ids": tf.where(valid, tf.gather(self.item_ids, top.indices), -1),
            "scores": tf.where(valid, tf.sigmoid(top.values), np.nan),
            "known": known,
        }

    def _seen(self, users):
        """`(n, num_items)` bool: True where the item is among the user's training items."""
        starts = tf.gather(self.train_offsets, users)
        ends = tf.gather(self.train_offsets, users + 1)
        positions = tf.ragged.range(starts, ends)
        items = tf.cast(tf.gather(self.train_items, positions.flat_values), tf.int64)
        indices = tf.stack([positions.value_rowids(), items], axis=1)
        return tf.tensor_scatter_nd_update(
            tf.zeros([tf.size(users), self.num_items], tf.bool),
            indices,
            tf.ones_like(items, tf.bool),
        )


def _write_ids(asset_dir: str, name: str, raw_ids: np.ndarray) -> tf.saved_model.Asset:
    path = os.path.join(asset_dir, name)
    with tf.io.gfile.GFile(path, "w") as out:
        out.write("\n".join(map(str, raw_ids.tolist())) + "\n")
    return tf.saved_model.Asset(path)


def _id_table(asset: tf.saved_model.Asset) -> tf.lookup.StaticHashTable:
    """raw id (as a decimal string) -> index, -1 if unknown.

    String keys because tf2onnx turns only string <-> int64 tables into ONNX
    (``CategoryMapper``); the lookup is the same either way.
    """
    initializer = tf.lookup.TextFileInitializer(
        asset,
        tf.string,
        tf.lookup.TextFileIndex.WHOLE_LINE,
        tf.int64,
        tf.lookup.TextFileIndex.LINE_NUMBER,
    )
    return tf.lookup.StaticHashTable(initializer, default_value=-1)


def _lookup(table: tf.lookup.StaticHashTable, raw_ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(int32 indexes, known); unknown ids get index 0, to be masked by `known`.

    Never -1: Keras embeddings wrap negative indexes round to the last row.
    """
    # The reshape states the rank, which tf2onnx cannot infer for a table lookup.
    indexes = tf.reshape(table.lookup(tf.strings.as_string(raw_ids)), [-1])
    return tf.cast(tf.maximum(indexes, 0), tf.int32), indexes >= 0
