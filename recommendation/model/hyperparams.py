"""What a NeuMF model is: its kinds (NeuMF, the NCF paper's GMF and MLP, MF) and the
hyper-parameters of the network and its optimiser (`ModelParams`).
"""

from __future__ import annotations

import dataclasses

import keras

from official.utils.flags.core import FieldRule, check_fields
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
        if not valid_layers(self.layers):  # --layers checks it as it parses (`ncf_flags`)
            raise ValueError(
                f"layers must be positive, the first even (half user, half item "
                f"embedding), got {self.layers}"
            )
        check_fields(self, MODEL_RULES)


# Embedding-table initialisers by name: the MLPerf reference's, and the NCF paper
# code's (Keras 1 ``normal`` with scale 0.01).
EMBEDDING_INITS = {  # name: initializer of the given normal spread
    "glorot_uniform": lambda stddev: keras.initializers.GlorotUniform(),
    "normal": lambda stddev: keras.initializers.RandomNormal(stddev=stddev),
}


def valid_layers(widths: tuple[int, ...]) -> bool:
    """Whether `widths` can be NeuMF's MLP: positive, the first even (it is split
    between the user and the item embedding)."""
    return bool(widths) and min(widths) > 0 and widths[0] % 2 == 0


# What `ModelParams` holds to besides `valid_layers`; ncf-main checks the same rules
# on its flags (`ncf_flags.NCF_FLAGS`), so a command line breaking one gets a flag error.
MODEL_RULES = (
    FieldRule(
        ("layers", "mlp_regularization"),
        lambda layers, mlp_regularization: len(layers) == len(mlp_regularization),
        "{mlp_regularization} needs one value per {layers} entry",
    ),
    FieldRule(
        ("weight_decay", "sparse_updates"),
        lambda weight_decay, sparse_updates: not (weight_decay and sparse_updates),
        "{weight_decay} shrinks every embedding row each step: it needs dense updates "
        "(drop {sparse_updates})",
    ),
    FieldRule(
        ("loss_scale", "dtype"),
        lambda loss_scale, dtype: loss_scale is None or dtype == "fp16",
        "{loss_scale} scales float16 gradients: it needs {dtype} fp16",
    ),
    FieldRule(
        ("embedding_init",),
        lambda embedding_init: embedding_init in EMBEDDING_INITS,
        f"{{embedding_init}} must be one of {sorted(EMBEDDING_INITS)}",
    ),
    FieldRule(
        ("embedding_stddev",),
        lambda embedding_stddev: embedding_stddev > 0,
        "{embedding_stddev} must be a positive number",
    ),
    FieldRule(
        ("embedding_init", "embedding_stddev"),
        lambda embedding_init, embedding_stddev: (
            embedding_init == "normal" or embedding_stddev == ModelParams.embedding_stddev
        ),
        "{embedding_stddev} is the spread of {embedding_init} normal: add "
        "{embedding_init} normal, or drop {embedding_stddev}",
    ),
    FieldRule(
        ("model_kind",),
        lambda model_kind: model_kind in MODEL_KINDS,
        f"{{model_kind}} must be one of {MODEL_KINDS}",
    ),
    FieldRule(
        ("optimizer",),
        lambda optimizer: optimizer in OPTIMIZERS,
        f"{{optimizer}} must be one of {OPTIMIZERS}",
    ),
)
