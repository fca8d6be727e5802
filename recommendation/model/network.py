"""NeuMF (He et al., 2017) in Keras 3.

The network is the reference's: one user and one item embedding table, each of width
``mf_dim + layers[0] / 2``; the first `mf_dim` columns feed generalised matrix
factorisation (element-wise product), the rest feed the MLP (concatenation, then Dense
+ ReLU layers); both parts are concatenated into a final Dense(1) logit. Sharing one
table per side for both parts means one gather instead of two, which the Model Garden
notes is faster. The NCF paper's GMF and MLP models are the same network with one part
left out (`hyperparams.MODEL_KINDS`), and MF is GMF with its output weights fixed at 1;
`combine_pretrained` starts NeuMF from a trained pair of them.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from official.core import precision
from recommendation.data import constants
from recommendation.model import hyperparams, kernels


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
        mf_dim: int = hyperparams.ModelParams.mf_dim,
        layers: tuple[int, ...] = hyperparams.ModelParams.layers,
        mf_regularization: float = hyperparams.ModelParams.mf_regularization,
        mlp_regularization: tuple[float, ...] = hyperparams.ModelParams.mlp_regularization,
        embedding_init: str = hyperparams.ModelParams.embedding_init,
        model_kind: str = hyperparams.ModelParams.model_kind,
        embedding_stddev: float = hyperparams.ModelParams.embedding_stddev,
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
            1,
            kernel_initializer="ones" if model_kind == hyperparams.MF else "lecun_uniform",
            name="rating",
        )
        if model_kind == hyperparams.MF:
            self.logit.build((None, self.gmf_width))
            self.logit.kernel.trainable = False  # still a weight, in its place, as GMF's

    @staticmethod
    def table_width(
        mf_dim: int, layers: tuple[int, ...], model_kind: str = hyperparams.NEUMF
    ) -> int:
        """Columns of a table row: the GMF part, then this side's half of the MLP input."""
        return sum(NeuMF.part_widths(mf_dim, layers, model_kind))

    @staticmethod
    def part_widths(mf_dim: int, layers: tuple[int, ...], model_kind: str) -> tuple[int, int]:
        """Columns of a table row for GMF and for the MLP: 0 for the part a GMF, MF or
        MLP model leaves out."""
        if model_kind not in hyperparams.MODEL_KINDS:
            raise ValueError(
                f"model_kind must be one of {hyperparams.MODEL_KINDS}, got {model_kind!r}"
            )
        gmf = 0 if model_kind == hyperparams.MLP else mf_dim
        return gmf, (0 if model_kind in hyperparams.GMF_ONLY else layers[0] // 2)

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
            embeddings_initializer=hyperparams.EMBEDDING_INITS[self.embedding_init](
                self.embedding_stddev
            ),
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
                gmf_rows.append(kernels.take_rows(table_gmf, ids))
            terms.append(self._first_layer_term(table_mlp, side))
        gmf = self.gmf(*gmf_rows) if gmf_rows else None
        return self._head(gmf, kernels.first_layer_of_rows(*terms, users, items), self.mlp[1:])

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
        return self.score_against(users, self.item_side())

    def item_side(self) -> tuple:
        """The item table's share of every score: its rows (the GMF part only when the
        model has MLP layers) and its half of the first MLP layer (None without one).
        Computed once, it serves every block of users (`score_against`)."""
        table = self._table_rows(self.item_embedding)
        if not self.mlp:
            return table, None
        return table[:, : self.gmf_width], self._first_layer_term(table[:, self.gmf_width :], 1)

    def score_against(self, users, item_side: tuple):
        """Logits `(batch, num_items)` of `users` against `item_side` (`item_side()`).

        The logit layer is linear, so its GMF share is one matrix product, ``(u * w_gmf)
        i^T``, and no `(batch, num_items, mf_dim)` product is made; the MLP share runs
        the layers above the first on every pair.
        """
        rows, item_term = item_side
        user = self.user_embedding(users)
        if self.mlp_width and not self.mlp:  # the MLP halves feed the logit directly
            return self._score_grid(user[:, None, :], rows[None])
        kernel = keras.ops.cast(self.logit.kernel[:, 0], self.compute_dtype)
        logits = keras.ops.cast(self.logit.bias, self.compute_dtype)
        if self.gmf_width:
            weighted = user[:, : self.gmf_width] * kernel[: self.gmf_width]
            logits = logits + keras.ops.matmul(weighted, keras.ops.transpose(rows))
        if self.mlp:
            user_term = self._first_layer_term(user[:, self.gmf_width :], 0)
            output = self._first_layer_output(user_term[:, None, :], item_term[None])
            for layer in self.mlp[1:]:
                output = layer(output)
            logits = logits + keras.ops.matmul(output, kernel[self.gmf_width :])
        return logits

    def score_blocks(self, users, items):
        """Logits of each user's block of items: what evaluation needs.

        The same function of the weights as `call` on every (user, item) pair, but each
        user's row goes through the first MLP layer once per block, and the item table
        (when made here and smaller than the batch) once per call: fewer FLOPs than
        `call` on the flattened pairs (docs/benchmarks.md, "The step's kernels").

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


def build_model(params: hyperparams.ModelParams) -> NeuMF:
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
    if (
        neumf.model_kind != hyperparams.NEUMF
        or gmf.model_kind not in hyperparams.GMF_ONLY
        or mlp.model_kind != hyperparams.MLP
    ):
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
