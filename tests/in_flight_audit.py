"""The chief of a loopback cluster (TF_CONFIG), training a stream built to evict and
move rows at every step, with an audit of the steps in flight.

    python tests/in_flight_audit.py AUDIT.json

Every step's update is applied to the rows it was resolved with: its users, items and
negatives. A step is in flight from its resolve until the coordinator has fetched its
result (by then the worker has applied it). After each resolve, the audit reads, for
every step still in flight, which row each of its ids holds now: a step whose row now
holds another id, or whose id now has another row (evicted, moved, expired), would
write its update where it does not belong. It writes what it found as JSON.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tensorflow as tf

from recommendation.online import cluster, online_ncf

# Small tables turned over at every step: 8 new users every other step, expired 8 steps
# after they were last seen (ttl: rows freed, the last rows moved into the places that
# new users do not take), and 2 of 8 items each step new, evicted from a full table
# (lru).
PARAMS = online_ncf.OnlineParams(
    user_capacity=64,
    item_capacity=32,
    mf_dim=4,
    layers=(8, 4),
    mlp_regularization=(0.0, 0.0),
    num_neg=1,
    user_eviction="ttl:8",
    item_eviction="lru",
)
STEPS = 160
EVENTS = 8


def stream() -> list[dict]:
    """`STEPS` batches of `EVENTS` events: 8 new users every other step (regular ones
    between), 6 popular items and 2 new ones, in a seeded order."""
    rng = np.random.default_rng(7)
    batches = []
    for step in range(STEPS):
        users = 1000 + 8 * step + np.arange(8) if step % 2 else rng.integers(0, 4, 8)
        items = np.concatenate([rng.integers(0, 6, 6), 1000 + 2 * step + np.arange(2)])
        batches.append({"user_id": rng.permutation(users), "item_id": rng.permutation(items)})
    return batches


class Audit:
    """Wraps a `cluster.ClusterSteps`' resolve and fetch to keep the steps in flight,
    and checks their rows after every resolve."""

    def __init__(self, rec_model) -> None:
        network = rec_model.network
        self.tables = {"user": network.user_embedding, "item": network.item_embedding}
        self.trained_rows = network.trained_rows
        steps = rec_model.cluster
        self._resolve, self._fetch = steps._resolve, steps._fetch_oldest
        steps._resolve, steps._fetch_oldest = self.resolve, self.fetch
        self.in_flight: list[tuple[int, dict]] = []  # (step, {table: (rows, ids)})
        self.violations: list[dict] = []
        self.most_in_flight = 0

    def resolve(self, data):
        resolved, step = self._resolve(data)
        self.check(int(step))
        held = {}
        for (name, table), (_, slots) in zip(
            self.tables.items(), self.trained_rows(resolved), strict=True
        ):
            rows = np.unique(slots.numpy())
            rows = rows[rows > 0]
            held[name] = (rows, tf.gather(table.slot_keys, rows).numpy())
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.in_flight.append((int(step), held))
        return resolved, step

    def fetch(self):
        logs = self._fetch()
        self.in_flight.pop(0)
        return logs

    def check(self, now: int) -> None:
        """Each step in flight's ids must still hold the rows it was resolved with."""
        for step, held in self.in_flight:
            for name, (rows, ids) in held.items():
                table = self.tables[name]
                rows_now = table.lookup_slots(tf.constant(ids)).numpy()
                for row, key, row_now in zip(rows, ids, rows_now, strict=True):
                    if row_now != row:
                        self.violations.append(
                            {"step": step, "at": now, "table": name, "id": int(key),
                             "row": int(row), "row_now": int(row_now)}
                        )  # fmt: skip


def main(out: str) -> None:
    tf.keras.utils.set_random_seed(1)
    connection = cluster.connect(cluster.cluster_resolver(), 120)
    rec_model = online_ncf.build_rec_model(PARAMS, connection=connection)
    audit = Audit(rec_model)
    summary = rec_model.online_train(stream(), [], sink_size=4)
    network = rec_model.network
    result = {
        "steps": summary["steps"],
        "violations": audit.violations,
        "most_in_flight": audit.most_in_flight,
        "drains": getattr(rec_model.cluster, "drains", None),
        "user": network.user_embedding.counts(),
        "item": network.item_embedding.counts(),
    }
    with open(out, "w") as stream_out:
        json.dump(result, stream_out)


if __name__ == "__main__":
    main(sys.argv[1])
