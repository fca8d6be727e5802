"""NeuMF over TorchRec's managed-collision tables trained test-then-train on an event
folder, by the prequential protocol ncf-online is measured by, so that the two compare
on one stream.

    PYTHON=$(scripts/peers/setup_torchrec.sh)
    $PYTHON scripts/peers/torchrec_online.py --events_dir DIR --tables mch_lru --seed 1 \\
        --summary_file torchrec.json

Run it with the python of TorchRec's own environment (`setup_torchrec.sh`); the rest of
the harness (`peer_harness`: the folder read as ncf-online reads it, the protocol, the
training negatives, the result) is torch-free.

The network is ncf-online's (recommendation/model/network.py) in PyTorch: one user and
one item table of width ``num_factors + layers[0] / 2``, the first `num_factors`
columns multiplied element-wise (GMF), the rest concatenated into Linear + ReLU layers
of ``layers[1:]``, both parts into a Linear logit; log loss on each event (label 1) and
its negatives (label 0); one step per chunk of ``--batch_size`` events.

The tables are configured as a TorchRec user finds them, in one ``EmbeddingCollection``
(``EmbeddingConfig`` of TorchRec's default initialiser, U(+-1/sqrt(rows))):

- ``mch_lru`` / ``mch_lfu``: a ``ManagedCollisionEmbeddingCollection`` whose
  ``MCHManagedCollisionModule`` per table (``LRU_EvictionPolicy`` or
  ``DistanceLFU_EvictionPolicy``, ``eviction_interval=1``: each training step admits
  its ids, as ncf-online does) holds up to ``--user_capacity`` / ``--item_capacity``
  ids; its table has one row more, the row every id without one reads (ncf-online's
  default row);
- ``hash``: the collision baseline, id modulo the capacity, ids sharing rows.

Unsharded, TorchRec's ``mc_embedding_modules.evict()`` does nothing, so a row handed to
a new id would keep the evicted id's weights and Adam moments. This harness does what
the sharded module does (``ShardedManagedCollisionEmbeddingCollection.compute``): a
training step remaps the ids (the managed-collision collection), re-initialises the
rows it reports evicted (the table's ``init_fn``, moments zeroed), then looks up. The
sharded path itself cannot run here: its fused optimiser has no CPU kernel for
``fbgemm::reset_weight_momentum``. Scores go through the module's own forward, in eval
mode (nothing admitted, an id without a row reads the shared one).

Trained as ncf-online trains, with its flags and defaults: the tables' ``nn.Embedding``
modules set to sparse gradients (only the rows of the step change) and trained by
``--row_optimizer``: ``adagrad`` (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, one accumulator a
row of the mean squared gradient, written here for sparse gradients as ncf-online's
``optimizers.rowwise_adagrad_rows``: the fused TBE optimiser that holds it is the
sharded path), ``adam`` (``torch.optim.SparseAdam``) or ``sgd``, at
``--row_learning_rate``; the dense layers by ``torch.optim.Adam`` at
``--learning_rate``. With ``--bias_terms`` each row ends with its id's bias, added to
the logit. The dense layers start as PyTorch's ``nn.Linear`` does. ``torch.set_num_threads`` is the
cores this process may use, as TensorFlow's default is.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib import metadata

# libgomp's idle threads spin by default: while another process holds one of the cores,
# each parallel region of 2 threads on 2 cores then waits for a descheduled spinner
# (training steps 13 times as long, measured); TensorFlow's pool spins briefly, then parks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_harness  # noqa: E402  (a sibling script)

SIDES = ("user", "item")
# ncf-online's defaults: --num_factors, --layers, --learning_rate (Adam's betas and
# epsilon are PyTorch's defaults too), --row_optimizer, --row_learning_rate,
# --bias_terms, --user_capacity, --item_capacity.
NUM_FACTORS = 8
LAYERS = (64, 32, 16, 8)
LEARNING_RATE = 0.01
ROW_OPTIMIZERS = ("adagrad", "adam", "sgd")
ROW_LEARNING_RATE = 0.2
ROWWISE_ADAGRAD_EPSILON = 1e-8  # FBGEMM's
CAPACITIES = {"user": 2**16, "item": 2**15}
POLICIES = {"mch_lru": LRU_EvictionPolicy, "mch_lfu": DistanceLFU_EvictionPolicy}
TABLE_KINDS = (*POLICIES, "hash")


class NeuMF(nn.Module):
    """ncf-online's network on looked-up rows: GMF of the first `num_factors` columns,
    an MLP of the rest (``layers[0]``: both halves), one logit of both."""

    def __init__(self, num_factors: int, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.num_factors = num_factors
        self.mlp = nn.Sequential(
            *(
                module
                for width, units in zip(layers, layers[1:], strict=False)
                for module in (nn.Linear(width, units), nn.ReLU())
            )
        )
        self.logit = nn.Linear(num_factors + layers[-1], 1)

    def forward(self, user: torch.Tensor, item: torch.Tensor, bias_terms: bool) -> torch.Tensor:
        """`(m,)` logits of `(m, width)` user and item rows (with `bias_terms`, their
        last columns are the ids' biases, added to the logit)."""
        split, end = self.num_factors, user.shape[1] - bias_terms
        gmf = user[:, :split] * item[:, :split]
        mlp = self.mlp(torch.cat([user[:, split:end], item[:, split:end]], dim=1))
        logits = self.logit(torch.cat([gmf, mlp], dim=1))[:, 0]
        return logits + user[:, end] + item[:, end] if bias_terms else logits


class RowwiseAdagrad(torch.optim.Optimizer):
    """FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` on sparse gradients: each row present adds
    the mean of its squared gradient to its one accumulator and moves by ``lr * g /
    (sqrt(accumulator) + eps)``; the other rows keep their weights and state."""

    def __init__(self, params, lr: float, eps: float = ROWWISE_ADAGRAD_EPSILON) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is None:
                    continue
                gradient = weight.grad.coalesce()  # one entry a row
                rows, values = gradient.indices()[0], gradient.values()
                state = self.state[weight]
                if "sum" not in state:
                    state["sum"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
                state["sum"][rows] += values.pow(2).mean(dim=1)
                scale = group["lr"] / (state["sum"][rows].sqrt() + group["eps"])
                weight[rows] -= scale[:, None] * values


def _row_optimizer(kind: str, weights: list, rate: float) -> torch.optim.Optimizer:
    if kind == "adagrad":
        return RowwiseAdagrad(weights, rate)
    if kind == "adam":
        return torch.optim.SparseAdam(weights, lr=rate)
    return torch.optim.SGD(weights, lr=rate)  # sparse gradients: the rows present


def _features(users: torch.Tensor, items: torch.Tensor, item_lengths: torch.Tensor):
    """A batch as TorchRec takes it: one user id a sample, `item_lengths` items each."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(SIDES),
        values=torch.cat([users, items]),
        lengths=torch.cat([torch.ones(len(users), dtype=torch.int32), item_lengths]),
    )


def _one_each(count: int) -> torch.Tensor:
    return torch.ones(count, dtype=torch.int32)


class TorchRecNeuMF:
    """NeuMF over TorchRec tables as a `peer_harness.Learner` (module docstring).

    Args:
        tables: One of `TABLE_KINDS`.
        capacities: Ids each side's table holds (``user``, ``item``).
        num_factors, layers: The network's widths.
        learning_rate: The dense layers' Adam's.
        row_optimizer, row_learning_rate: The rows' rule (`ROW_OPTIMIZERS`) and rate.
        bias_terms: Each row ends with its id's bias.
        seed: Fixes the initial weights (None: unseeded).
        threads: ``torch.set_num_threads`` (None: the cores this process may use).
    """

    def __init__(
        self,
        tables: str,
        capacities: dict[str, int],
        num_factors: int = NUM_FACTORS,
        layers: tuple[int, ...] = LAYERS,
        learning_rate: float = LEARNING_RATE,
        row_optimizer: str = ROW_OPTIMIZERS[0],
        row_learning_rate: float = ROW_LEARNING_RATE,
        bias_terms: bool = True,
        seed: int | None = None,
        threads: int | None = None,
    ) -> None:
        if seed is not None:
            torch.manual_seed(seed)
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        self.capacities = capacities
        self.managed = tables in POLICIES
        width = num_factors + layers[0] // 2 + bias_terms
        self.bias_terms = bias_terms
        # A managed table's last row is its shared row for ids without one.
        self.rows = {side: capacities[side] + self.managed for side in SIDES}
        self.configs = [
            EmbeddingConfig(
                num_embeddings=self.rows[side], embedding_dim=width, name=side, feature_names=[side]
            )
            for side in SIDES
        ]
        self.embeddings = EmbeddingCollection(self.configs)
        for table in self.embeddings.embeddings.values():
            table.sparse = True  # lazy Adam: gradients of the looked-up rows only
        if self.managed:
            self.collision_modules = {
                config.name: MCHManagedCollisionModule(
                    zch_size=config.num_embeddings,
                    device=torch.device("cpu"),
                    eviction_policy=POLICIES[tables](),
                    eviction_interval=1,
                    name=config.name,
                )
                for config in self.configs
            }
            self.collisions = ManagedCollisionCollection(self.collision_modules, self.configs)
            self.lookup = ManagedCollisionEmbeddingCollection(self.embeddings, self.collisions)
        else:
            self.lookup = self.embeddings
        self.network = NeuMF(num_factors, layers)
        self.table_optimizer = _row_optimizer(
            row_optimizer, list(self.embeddings.parameters()), row_learning_rate
        )
        self.dense_optimizer = torch.optim.Adam(self.network.parameters(), lr=learning_rate)
        self.loss = nn.BCEWithLogitsLoss()
        self.counts = {side: {"admitted": 0, "refused": 0} for side in SIDES}
        # Distinct ids a hash table has seen, and which of its rows they took.
        self.seen_ids = {side: peer_harness.prequential.IdCounts(1) for side in SIDES}
        self.rows_in_use = {side: np.zeros(self.rows[side], bool) for side in SIDES}
        self.settings = {
            "tables": tables,
            "capacities": capacities,
            "num_factors": num_factors,
            "layers": list(layers),
            "learning_rate": learning_rate,
            "row_optimizer": row_optimizer,
            "row_learning_rate": row_learning_rate,
            "bias_terms": bias_terms,
            "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        }

    def _keys(self, side: str, ids: np.ndarray) -> torch.Tensor:
        """What a table takes: the raw ids (a managed table remaps them), or the rows
        (a hash table's: the id modulo its rows)."""
        return torch.from_numpy(ids if self.managed else ids % self.rows[side])

    def score(self, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        count = candidates.shape[1]
        self.lookup.eval()
        with torch.inference_mode():
            features = _features(
                self._keys("user", users),
                self._keys("item", candidates.ravel()),
                torch.full((len(users),), count, dtype=torch.int32),
            )
            rows = self.lookup(features)
            if self.managed:
                rows, _ = rows  # (embeddings, remapped features: not asked for)
            user = rows["user"].values().repeat_interleave(count, dim=0)
            logits = self.network(user, rows["item"].values(), self.bias_terms)
        return logits.reshape(candidates.shape).numpy()

    def learn(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> None:
        self.lookup.train()
        raw = {"user": users, "item": items}
        features = _features(
            self._keys("user", users), self._keys("item", items), _one_each(len(items))
        )
        if self.managed:
            features = self.collisions(features)
            self._count_managed(raw, features)
            self._reset(self.collisions.evict())
        else:
            self._count_hashed(raw, features)
        rows = self.embeddings(features)
        logits = self.network(rows["user"].values(), rows["item"].values(), self.bias_terms)
        loss = self.loss(logits, torch.from_numpy(labels).float())
        self.table_optimizer.zero_grad()
        self.dense_optimizer.zero_grad()
        loss.backward()
        self.table_optimizer.step()
        self.dense_optimizer.step()

    def _count_managed(self, raw: dict[str, np.ndarray], features: KeyedJaggedTensor) -> None:
        """Ids of this step left on the shared row: refused (again at each step)."""
        for side, remapped in features.to_dict().items():
            shared = remapped.values().numpy() == self.rows[side] - 1
            self.counts[side]["refused"] += len(np.unique(raw[side][shared]))

    def _count_hashed(self, raw: dict[str, np.ndarray], features: KeyedJaggedTensor) -> None:
        for side, hashed in features.to_dict().items():
            self.seen_ids[side].count_and_add(np.unique(raw[side]))
            self.rows_in_use[side][hashed.values().numpy()] = True

    @torch.no_grad()
    def _reset(self, evictions: dict[str, torch.Tensor | None]) -> None:
        """Rows TorchRec handed to new ids start afresh: the table's initial values,
        zero moments (what the sharded module's ``reset_embedding_weight_momentum``
        and ``init_fn`` do)."""
        for config in self.configs:
            rows = evictions[config.name]
            if rows is None or not len(rows):
                continue
            self.counts[config.name]["admitted"] += len(rows)
            weight = self.embeddings.embeddings[config.name].weight
            weight[rows] = config.init_fn(torch.empty(len(rows), weight.shape[1]))
            for moment in self.table_optimizer.state.get(weight, {}).values():
                if torch.is_tensor(moment) and moment.shape[:1] == weight.shape[:1]:
                    moment[rows] = 0.0  # Adam's two, Adagrad's accumulator

    def tables(self) -> dict[str, dict]:
        """ncf-online's table counts, from what TorchRec reports: a managed table's ids
        held (``capacity - open_slots()``), admitted (rows ``evict()`` handed to new
        ids, a free one included), evicted (the ids that lost their row: admitted but
        no longer held) and refused; a hash table's distinct ids, all sharing its
        ``rows_in_use``. ``bytes``: its weights, the rows' optimiser state and, managed, the
        managed-collision module's buffers."""
        counts = {}
        open_slots = self.collisions.open_slots() if self.managed else {}
        for config in self.configs:
            side = config.name
            weight = self.embeddings.embeddings[side].weight
            state = self.table_optimizer.state.get(weight, {})
            tensors = [weight, *(moment for moment in state.values() if torch.is_tensor(moment))]
            if self.managed:
                held = self.capacities[side] - int(open_slots[side])
                admitted, refused = self.counts[side]["admitted"], self.counts[side]["refused"]
                tensors += list(self.collision_modules[side].buffers())
                extra = {"open_slots": int(open_slots[side])}
            else:
                held = admitted = self.seen_ids[side].size
                refused = 0
                extra = {"rows_in_use": int(self.rows_in_use[side].sum())}
            counts[side] = {
                "ids": held,
                "capacity": self.capacities[side],
                "admitted": admitted,
                "evicted": admitted - held if self.managed else 0,
                "refused": refused,
                "bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
                **extra,
            }
        return counts

    def describe(self) -> dict:
        return {
            "library": f"torchrec {metadata.version('torchrec')}, torch {torch.__version__}, "
            f"fbgemm-gpu-cpu {metadata.version('fbgemm-gpu-cpu')}",
            "model": "NeuMF, "
            + ", ".join(f"{key}={value}" for key, value in self.settings.items()),
        }


def _layers(text: str) -> tuple[int, ...]:
    """``--layers``: positive widths, the first even (half user, half item)."""
    try:
        widths = tuple(int(width) for width in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be integers split by commas, got {text!r}"
        ) from None
    if min(widths) <= 0 or widths[0] % 2:
        raise argparse.ArgumentTypeError(
            f"must be positive widths, the first even (half user, half item rows), got {text!r}"
        )
    return widths


def add_flags(flag: Callable[..., argparse.Action]) -> None:
    """The peer's flags, ncf-online's names and defaults where it has the flag."""
    flag("--tables", choices=TABLE_KINDS, default="mch_lru", help="TorchRec's tables.")
    for side in SIDES:
        flag(
            f"--{side}_capacity",
            type=peer_harness.positive,
            default=CAPACITIES[side],
            help=f"{side.capitalize()} ids the table holds (hash: its rows).",
        )
    flag("--num_factors", type=peer_harness.positive, default=NUM_FACTORS, help="GMF width.")
    flag(
        "--layers",
        type=_layers,
        default=LAYERS,
        help="MLP widths, comma-separated; the first is both tables' MLP columns.",
    )
    flag(
        "--learning_rate",
        type=peer_harness.positive_rate,
        default=LEARNING_RATE,
        help="The dense layers' rate.",
    )
    flag(
        "--row_optimizer", choices=ROW_OPTIMIZERS, default=ROW_OPTIMIZERS[0], help="The rows' rule."
    )
    flag(
        "--row_learning_rate",
        type=peer_harness.positive_rate,
        default=ROW_LEARNING_RATE,
        help="The rows' rate.",
    )
    flag(
        "--bias_terms",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="End each row with its id's bias (--no-bias_terms: none).",
    )
    flag(
        "--threads",
        type=peer_harness.positive,
        help="torch.set_num_threads (default: the cores this process may use, as TensorFlow).",
    )


def make_learner(flags: argparse.Namespace) -> TorchRecNeuMF:
    return TorchRecNeuMF(
        flags.tables,
        {side: getattr(flags, f"{side}_capacity") for side in SIDES},
        flags.num_factors,
        flags.layers,
        flags.learning_rate,
        flags.row_optimizer,
        flags.row_learning_rate,
        flags.bias_terms,
        flags.seed,
        flags.threads,
    )


def main() -> None:
    peer_harness.main(sys.argv[1:], "torchrec", __doc__.split("\n\n")[0], make_learner, add_flags)


if __name__ == "__main__":
    main()
