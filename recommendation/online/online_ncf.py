"""Online NeuMF: hash-embedded users and items, in-graph negatives.

Each training step takes a batch of (user, item) events, admits the batch's ids
(`HashEmbedding`), draws `num_neg` negatives per event from the items seen so far (the
occupied item rows; a draw equal to the event's item is masked out), and returns the
mean sigmoid cross-entropy. The id-to-row stage (`resolve`: hash tables and sampling)
is separate from the scoring (`call`: gathers and dense layers), so RecModel can
XLA-compile the latter. `score_candidates` scores raw ids without admitting any, as
the prequential protocol (`prequential`) and serving read the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.model import hyperparams, network, neumf_model, optimizers
from recommendation.online import cluster, step_stages
from recommendation.online.rec_model import RecModel
from recommendation.online.tables.hash_embedding import HashEmbedding


@dataclasses.dataclass(frozen=True)
class OnlineParams:
    """Model and sampling settings of online NeuMF.

    Attributes:
        mf_dim, layers, mlp_regularization: NeuMF sizes (`hyperparams.ModelParams`).
        user_capacity, item_capacity: Most rows of each hash table.
        user_eviction, item_eviction: What a full table does (`eviction.parse_policy`);
            None: ``lru``, or ``ttl:N`` when `evict_filter_value` is N.
        permit_filter_value, evict_filter_value, max_norm, admit_probability:
            `HashEmbedding` filters.
        num_neg: Training negatives per event.
        learning_rate, beta1, beta2, epsilon: Lazy Adam (of the dense layers, and of
            the rows unless `row_optimizer` or `row_learning_rate` say otherwise).
        row_optimizer, row_learning_rate: How the tables' rows train
            (`HashEmbedding`): lazy ``adam``, row-wise ``adagrad`` or ``sgd``, at their
            own rate (None: `learning_rate`).
        bias_terms: Each row ends with its id's bias, added to the logit: an item's
            popularity, learned at the rows' rate, where the dense layers would learn
            it slowly through the item's other columns.
    """

    # The reference's NeuMF sizes, as ncf-main's defaults.
    mf_dim: int = hyperparams.ModelParams.mf_dim
    layers: tuple[int, ...] = hyperparams.ModelParams.layers
    mlp_regularization: tuple[float, ...] = hyperparams.ModelParams.mlp_regularization
    user_capacity: int = 2**16
    item_capacity: int = 2**15
    user_eviction: str | None = None
    item_eviction: str | None = None
    permit_filter_value: int = 1
    evict_filter_value: int | None = None
    admit_probability: float = 1.0
    max_norm: float | None = None
    num_neg: int = 4
    # One pass over a stream: rates, the rows' rule and the biases chosen on the
    # validation streams (docs/online.md, "One pass").
    learning_rate: float = 0.01
    beta1: float = hyperparams.ModelParams.beta1
    beta2: float = hyperparams.ModelParams.beta2
    epsilon: float = hyperparams.ModelParams.epsilon
    row_optimizer: str = "adagrad"
    row_learning_rate: float | None = 0.2
    bias_terms: bool = True


# Scored events per block of `score_candidates`: its per-pair tensors stay a few MB
# (all of a sink's at once took about 60 MB of peak memory, for no speed).
SCORING_BLOCK = 256

# A new row starts at U(-0.004, 0.004): near zero, so that until its id has been
# trained its random part does not swamp what the item's row and the layers know (a
# cold user is ranked by the items' popularity). Selected on the ML-100K stream, the
# mean prequential HR@10 of seeds 1 to 3 by scale: 0.05 (Keras' default uniform)
# 0.1193, 0.01 0.1861, 0.004 0.1961, 0.001 0.1908; docs/online-peers.md.
NEW_ROW_SCALE = 0.004


@keras.saving.register_keras_serializable(package="ncf")
class OnlineNeuMF(network.NeuMF):
    """NeuMF over `HashEmbedding` tables of `user_capacity` and `item_capacity` rows
    (arguments as in `OnlineParams`; `shard_devices`: `HashEmbedding`'s), given to
    NeuMF ready-made.

    Call args (of `call`, after `resolve`):
        resolved: The dict `resolve` returns.
    Returns:
        dict of scalars: ``loss`` (mean over valid points).
    """

    def __init__(
        self,
        user_capacity: int = OnlineParams.user_capacity,
        item_capacity: int = OnlineParams.item_capacity,
        mf_dim: int = OnlineParams.mf_dim,
        layers: tuple[int, ...] = OnlineParams.layers,
        mlp_regularization: tuple[float, ...] = OnlineParams.mlp_regularization,
        permit_filter_value: int = OnlineParams.permit_filter_value,
        evict_filter_value: int | None = OnlineParams.evict_filter_value,
        max_norm: float | None = OnlineParams.max_norm,
        num_neg: int = OnlineParams.num_neg,
        user_eviction: str | None = OnlineParams.user_eviction,
        item_eviction: str | None = OnlineParams.item_eviction,
        admit_probability: float = OnlineParams.admit_probability,
        row_optimizer: str = OnlineParams.row_optimizer,
        row_learning_rate: float | None = OnlineParams.row_learning_rate,
        bias_terms: bool = OnlineParams.bias_terms,
        shard_devices: list[str] | None = None,
        **kwargs,
    ) -> None:
        width = network.NeuMF.table_width(mf_dim, layers) + int(bias_terms)

        def hash_table(capacity: int, eviction: str | None, name: str, seed: int):
            if evict_filter_value is not None and eviction is not None:
                raise ValueError(
                    f"evict_filter_value={evict_filter_value} sets both tables' eviction to "
                    f"ttl:{evict_filter_value}: give it or {name}'s eviction={eviction!r}"
                )
            return HashEmbedding(
                width,
                capacity=capacity,
                name=name,
                permit_filter_value=permit_filter_value,
                evict_filter_value=evict_filter_value,
                eviction=eviction or ("none" if evict_filter_value else "lru"),
                initializer=keras.initializers.RandomUniform(-NEW_ROW_SCALE, NEW_ROW_SCALE),
                admit_probability=admit_probability,
                seed=seed,
                max_norm=max_norm,
                row_optimizer=row_optimizer,
                row_learning_rate=row_learning_rate,
                shard_devices=shard_devices,
            )

        super().__init__(
            mf_dim=mf_dim,
            layers=layers,
            mlp_regularization=mlp_regularization,
            user_embedding=hash_table(user_capacity, user_eviction, "embedding_user", 0),
            item_embedding=hash_table(item_capacity, item_eviction, "embedding_item", 1),
            **kwargs,
        )
        self.num_neg = num_neg
        self.bias_terms = bias_terms

    # No control flow over tensors: AutoGraph's conversion would only cost start-up time.
    @tf.autograph.experimental.do_not_convert
    def resolve(self, data: dict, training: bool = False) -> dict:
        """Ids to rows: the training rows (admitting, refreshing, evicting when
        `training`) and the negatives."""
        users = tf.reshape(data[constants.USER_COLUMN], [-1])
        items = tf.reshape(data[constants.ITEM_COLUMN], [-1])
        times = data.get(constants.TIME_COLUMN)  # for event-time eviction
        times = None if times is None else tf.reshape(times, [-1])
        user_rows = self.user_embedding.slots(users, training, times)
        item_rows = self.item_embedding.slots(items, training, times)
        train_keys, train_rows = self.item_embedding.sample_slots(tf.size(items) * self.num_neg)
        valid = (train_keys != tf.repeat(items, self.num_neg)) & (train_rows >= 0)
        return {
            "users": user_rows,
            "items": item_rows,
            "negatives": train_rows,
            "negatives_valid": valid,
        }

    def looked_up_ids(self, data: dict) -> list[tuple[HashEmbedding, np.ndarray]]:
        """The ids a training step on `data` (numpy) looks up, by table."""
        return [
            (self.user_embedding, np.ravel(data[constants.USER_COLUMN])),
            (self.item_embedding, np.ravel(data[constants.ITEM_COLUMN])),
        ]

    def trained_rows(self, resolved: dict) -> list[tuple[HashEmbedding, tf.Tensor]]:
        """The rows a training step on `resolved` changes, by table."""
        items = tf.concat([resolved["items"], resolved["negatives"]], 0)
        return [(self.user_embedding, resolved["users"]), (self.item_embedding, items)]

    def call(self, resolved: dict, training=None) -> dict:
        def rows(embedding, slots):
            return embedding(tf.reshape(slots, [-1]), by_slot=True)

        user = rows(self.user_embedding, resolved["users"])
        # One gather of the events' items and their negatives: the gradient is one
        # IndexedSlices, the two gathers' in the same order, without the concatenations.
        items = rows(self.item_embedding, tf.concat([resolved["items"], resolved["negatives"]], 0))
        users = tf.concat([user, tf.repeat(user, self.num_neg, axis=0)], axis=0)
        logits = tf.cast(self.score_rows(users, items), tf.float32)
        batch = tf.shape(user)[0]
        labels = tf.concat([tf.ones([batch]), tf.zeros([batch * self.num_neg])], axis=0)
        valid = tf.concat(
            [tf.ones([batch]), tf.cast(resolved["negatives_valid"], tf.float32)], axis=0
        )
        loss = neumf_model.weighted_sigmoid_cross_entropy(logits, labels, valid)
        loss /= tf.maximum(tf.reduce_sum(valid), 1.0)
        return {"loss": loss}

    def split_bias(self, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor | None]:
        """Looked-up rows `(n, width)` as NeuMF's columns and the ids' biases `(n,)`
        (None without `bias_terms`). One split: its gradient is one concatenation."""
        if not self.bias_terms:
            return rows, None
        columns, bias = tf.split(rows, [tf.shape(rows)[-1] - 1, 1], axis=-1)
        return columns, bias[:, 0]

    def score_rows(self, user: tf.Tensor, item: tf.Tensor) -> tf.Tensor:
        """Logits `(n,)` of looked-up user and item rows, pair by pair: NeuMF's score
        of their columns, plus both biases."""
        (user, user_bias), (item, item_bias) = self.split_bias(user), self.split_bias(item)
        logits = self.score(user, item)[:, 0]
        return logits if user_bias is None else logits + user_bias + item_bias

    @tf.autograph.experimental.do_not_convert
    def score_candidates(
        self, users: tf.Tensor, items: tf.Tensor, positions: tf.Tensor
    ) -> tf.Tensor:
        """Logits (float32, `(n, m)`) of each of `users` (raw ids, `(n,)`) with each of
        its candidates, ``items[positions]`` (`items`: distinct raw item ids, `(d,)`;
        `positions`: `(n, m)` int32), by the model as it is: nothing is admitted, and
        ids without a row score with the default row (`score_row_candidates`)."""
        with tf.name_scope(step_stages.PREQUENTIAL):
            return self.score_row_candidates(
                self.user_embedding(users, training=False),
                self.item_embedding(items, training=False),
                positions,
            )

    def score_row_candidates(
        self,
        user: tf.Tensor,
        rows: tf.Tensor,
        positions: tf.Tensor,
        block_users: tf.Tensor | int = SCORING_BLOCK,
    ) -> tf.Tensor:
        """Logits (float32, `(n, m)`) of looked-up user rows `(n, width)` with their
        candidates ``rows[positions]`` (`rows`: `(d, width)` item rows; `positions`:
        `(n, m)` int32), `block_users` users at a time (their per-pair tensors are
        `block_users * m` rows): what `score_candidates` and a served version's
        ``recommend`` score.

        The logit layer is linear, so the GMF share is a product of the user's weighted
        row with each candidate's; the first MLP layer is a user term plus an item term
        (`network.NeuMF._first_layer_term`), each user's once and each distinct item's
        once; only the layers above it run per pair.
        """
        user, user_bias = self.split_bias(user)
        rows, item_bias = self.split_bias(rows)
        kernel = tf.cast(self.logit.kernel[:, 0], self.compute_dtype)
        gmf = self.gmf_width
        # Each user's and each item's share: the GMF weights on the user's side, the
        # first MLP layer's terms (or, without one, each half's logit share).
        user_parts, item_parts = [user[:, :gmf] * kernel[:gmf]], [rows[:, :gmf]]
        if self.mlp:
            user_parts.append(self._first_layer_term(user[:, gmf:], 0))
            item_parts.append(self._first_layer_term(rows[:, gmf:], 1))
        elif self.mlp_width:  # the MLP halves feed the logit directly
            half = self.mlp_width
            user_parts.append(user[:, gmf:] @ kernel[gmf : gmf + half, None])
            item_parts.append(rows[:, gmf:] @ kernel[gmf + half :, None])
        logits = _in_blocks(
            lambda start, end: self._pair_logits(
                [part[start:end] for part in user_parts],
                item_parts,
                positions[start:end],
                kernel[gmf:],
            ),
            tf.shape(user)[0],
            block_users,
        )
        if user_bias is None:
            return logits
        biases = user_bias[:, None] + tf.gather(item_bias, positions)
        return logits + tf.cast(biases, tf.float32)

    def _pair_logits(self, user_parts, item_parts, positions, mlp_kernel) -> tf.Tensor:
        """`(n, m)` float32 logits of `n` users' shares with their candidates' (the
        parts `score_candidates` makes; `positions` into the items')."""
        logits = tf.cast(self.logit.bias, self.compute_dtype)
        if self.gmf_width:
            logits += tf.linalg.matvec(tf.gather(item_parts[0], positions), user_parts[0])
        if self.mlp:
            first = self._first_layer_output(
                user_parts[1][:, None], tf.gather(item_parts[1], positions)
            )
            output = tf.reshape(first, [-1, tf.shape(first)[-1]])  # 2-D: fused layers
            for layer in self.mlp[1:]:
                output = layer(output)
            logits += tf.reshape(tf.linalg.matvec(output, mlp_kernel), tf.shape(positions))
        elif self.mlp_width:
            logits += user_parts[1] + tf.gather(item_parts[1], positions)[..., 0]
        return tf.cast(logits, tf.float32)

    def get_config(self) -> dict:
        config = super().get_config()
        # NeuMF's table arguments: these hash tables are built from the ones below.
        for key in (
            "num_users",
            "num_items",
            "mf_regularization",
            "embedding_init",
            "embedding_stddev",
            "user_embedding",
            "item_embedding",
        ):
            config.pop(key)
        config.update(
            user_capacity=self.user_embedding.capacity,
            item_capacity=self.item_embedding.capacity,
            permit_filter_value=self.user_embedding.permit_filter_value,
            evict_filter_value=self.user_embedding.evict_filter_value,
            user_eviction=self._eviction(self.user_embedding),
            item_eviction=self._eviction(self.item_embedding),
            admit_probability=self.user_embedding.admit_probability,
            max_norm=self.user_embedding.max_norm,
            num_neg=self.num_neg,
            row_optimizer=self.user_embedding.row_optimizer,
            row_learning_rate=self.user_embedding.row_learning_rate,
            bias_terms=self.bias_terms,
        )
        return config

    def _eviction(self, table: HashEmbedding) -> str | None:
        return None if table.evict_filter_value is not None else str(table.policy)


def _in_blocks(logits_of: Callable, count: tf.Tensor, block_rows: tf.Tensor | int) -> tf.Tensor:
    """``logits_of(start, end)`` over [0, `count`) in blocks of `block_rows` rows (one
    block when there are none), concatenated."""
    blocks = tf.maximum(1, (count + block_rows - 1) // block_rows)

    def block(index, done):
        start = index * block_rows
        end = tf.minimum(start + block_rows, count)
        return index + 1, done.write(index, logits_of(start, end))

    done = tf.TensorArray(tf.float32, size=blocks, infer_shape=False)
    _, done = tf.while_loop(lambda index, _: index < blocks, block, (0, done))
    return done.concat()


def _probe_batch(values) -> dict:
    return {
        constants.USER_COLUMN: tf.constant(values, tf.int64),
        constants.ITEM_COLUMN: tf.constant(values, tf.int64),
        constants.TIME_COLUMN: tf.constant(values, tf.int64),
    }


def build_online_model(
    params: OnlineParams,
    shard_devices: list[str] | None = None,
    strategy: tf.distribute.Strategy | None = None,
) -> OnlineNeuMF:
    """OnlineNeuMF with its variables created (one forward pass, nothing admitted):
    the tables' rows split over `shard_devices` (`HashEmbedding`), the dense weights
    placed by `strategy`, the tables' index and state here."""
    model = OnlineNeuMF(
        params.user_capacity,
        params.item_capacity,
        params.mf_dim,
        params.layers,
        params.mlp_regularization,
        params.permit_filter_value,
        params.evict_filter_value,
        params.max_norm,
        params.num_neg,
        params.user_eviction,
        params.item_eviction,
        params.admit_probability,
        params.row_optimizer,
        params.row_learning_rate,
        params.bias_terms,
        shard_devices=shard_devices,
    )
    # The strategy would place the tables' own variables too (on the ps tasks): they
    # are made above, outside its scope.
    with strategy.scope() if strategy else contextlib.nullcontext():
        model(model.resolve(_probe_batch([0]), training=False))
    return model


def network_from_config(config: dict) -> OnlineNeuMF:
    """An OnlineNeuMF of `config` (`OnlineNeuMF.get_config`, as a served version keeps
    it) with its variables created, nothing admitted: what a server builds its scoring
    from."""
    model = OnlineNeuMF.from_config(config)
    model(model.resolve(_probe_batch([0]), training=False))
    return model


def build_rec_model(
    params: OnlineParams,
    amp_level: str = "O0",
    boost_level: str = "O0",
    connection: cluster.Connection | None = None,
    shard_devices: list[str] | None = None,
) -> RecModel:
    """RecModel training OnlineNeuMF (which computes its own loss) with lazy Adam: it
    updates only the rows of each batch, the only sensible choice for large tables.
    On a cluster (`connection`) its steps run on the workers, the rows split over the
    ps tasks (`cluster`); else the rows are split over `shard_devices`, if given."""
    strategy = connection.coordinator.strategy if connection else None
    if connection:
        shard_devices = connection.ps_devices
    network = build_online_model(params, shard_devices, strategy)
    with strategy.scope() if strategy else contextlib.nullcontext():
        optimizer = optimizers.LazyAdam(
            learning_rate=params.learning_rate,
            beta_1=params.beta1,
            beta_2=params.beta2,
            epsilon=params.epsilon,
        )
        if strategy:  # its slots on the ps tasks (the tables' moments: below)
            optimizer.build(network.trainable_variables)
    rec_model = RecModel(network, optimizer=optimizer, amp_level=amp_level, boost_level=boost_level)
    if connection:
        for table in rec_model.row_tables():
            table.attach_optimizer(optimizer)
        # Two steps a worker: one running, one sent, so that none waits for the next.
        rec_model.distribute(connection.coordinator, 2 * connection.num_workers)
    return rec_model
