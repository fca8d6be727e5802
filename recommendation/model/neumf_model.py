"""NeuMF (He et al., 2017) in Keras 3, its loss, HR/NDCG, and the Estimator-style model_fn.

The network is the reference's: one user and one item embedding table, each of width
``mf_dim + layers[0] / 2``; the first `mf_dim` columns feed generalised matrix
factorisation (element-wise product), the rest feed the MLP (concatenation, then Dense
+ ReLU layers); both parts are concatenated into a final Dense(1) logit. Sharing one
table per side for both parts means one gather instead of two, which the Model Garden
notes is faster. The NCF paper's GMF and MLP models are the same network with one part
left out (`MODEL_KINDS`), and MF is GMF with its output weights fixed at 1;
`combine_pretrained` starts NeuMF from a trained pair of them.

This module holds numerics only: no flags, no files, no logging.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import keras
import tensorflow as tf

from official.core import precision
from official.core.runner import Mode, ModelSpec, ModelState
from recommendation.data import constants

# What NeuMF scores with: both parts (NeuMF), the NCF paper's GMF or MLP model alone, or
# MF: GMF with its output weights fixed at 1, a dot product plus a bias (`NeuMF`).
NEUMF, GMF, MLP, MF = "neumf", "gmf", "mlp", "mf"
MODEL_KINDS = (NEUMF, GMF, MLP, MF)
# The kinds whose tables hold only GMF columns (an MF model pretrains NeuMF's GMF part).
GMF_ONLY = (GMF, MF)
OPTIMIZERS = ("adam", "sgd")


@dataclasses.dataclass(frozen=True)
class ModelParams:
    """Hyper-parameters of NeuMF and its optimiser (the reference's flag names).

    Attributes:
        num_users, num_items: Embedding table sizes.
        mf_dim: Width of the GMF part (``--num_factors``).
        layers: MLP widths; ``layers[0]`` is the concatenated MLP embedding width.
        mf_regularization: L2 weight on the embedding tables, whole, once per step.
        row_regularization: L2 weight on the table rows each training example looks
            up: every valid point adds ``row_regularization x (|user row|^2 + |item
            row|^2)`` to its loss, so a row is held back in proportion to how often it
            is trained, as per-example SGD matrix factorisation regularises (Rendle et
            al. 2020); `mf_regularization` shrinks rarely seen rows as much as common ones.
        mlp_regularization: L2 weight of each MLP layer (entry 0 is unused, as in the
            reference: layer 0 is the embedding concatenation).
        embedding_init: ``glorot_uniform`` (the MLPerf reference) or ``normal``
            (N(0, embedding_stddev^2)) for the embedding tables.
        embedding_stddev: The spread of ``normal``: 0.01 is the NCF paper's code's,
            0.1 Rendle et al.'s for SGD matrix factorisation.
        learning_rate: The optimiser's rate.
        beta1, beta2, epsilon: Adam's.
        weight_decay: Decoupled weight decay (AdamW): every step shrinks each weight
            by ``weight_decay * learning_rate`` of itself; 0 turns it off.
        learning_rate_decay: Factor applied to the learning rate once per epoch from
            epoch `decay_start_epoch` (0-based) on; 1.0 keeps it constant.
        decay_start_epoch: First epoch trained at the decayed rate.
        steps_per_epoch: Optimiser steps in one epoch (global batches); needed only
            when the rate decays.
        model_kind: ``neumf``, the paper's ``gmf`` or ``mlp`` alone, or ``mf``
            (`MODEL_KINDS`).
        optimizer: ``adam``, or ``sgd`` (plain SGD: the paper fine-tunes a pretrained
            NeuMF with it, having no Adam moments for the pretrained weights).
        top_k: k of HR@k and NDCG@k.
        eval_block_size: Items per evaluation user (negatives + the held-out one).
        sparse_updates: Update only the embedding rows a batch touches (lazy Adam)
            instead of dense Adam over whole tables (the MLPerf reference).
        dtype: ``fp32``, ``bf16`` or ``fp16`` compute (variables stay float32).
        loss_scale: fp16 only: a fixed loss scale, or None for dynamic scaling.
    """

    num_users: int
    num_items: int
    mf_dim: int = 8
    layers: tuple[int, ...] = (64, 32, 16, 8)
    mf_regularization: float = 0.0
    row_regularization: float = 0.0
    mlp_regularization: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    embedding_init: str = "glorot_uniform"
    embedding_stddev: float = 0.01
    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    learning_rate_decay: float = 1.0
    decay_start_epoch: int = 0
    steps_per_epoch: int = 0
    model_kind: str = NEUMF
    optimizer: str = OPTIMIZERS[0]
    top_k: int = 10
    eval_block_size: int = constants.NUM_EVAL_NEGATIVES + 1
    sparse_updates: bool = False
    dtype: str = "fp32"
    loss_scale: float | None = None

    def __post_init__(self):
        if self.layers[0] % 2:
            raise ValueError(f"layers[0] must be even, got {self.layers}")
        if len(self.layers) != len(self.mlp_regularization):
            raise ValueError(
                "mlp_regularization needs one value per layer: "
                f"{self.layers} vs {self.mlp_regularization}"
            )
        if self.weight_decay and self.sparse_updates:
            raise ValueError(
                "weight decay shrinks every embedding row each step, which sparse "
                "updates exist to avoid: use dense updates or no weight decay"
            )
        if self.loss_scale is not None and self.dtype != "fp16":
            raise ValueError(f"a loss scale needs fp16 compute, got dtype {self.dtype!r}")
        if self.embedding_init not in EMBEDDING_INITS:
            raise ValueError(
                f"embedding_init must be one of {sorted(EMBEDDING_INITS)}, "
                f"got {self.embedding_init!r}"
            )
        if not self.embedding_stddev > 0:
            raise ValueError(f"embedding_stddev must be > 0, got {self.embedding_stddev}")
        if (
            self.embedding_init != "normal"
            and self.embedding_stddev != ModelParams.embedding_stddev
        ):
            raise ValueError(
                f"embedding_stddev is the spread of the normal initialiser; "
                f"{self.embedding_init!r} has none of its own"
            )
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"model_kind must be one of {MODEL_KINDS}, got {self.model_kind!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")


# Embedding-table initialisers by name: the MLPerf reference's, and the NCF paper
# code's (Keras 1 ``normal`` with scale 0.01).
EMBEDDING_INITS = {  # name: initializer of the given normal spread
    "glorot_uniform": lambda stddev: keras.initializers.GlorotUniform(),
    "normal": lambda stddev: keras.initializers.RandomNormal(stddev=stddev),
}


@keras.saving.register_keras_serializable(package="ncf")
class GmfBlock(keras.layers.Layer):
    """Generalised matrix factorisation: the element-wise product of two embeddings.

    Call args:
        user: `(batch, mf_dim)` user factors.
        item: `(batch, mf_dim)` item factors.
    Returns:
        `(batch, mf_dim)` interaction vector.
    """

    def call(self, user, item):
        if user.shape[-1] != item.shape[-1]:
            raise ValueError(f"user and item widths differ: {user.shape} vs {item.shape}")
        return user * item


@keras.saving.register_keras_serializable(package="ncf")
class NeuMF(keras.Model):
    """NeuMF scoring (user, item) pairs, or the NCF paper's GMF or MLP model alone.

    A GMF model is NeuMF without the MLP part (tables of width `mf_dim`, the logit of
    the element-wise product), an MLP model NeuMF without the GMF part (tables of width
    ``layers[0] / 2``, the logit of the tower): one network, one set of scoring paths.
    An MF model is a GMF model whose logit weights are fixed at 1 (only their bias
    trains): GMF's free weights can grow while the tables shrink, which undoes an L2 on
    the tables; fixed, the L2 holds. Its weights are a GMF model's, so its checkpoint
    pretrains NeuMF's GMF part.

    Each side's table is either made here (a ``keras.layers.Embedding`` of `num_users`
    or `num_items` rows) or given (`user_embedding`, `item_embedding`): online training
    gives hash embeddings, whose size is a capacity rather than a number of users.

    Args:
        num_users, num_items: Rows of the tables made here; None for a given table.
        mf_dim: GMF width.
        layers: MLP widths, ``layers[0]`` even.
        mf_regularization: L2 on the tables made here.
        mlp_regularization: L2 per MLP layer.
        embedding_init: A name in `EMBEDDING_INITS`, for the tables made here.
        embedding_stddev: The spread of the ``normal`` one.
        model_kind: One of `MODEL_KINDS`.
        user_embedding, item_embedding: Given tables: layers taking `(batch,)` ids to
            `(batch, table_width(mf_dim, layers))` rows, with their own sizes,
            initialisers and regularisers.

    Call args:
        inputs: dict with ``user_id`` and ``item_id``, each `(batch,)` int32.
    Returns:
        `(batch, 1)` logits.
    """

    def __init__(
        self,
        num_users: int | None = None,
        num_items: int | None = None,
        mf_dim: int = ModelParams.mf_dim,
        layers: tuple[int, ...] = ModelParams.layers,
        mf_regularization: float = ModelParams.mf_regularization,
        mlp_regularization: tuple[float, ...] = ModelParams.mlp_regularization,
        embedding_init: str = ModelParams.embedding_init,
        model_kind: str = ModelParams.model_kind,
        embedding_stddev: float = ModelParams.embedding_stddev,
        user_embedding: keras.layers.Layer | None = None,
        item_embedding: keras.layers.Layer | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.embedding_init, self.embedding_stddev = embedding_init, float(embedding_stddev)
        self.num_users, self.num_items, self.mf_dim = num_users, num_items, mf_dim
        self.layer_sizes = tuple(int(width) for width in layers)
        self.mf_regularization = float(mf_regularization)
        self.mlp_regularization = tuple(float(value) for value in mlp_regularization)
        self.model_kind = model_kind
        self.gmf_width, self.mlp_width = self.part_widths(mf_dim, self.layer_sizes, model_kind)
        width = self.gmf_width + self.mlp_width
        # The tables first: the order of the trainable variables (and so of the
        # optimiser's slots in a checkpoint) follows the order of assignment.
        self.user_embedding = self._table("user", num_users, user_embedding, width)
        self.item_embedding = self._table("item", num_items, item_embedding, width)
        self.gmf = GmfBlock(name="gmf") if self.gmf_width else None
        self.mlp = [
            keras.layers.Dense(
                units,
                activation="relu",
                name=f"mlp_{index}",
                kernel_regularizer=keras.regularizers.L2(self.mlp_regularization[index])
                if self.mlp_regularization[index]
                else None,
            )
            for index, units in enumerate(self.layer_sizes[1:], start=1)
            if self.mlp_width
        ]
        for layer in self.mlp:
            # TensorFlow checkpoints follow attributes, not Keras' tracked list: without
            # this, `tf.train.Checkpoint(model=...)` would hold no MLP weight.
            setattr(self, layer.name, layer)
        self.logit = keras.layers.Dense(
            1, kernel_initializer="ones" if model_kind == MF else "lecun_uniform", name="rating"
        )
        if model_kind == MF:
            self.logit.build((None, self.gmf_width))
            self.logit.kernel.trainable = False  # still a weight, in its place, as GMF's

    @staticmethod
    def table_width(mf_dim: int, layers: tuple[int, ...], model_kind: str = NEUMF) -> int:
        """Columns of a table row: the GMF part, then this side's half of the MLP input."""
        return sum(NeuMF.part_widths(mf_dim, layers, model_kind))

    @staticmethod
    def part_widths(mf_dim: int, layers: tuple[int, ...], model_kind: str) -> tuple[int, int]:
        """Columns of a table row for GMF and for the MLP: 0 for the part a GMF, MF or
        MLP model leaves out."""
        if model_kind not in MODEL_KINDS:
            raise ValueError(f"model_kind must be one of {MODEL_KINDS}, got {model_kind!r}")
        gmf = 0 if model_kind == MLP else mf_dim
        return gmf, (0 if model_kind in GMF_ONLY else layers[0] // 2)

    def _table(
        self, side: str, count: int | None, given: keras.layers.Layer | None, width: int
    ) -> keras.layers.Layer:
        """The `given` table, or an Embedding of `count` rows made here."""
        if (count is None) == (given is None):
            raise ValueError(
                f"give num_{side}s or {side}_embedding (exactly one), got {count} and {given}"
            )
        if given is not None:
            return given
        return keras.layers.Embedding(
            count,
            width,
            embeddings_initializer=EMBEDDING_INITS[self.embedding_init](self.embedding_stddev),
            embeddings_regularizer=keras.regularizers.L2(self.mf_regularization)
            if self.mf_regularization
            else None,
            name=f"embedding_{side}",
        )

    def call(self, inputs):
        users, items = inputs[constants.USER_COLUMN], inputs[constants.ITEM_COLUMN]
        if self.mlp and self._project_tables_first(users.shape[0]):
            return self._score_from_tables(users, items)
        return self.score(self.user_embedding(users), self.item_embedding(items))

    def squared_row_norms(self, inputs) -> tf.Tensor:
        """`(batch,)` float32: the squared norm of each pair's user row plus its item
        row's (what `ModelParams.row_regularization` weighs)."""
        norms = [
            keras.ops.sum(keras.ops.square(keras.ops.cast(table(inputs[column]), "float32")), -1)
            for table, column in (
                (self.user_embedding, constants.USER_COLUMN),
                (self.item_embedding, constants.ITEM_COLUMN),
            )
        ]
        return norms[0] + norms[1]

    def score(self, user, item):
        """Logits `(batch, 1)` from looked-up rows `(batch, width)` of each side."""
        (user_gmf, user_mlp), (item_gmf, item_mlp) = self._parts(user), self._parts(item)
        gmf = None if user_gmf is None else self.gmf(user_gmf, item_gmf)
        mlp = None if user_mlp is None else keras.ops.concatenate([user_mlp, item_mlp], -1)
        return self._head(gmf, mlp, self.mlp)

    def _parts(self, rows):
        """(GMF columns, MLP columns) of rows (looked up, or a whole table), None for a
        part the model has not. One split: its gradient is one concatenation, where two
        slices' would be two zero-filled full-width tensors and their sum."""
        if not self.mlp_width:
            return rows, None
        if not self.gmf_width:
            return None, rows
        return tuple(keras.ops.split(rows, [self.gmf_width], axis=-1))

    def _gmf(self, user, item):
        """The GMF vector of rows of each side (or of their GMF columns); None without
        a GMF part."""
        if not self.gmf_width:
            return None
        return self.gmf(user[..., : self.gmf_width], item[..., : self.gmf_width])

    def _head(self, gmf, mlp, layers):
        """Logits from the GMF vector and the MLP input (or, without the first of
        `layers`, the first layer's output); either is None where the model has no
        such part."""
        parts = [] if gmf is None else [gmf]
        if mlp is not None:
            for layer in layers:
                mlp = layer(mlp)
            parts.append(mlp)
        return self.logit(parts[0] if len(parts) == 1 else keras.ops.concatenate(parts, -1))

    def _project_tables_first(self, batch_size: int | None) -> bool:
        """Whether the first MLP layer is cheaper applied to the tables than to the batch.

        ``Dense([u; i]) = u W_u + i W_i + b``, and ``u W_u`` for a looked-up row is a row
        of ``E_user W_u``: multiplying the (users + items) table rows once costs less
        than multiplying 2 x batch looked-up halves when the batch is the larger. The
        result and its gradients are the same function of the weights. Only with the
        tables made here: a given one (a hash table, mostly empty rows) is never projected.
        """
        if self.num_users is None or self.num_items is None or batch_size is None:
            return False
        return self.num_users + self.num_items < 2 * batch_size

    def _score_from_tables(self, users, items):
        """`call` with the first MLP layer applied to the tables: each example gathers
        only its rows' GMF columns and their first-layer terms, so the backward pass
        scatters no gradient of zeros into the MLP columns of a batch-sized tensor."""
        gmf_rows, terms = [], []
        for side, (embedding, ids) in enumerate(
            ((self.user_embedding, users), (self.item_embedding, items))
        ):
            table_gmf, table_mlp = self._parts(self._table_rows(embedding))
            if table_gmf is not None:
                gmf_rows.append(take_rows(table_gmf, ids))
            terms.append(self._first_layer_term(table_mlp, side))
        gmf = self.gmf(*gmf_rows) if gmf_rows else None
        return self._head(gmf, first_layer_of_rows(*terms, users, items), self.mlp[1:])

    def _table_rows(self, embedding: keras.layers.Embedding):
        return keras.ops.cast(embedding.embeddings, self.compute_dtype)

    def _first_layer_term(self, rows, side: int):
        """``u W_u + b`` (side 0) or ``i W_i`` (side 1): one half of the first MLP layer,
        the bias on the user side, whose rows are fewer than the pairs they serve (so
        its gradient is a sum over those rows, not over the batch)."""
        half = self.layer_sizes[0] // 2
        first = self.mlp[0]
        kernel = keras.ops.cast(first.kernel, self.compute_dtype)
        if side:
            return keras.ops.matmul(rows, kernel[half:])
        return keras.ops.matmul(rows, kernel[:half]) + keras.ops.cast(
            first.bias, self.compute_dtype
        )

    def _first_layer_output(self, user_term, item_term):
        return self.mlp[0].activation(user_term + item_term)

    def _score_grid(self, user, item, item_term=None):
        """Logits `(U, N)` of user rows `(U, 1, width)` against item rows `(U or 1, N,
        width)`; `item_term`, when given, is the item half of the first MLP layer for
        `item` (whose rows then need only their GMF part)."""
        gmf = self._gmf(user, item)
        if self.mlp:
            if item_term is None:
                item_term = self._first_layer_term(item[..., self.gmf_width :], 1)
            first = self._first_layer_output(
                self._first_layer_term(user[..., self.gmf_width :], 0), item_term
            )
            return self._head(gmf, first, self.mlp[1:])[..., 0]
        mlp = None
        if self.mlp_width:
            # (users, items): users from the user rows, items from the item rows.
            shape = (keras.ops.shape(user)[0], keras.ops.shape(item)[1], self.mlp_width)
            mlp = keras.ops.concatenate(
                [
                    keras.ops.broadcast_to(part[..., self.gmf_width :], shape)
                    for part in (user, item)
                ],
                axis=-1,
            )
        return self._head(gmf, mlp, ())[..., 0]

    def score_all_items(self, users):
        """Logits of every item for each of `users`: what top-k recommendation needs.

        The same function of the weights as `call` on every (user, item) pair, but each
        user row and the item table go through the first MLP layer once (see
        `_project_tables_first`) instead of once per pair.

        Args:
            users: `(batch,)` int32 user indexes.
        Returns:
            `(batch, num_items)` logits in the compute dtype.
        """
        user = self.user_embedding(users)[:, None, :]
        return self._score_grid(user, self._table_rows(self.item_embedding)[None])

    def score_blocks(self, users, items):
        """Logits of each user's block of items: what evaluation needs.

        The same function of the weights as `call` on every (user, item) pair, but each
        user's row goes through the first MLP layer once per block, and the item table
        (when made here and smaller than the batch) once per call: at the MLPerf ml-20m
        size that is 1.6x fewer FLOPs than `call` on the flattened pairs.

        Args:
            users: `(users,)` int32 user indexes.
            items: `(users, block)` int32 item indexes.
        Returns:
            `(users, block)` logits in the compute dtype.
        """
        user = self.user_embedding(users)[:, None, :]
        points = None if None in items.shape else items.shape[0] * items.shape[1]
        if self.mlp and self.num_items is not None and points and self.num_items < points:
            table = self._table_rows(self.item_embedding)
            item_term = self._first_layer_term(table[:, self.gmf_width :], 1)
            return self._score_grid(
                user,
                keras.ops.take(table[:, : self.gmf_width], items, axis=0),
                keras.ops.take(item_term, items, axis=0),
            )
        return self._score_grid(user, self.item_embedding(items))

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            num_users=self.num_users,
            num_items=self.num_items,
            mf_dim=self.mf_dim,
            layers=self.layer_sizes,
            mf_regularization=self.mf_regularization,
            mlp_regularization=self.mlp_regularization,
            embedding_init=self.embedding_init,
            embedding_stddev=self.embedding_stddev,
            model_kind=self.model_kind,
        )
        for key, count in (("user_embedding", self.num_users), ("item_embedding", self.num_items)):
            if count is None:  # a given table: saved as its layer config
                config[key] = keras.saving.serialize_keras_object(getattr(self, key))
        return config

    @classmethod
    def from_config(cls, config: dict) -> NeuMF:
        tables = {
            key: keras.saving.deserialize_keras_object(config[key])
            for key in ("user_embedding", "item_embedding")
            if key in config
        }
        return cls(**{**config, **tables})


def dense_gradient(gradient: tf.IndexedSlices) -> tf.Tensor:
    """The dense tensor of a row gather's gradient, bit for bit TensorFlow's own
    conversion (UnsortedSegmentSum, 3.5x slower than a scatter here). The scatter is
    compiled by XLA where the table's row count is known when the step is traced and
    the step is large (`compiled_for_large_steps`): TensorFlow's kernel pays about 0.2 us
    a row, XLA's loop put 65,536 rows of 256 into 6,040 in 3 ms against 13. Not for
    LazyAdam's unique rows, whose count changes each step (a compilation each)."""
    rows = tf.get_static_value(gradient.dense_shape)
    if rows is None:
        rows = tf.cast(gradient.dense_shape[0], tf.int32)
        return _scatter_rows(gradient.indices, gradient.values, rows)
    return _compiled_scatter_rows(gradient.indices, gradient.values, int(rows[0]))


def _scatter_rows(ids: tf.Tensor, values: tf.Tensor, rows: int | tf.Tensor) -> tf.Tensor:
    """``(rows, width)`` zeros with each row of `values` added at its row in `ids`."""
    zeros = tf.zeros([rows, tf.shape(values)[1]], values.dtype)
    return tf.tensor_scatter_nd_add(zeros, ids[:, None], values)


# Below this many elements in its largest input a loop runs as TensorFlow ops: XLA's
# compilation (40-80 ms per shape here) costs more than a small step saves.
COMPILE_MIN_ELEMENTS = 2**18


def compiled_for_large_steps(function: Callable) -> Callable:
    """`function` XLA-compiled where a step is traced and its largest input has at least
    `COMPILE_MIN_ELEMENTS` (an unknown shape counts as large); run op by op otherwise,
    and where the step runs eagerly (``--run_eagerly``: no graphs, no XLA). Both give
    the same bits."""
    compiled = tf.function(function, jit_compile=True)

    @functools.wraps(function)
    def call(*args):
        sizes = [arg.shape.num_elements() for arg in args if isinstance(arg, tf.Tensor)]
        large = None in sizes or max(sizes) >= COMPILE_MIN_ELEMENTS
        return (compiled if large and not tf.executing_eagerly() else function)(*args)

    call.compiled = compiled
    return call


# Traced once per table (`rows`, a Python int) and batch shape.
_compiled_scatter_rows = compiled_for_large_steps(_scatter_rows)


@tf.custom_gradient
def take_rows(table: tf.Tensor, ids: tf.Tensor):
    """``tf.gather(table, ids)`` whose gradient is built dense by `dense_gradient`'s
    scatter: for a table computed in the step (a projected first-layer term), which
    TensorFlow would otherwise densify with UnsortedSegmentSum."""

    def gradient(upstream):
        slices = tf.IndexedSlices(upstream, ids, tf.shape(table, out_type=tf.int64))
        return dense_gradient(slices), None

    return tf.gather(table, ids), gradient


@tf.custom_gradient
def first_layer_of_rows(user_terms, item_terms, users, items):
    """``relu(user_terms[users] + item_terms[items])``: the first MLP layer's output
    from the tables' first-layer terms, each way one loop over the batch (gathers, sum
    and ReLU; ReLU's gradient and the two scatters of `dense_gradient`), XLA-compiled for
    large steps (`compiled_for_large_steps`) instead of five TensorFlow ops, each a pass
    over a batch x width tensor."""
    output = _compiled_first_layer(user_terms, item_terms, users, items)

    def gradient(upstream):
        rows = (user_terms.shape[0], item_terms.shape[0])
        return (*_compiled_first_layer_gradient(upstream, output, users, items, rows), None, None)

    return output, gradient


@compiled_for_large_steps
def _compiled_first_layer(user_terms, item_terms, users, items):
    return tf.nn.relu(tf.gather(user_terms, users) + tf.gather(item_terms, items))


@compiled_for_large_steps
def _compiled_first_layer_gradient(upstream, output, users, items, rows):
    upstream = tf.where(output > 0, upstream, tf.zeros_like(upstream))  # ReluGrad's
    return _scatter_rows(users, upstream, rows[0]), _scatter_rows(items, upstream, rows[1])


def build_model(params: ModelParams) -> NeuMF:
    """Builds NeuMF (variables created) under the compute-dtype policy of `params`."""
    keras.mixed_precision.set_global_policy(precision.POLICIES[params.dtype])
    model = NeuMF(
        params.num_users,
        params.num_items,
        params.mf_dim,
        params.layers,
        params.mf_regularization,
        params.mlp_regularization,
        params.embedding_init,
        params.model_kind,
        params.embedding_stddev,
    )
    model(
        {
            constants.USER_COLUMN: tf.zeros([1], tf.int32),
            constants.ITEM_COLUMN: tf.zeros([1], tf.int32),
        }
    )
    return model


def combine_pretrained(neumf: NeuMF, gmf: NeuMF, mlp: NeuMF, alpha: float) -> None:
    """Sets `neumf`'s weights from a trained GMF and MLP model, as the NCF paper starts
    NeuMF (He et al. 2017, section 3.4.1): each side's table is the GMF table beside the
    MLP table, the MLP layers are the MLP model's, and the logit layer weighs the two
    models' logit layers by `alpha` and ``1 - alpha``: kernel ``[alpha w_GMF;
    (1 - alpha) w_MLP]``, bias ``alpha b_GMF + (1 - alpha) b_MLP`` (the paper's code,
    which fixes alpha at 0.5: ``0.5 (b_GMF + b_MLP)``). So NeuMF's logit starts as
    ``alpha logit_GMF + (1 - alpha) logit_MLP`` of every pair.

    Raises:
        ValueError: The models are not of the kinds or sizes this needs.
    """
    if neumf.model_kind != NEUMF or gmf.model_kind not in GMF_ONLY or mlp.model_kind != MLP:
        raise ValueError(
            "combine_pretrained needs a NeuMF, a GMF (or MF) and an MLP model, got "
            f"{neumf.model_kind}, {gmf.model_kind} and {mlp.model_kind}"
        )
    for ours, *theirs in (
        (neumf.user_embedding, gmf.user_embedding, mlp.user_embedding),
        (neumf.item_embedding, gmf.item_embedding, mlp.item_embedding),
    ):
        ours.embeddings.assign(tf.concat([table.embeddings for table in theirs], axis=1))
    for ours, theirs in zip(neumf.mlp, mlp.mlp, strict=True):
        ours.kernel.assign(theirs.kernel)
        ours.bias.assign(theirs.bias)
    neumf.logit.kernel.assign(
        tf.concat([alpha * gmf.logit.kernel, (1 - alpha) * mlp.logit.kernel], axis=0)
    )
    neumf.logit.bias.assign(alpha * gmf.logit.bias + (1 - alpha) * mlp.logit.bias)


@keras.saving.register_keras_serializable(package="ncf")
class LazyAdam(keras.optimizers.Adam):
    """Adam that updates only the embedding rows present in a sparse gradient.

    Rows a batch does not touch keep their weights and moments (dense Adam decays
    every row's moments each step and so moves rows no example touched). Dense
    gradients get ordinary Adam.
    """

    def update_step(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)

        def tf_variable(v):  # a Keras variable's tf.Variable
            return v.value if isinstance(v, keras.Variable) else v

        lazy_adam_rows(
            gradient,
            tf_variable(variable),
            tf_variable(self._momentums[index]),
            tf_variable(self._velocities[index]),
            tf.cast(learning_rate, variable.dtype),
            self.beta_1,
            self.beta_2,
            self.epsilon,
            tf.cast(self.iterations + 1, variable.dtype),
        )


def lazy_adam_rows(
    gradient: tf.IndexedSlices,
    variable: tf.Variable,
    momentum: tf.Variable,
    velocity: tf.Variable,
    learning_rate: tf.Tensor,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    step: tf.Tensor,
) -> None:
    """One Adam step (number `step`, from 1) of the rows present in `gradient` and of
    their moments; other rows keep their weights and moments. LazyAdam's update, and
    hash-embedding rows' (`HashEmbedding.train_rows`)."""
    rows, positions = tf.unique(gradient.indices)
    width = tf.shape(gradient.values, out_type=tf.int64)[1]
    grad = dense_gradient(
        tf.IndexedSlices(gradient.values, positions, tf.stack([tf.size(rows, tf.int64), width]))
    )
    alpha = learning_rate * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
    # Gathered from the tf.Variables (a ResourceGather): a dense read of a variable
    # that scatters write copies all of it first.
    new_m = beta_1 * tf.gather(momentum, rows) + (1 - beta_1) * grad
    new_v = beta_2 * tf.gather(velocity, rows) + (1 - beta_2) * tf.square(grad)
    momentum.scatter_update(tf.IndexedSlices(new_m, rows))
    velocity.scatter_update(tf.IndexedSlices(new_v, rows))
    variable.scatter_sub(tf.IndexedSlices(alpha * new_m / (tf.sqrt(new_v) + epsilon), rows))


def decayed_learning_rate(params: ModelParams, step: tf.Tensor) -> tf.Tensor:
    """The rate of optimiser step `step`: constant, then shrinking once per epoch.

    Small models on MovieLens peak after a few epochs and then over-fit; decaying the
    rate from there holds the hit rate near the level it had reached instead (on the
    NCF paper split it does not raise the peak: docs/benchmarks.md). Epoch `e` trains at
    ``learning_rate * learning_rate_decay ** max(0, e - decay_start_epoch + 1)``; the
    epoch is the step divided by `steps_per_epoch`, so a resumed run continues the
    decay where its checkpoint left it.
    """
    if params.steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be positive, got {params.steps_per_epoch}")
    epoch = tf.cast(step // params.steps_per_epoch, tf.float32)
    decays = tf.maximum(0.0, epoch - params.decay_start_epoch + 1.0)
    return params.learning_rate * tf.pow(float(params.learning_rate_decay), decays)


def set_learning_rate(optimizer: keras.optimizers.Optimizer, params: ModelParams) -> None:
    """Sets the rate of the coming step: `params`' rate, decayed when it asks for decay.

    The rate stays the optimiser's variable rather than becoming a Keras schedule, so
    checkpoints hold the same variables with or without decay; setting it every step
    makes the flags, not the restored variable, decide the rate of a resumed run.
    """
    rate = params.learning_rate
    if params.learning_rate_decay != 1.0:
        rate = decayed_learning_rate(params, optimizer.iterations)
    optimizer.learning_rate.assign(rate)


def build_optimizer(params: ModelParams) -> keras.optimizers.Optimizer:
    """Adam with the reference's hyper-parameters (AdamW with `weight_decay`), or plain
    SGD (decoupled weight decay too: each step shrinks a weight by `weight_decay` x the
    rate of itself), which with sparse updates already moves only the rows a batch
    touches; fp16 adds dynamic loss scaling unless `params` fixes the scale
    (`_train_spec` applies that)."""
    if params.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(
            learning_rate=params.learning_rate, weight_decay=params.weight_decay or None
        )
    else:
        adam = LazyAdam if params.sparse_updates else keras.optimizers.Adam
        optimizer = adam(
            learning_rate=params.learning_rate,
            beta_1=params.beta1,
            beta_2=params.beta2,
            epsilon=params.epsilon,
            weight_decay=params.weight_decay or None,
        )
    return precision.with_loss_scaling(
        optimizer, precision.POLICIES[params.dtype], params.loss_scale
    )


def build_state(params: ModelParams) -> ModelState:
    """The model and optimiser a `Runner` trains (its ``build_state``)."""
    return ModelState(build_model(params), build_optimizer(params))


# ---------------------------------------------------------------------------
# Loss and metrics


def weighted_sigmoid_cross_entropy(
    logits: tf.Tensor, labels: tf.Tensor, valid: tf.Tensor
) -> tf.Tensor:
    """Sum of per-point sigmoid cross-entropy over valid points.

    The reference's softmax over ``[0, logit]`` is the same function:
    ``softmax([0, z])[1] = sigmoid(z)``.
    """
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.reduce_sum(losses * tf.cast(valid, losses.dtype))


def compute_hr_ndcg(
    logits: tf.Tensor, duplicate_mask: tf.Tensor | None, k: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-user hit (HR@k) and NDCG@k for blocks whose last item is the held-out one.

    The held-out item's rank is the number of other, non-duplicate items scoring at
    least as high: it sits last in its block and loses ties, as in the reference
    (whose stable descending sort puts equal scores at lower positions first).
    Duplicates count once. Example: scores ``[3, 5, 5, 1, 5]`` (held-out last, no
    duplicates) give rank 3, so HR@3 = 0, HR@4 = 1, NDCG@4 = log(2) / log(5).

    Args:
        logits: `(users, block)` scores.
        duplicate_mask: `(users, block)` bool, True for repeats; None for none.
        k: Cut-off.
    Returns:
        `(users,)` float32 hits and NDCGs.
    """
    logits = tf.cast(logits, tf.float32)
    positive = logits[:, -1:]
    beats = logits[:, :-1] >= positive
    if duplicate_mask is not None:
        beats = beats & ~duplicate_mask[:, :-1]
    rank = tf.reduce_sum(tf.cast(beats, tf.int32), axis=1)
    hit = tf.cast(rank < k, tf.float32)
    ndcg = hit * tf.math.log(2.0) / tf.math.log(tf.cast(rank, tf.float32) + 2.0)
    return hit, ndcg


# ---------------------------------------------------------------------------
# The Estimator-style contract


def model_fn(
    features: dict, labels: tf.Tensor | None, mode: Mode, params: ModelParams, state: ModelState
) -> ModelSpec:
    """Builds the TRAIN, EVAL or PREDICT computation for one replica's batch.

    Args:
        features: ``user_id``, ``item_id`` and ``valid_point_mask`` (TRAIN, EVAL),
            ``duplicate_mask`` (EVAL: blocks of evaluation items, held-out last).
        labels: `(batch,)` float 0/1 (TRAIN only).
        mode: What to build.
        params: Hyper-parameters.
        state: The model and optimiser whose variables are used.
    """
    if mode == Mode.PREDICT:
        logits = tf.cast(state.model(features, training=False)[:, 0], tf.float32)
        return ModelSpec(mode, predictions={"logits": logits, "scores": tf.sigmoid(logits)})
    if mode == Mode.EVAL:
        return _eval_spec(features, params, state)
    return _train_spec(features, labels, params, state)


def _train_spec(features, labels, params: ModelParams, state: ModelState) -> ModelSpec:
    valid = features[constants.VALID_POINT_MASK]
    context = tf.distribute.get_replica_context()
    num_valid = tf.reduce_sum(tf.cast(valid, tf.float32))
    global_valid = context.all_reduce(tf.distribute.ReduceOp.SUM, num_valid)
    model, optimizer = state.model, state.optimizer
    with tf.GradientTape() as tape:
        logits = tf.cast(model(features, training=True)[:, 0], tf.float32)
        loss_sum = weighted_sigmoid_cross_entropy(logits, labels, valid)
        loss = loss_sum / tf.maximum(global_valid, 1.0)
        if params.row_regularization:
            norms = model.squared_row_norms(features) * tf.cast(valid, tf.float32)
            loss += params.row_regularization * tf.reduce_sum(norms) / tf.maximum(global_valid, 1.0)
        if model.losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        if params.loss_scale is None:
            scaled = optimizer.scale_loss(loss)  # identity unless dynamic fp16 scaling
        else:
            scaled = loss * params.loss_scale
    variables = model.trainable_variables
    gradients = tape.gradient(scaled, variables)
    if params.loss_scale is not None:
        # Keras' own fixed scale (`loss_scale_factor`) cannot unscale the sparse
        # (IndexedSlices) gradients of the embedding tables; keras.ops keeps them sparse.
        gradients = [keras.ops.divide(g, params.loss_scale) for g in gradients]
    if not params.sparse_updates:
        # MLPerf's reference applies dense Adam to whole embedding tables.
        gradients = [dense_gradient(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients]
    set_learning_rate(optimizer, params)
    train_op = optimizer.apply(gradients, variables)
    return ModelSpec(
        Mode.TRAIN,
        loss=loss,
        train_op=train_op,
        metrics={"loss_sum": loss_sum, "num_points": num_valid},
        summarize=summarize_train,
    )


def _eval_spec(features, params: ModelParams, state: ModelState) -> ModelSpec:
    block = params.eval_block_size
    users = tf.reshape(features[constants.USER_COLUMN], [-1, block])[:, 0]
    items = tf.reshape(features[constants.ITEM_COLUMN], [-1, block])
    logits = tf.cast(state.model.score_blocks(users, items), tf.float32)
    duplicates = tf.reshape(features[constants.DUPLICATE_MASK], [-1, block])
    valid_users = tf.reshape(features[constants.VALID_POINT_MASK], [-1, block])[:, 0]
    hit, ndcg = compute_hr_ndcg(logits, duplicates, params.top_k)
    weight = tf.cast(valid_users, tf.float32)
    return ModelSpec(
        Mode.EVAL,
        metrics={
            "hits": tf.reduce_sum(hit * weight),
            "ndcg": tf.reduce_sum(ndcg * weight),
            "num_users": tf.reduce_sum(weight),
        },
        summarize=summarize_eval,
    )


def summarize_train(totals: dict[str, float]) -> dict[str, float]:
    """The TRAIN metrics from the sums over every replica and step: ``loss`` (mean
    cross-entropy per valid point, without L2) and ``num_points``."""
    return {
        "loss": totals["loss_sum"] / max(totals["num_points"], 1.0),
        "num_points": totals["num_points"],
    }


def summarize_eval(totals: dict[str, float]) -> dict[str, float]:
    """The EVAL metrics from the sums over every replica and step: ``hr`` and ``ndcg``
    (means over real users, padding excluded) and ``num_users``."""
    users = max(totals["num_users"], 1.0)
    return {
        "hr": totals["hits"] / users,
        "ndcg": totals["ndcg"] / users,
        "num_users": totals["num_users"],
    }
