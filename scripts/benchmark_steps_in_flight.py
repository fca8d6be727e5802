"""What keeping a cluster's steps in flight off changed rows costs.

    python scripts/benchmark_steps_in_flight.py --ratings ../shared/data/ml-1m/ratings.dat
    python scripts/benchmark_steps_in_flight.py --ratings ... --trees pins=/tmp/pins-checkout

ML-1M's ratings in timestamp order (the first --events) are trained on a loopback
parameter-server cluster (--ps ps tasks and --workers workers, ``ncf-online
--serve_as`` tasks of one TF_CONFIG, two steps a worker in flight) with both tables
at --capacity_fraction of the users and items (lru), so that the tables are full
after the first steps and most steps then evict. Each run on a fresh cluster, the
trainers taking turns for --repeats rounds:

- unprotected: every step resolved beside the steps in flight, as before this
  protection (the trainer below with its tables' ``upkeep_due`` made to say no): an
  evicted row may take the update of a step in flight under its new id. The baseline
  of the ratios;
- drain (what ``ncf-online`` does: `recommendation/online/steps_in_flight.py`): a step
  that may evict, grow the rows or expire them waits until no step is in flight;
- each of --trees (NAME=PATH of another checkout, ``git worktree add``): its trainer as
  it is, such as one that pins the rows of the steps in flight instead.

For each: events/s after the first sink (tracing left out), the coordinator's
milliseconds per step (resolving ids to rows, scheduling, waiting for the workers),
the drains, each table's evictions and refused admissions, and the prequential HR@10
(`recommendation/online/prequential.py`, 1 event in 8). The load average is printed
beside the numbers: the machine is shared.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after PYTHONPATH: a --trees checkout's chief imports its own

import replay_events  # noqa: E402  (sibling scripts)

from official.utils.misc import machine  # noqa: E402  (before TensorFlow)
from recommendation.data import movielens  # noqa: E402

MODES = ("unprotected", "drain")  # of this checkout; --trees' run as they are

FLAGS = flags.FLAGS
flags.DEFINE_string("ratings", None, "ML-1M's ratings.dat.")
flags.DEFINE_integer("events", 200_000, "Events per run (the earliest ratings).")
flags.DEFINE_integer("batch_size", 4096, "Events per step.")
flags.DEFINE_float("capacity_fraction", 0.25, "Each table's capacity, of its distinct ids.")
flags.DEFINE_integer("ps", 2, "Ps tasks.")
flags.DEFINE_integer("workers", 2, "Worker tasks.")
flags.DEFINE_integer("repeats", 2, "Rounds; the modes take turns in each.")
flags.DEFINE_string("work_dir", None, "Where logs and results go (default: a temporary folder).")
flags.DEFINE_list("trees", [], "NAME=PATH of other checkouts whose trainers run too.")
flags.DEFINE_string("chief", None, "Run as the chief of one run (the script runs itself so).")
flags.DEFINE_string("out", None, "With --chief: where its result goes (JSON).")


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _chief(mode: str, out: str) -> None:
    """One run's coordinator: trains the events on TF_CONFIG's cluster; writes the
    numbers of the module docstring to `out`."""
    import tensorflow as tf

    from recommendation.online import callbacks, cluster, online_ncf, prequential
    from recommendation.online.callback_base import Callback

    events = replay_events.load_events(FLAGS.ratings, movielens.DAT_FORMAT)[: FLAGS.events]
    users, items = (len(np.unique(events[:, column])) for column in (0, 1))
    params = online_ncf.OnlineParams(
        user_capacity=int(users * FLAGS.capacity_fraction),
        item_capacity=int(items * FLAGS.capacity_fraction),
        user_eviction="lru",
        item_eviction="lru",
    )
    tf.keras.utils.set_random_seed(1)
    connection = cluster.connect(cluster.cluster_resolver(), 300)
    rec_model = online_ncf.build_rec_model(params, connection=connection)
    tables = rec_model.row_tables()
    if mode == "unprotected":
        for table in tables:
            table.upkeep_due = lambda ids: False
    batches = [
        {"user_id": chunk[:, 0], "item_id": chunk[:, 1], "timestamp": chunk[:, 2]}
        for chunk in np.array_split(events, -(-len(events) // FLAGS.batch_size))
    ]
    marks = []  # (seconds, events) after each sink

    class Clock(Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.append((time.perf_counter(), logs["events"]))

    chosen = [Clock()]
    try:
        from recommendation.online.evaluation import PrequentialEvaluation
    except ImportError:  # a --trees checkout: where it had it, in callbacks
        PrequentialEvaluation = getattr(callbacks, "PrequentialEvaluation", None)
    if PrequentialEvaluation is not None:
        chosen.append(PrequentialEvaluation(prequential.Prequential()))
    summary = rec_model.online_train(batches, chosen, sink_size=4)
    (start, first), (end, last) = marks[0], marks[-1]
    steps = rec_model.cluster
    result = {
        "events_per_second": (last - first) / (end - start),
        "steps": summary["steps"],
        "drains": getattr(steps, "drains", None),
        "ms_per_step": steps.ms_per_step(),
        "prequential_hr": chosen[1].protocol.results()["all"]["hr"] if chosen[1:] else None,
        "tables": {t.name: t.counts() for t in tables},
    }
    with open(out, "w") as stream:
        json.dump(result, stream)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _trees() -> dict[str, str]:
    """The trainers to run, by name: this checkout's modes, then --trees'."""
    trees = {mode: ROOT for mode in MODES}
    for item in FLAGS.trees:
        name, _, path = item.partition("=")
        if not path or name in trees or not os.path.isdir(os.path.join(path, "recommendation")):
            sys.exit(f"error: --trees wants NAME=PATH of a checkout (a new name): {item}")
        trees[name] = os.path.abspath(path)
    return trees


def _run(mode: str, tree: str, work_dir: str, name: str) -> dict:
    """The trainer `mode` of the checkout at `tree` on a fresh loopback cluster of that
    checkout's tasks; its result."""
    addresses = [f"localhost:{_free_port()}" for _ in range(1 + FLAGS.ps + FLAGS.workers)]
    spec = {"chief": addresses[:1], "ps": addresses[1 : 1 + FLAGS.ps]}
    spec["worker"] = addresses[1 + FLAGS.ps :]

    def tf_config(kind: str, index: int) -> str:
        return json.dumps({"cluster": spec, "task": {"type": kind, "index": index}})

    servers = []
    for kind in ("ps", "worker"):
        for index in range(len(spec[kind])):
            log = open(os.path.join(work_dir, f"{name}-{kind}{index}.log"), "w")
            servers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "recommendation.online_main", f"--serve_as={kind}"],
                    cwd=tree,
                    env={**os.environ, "TF_CONFIG": tf_config(kind, index), "PYTHONPATH": tree},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    out = os.path.join(work_dir, f"{name}.json")
    try:
        with open(os.path.join(work_dir, f"{name}-chief.log"), "w") as log:
            chief = subprocess.run(
                [sys.executable, __file__, f"--chief={mode}", f"--out={out}"]
                + [f"--{flag}={getattr(FLAGS, flag)}" for flag in ("ratings", "events")]
                + [f"--{flag}={getattr(FLAGS, flag)}" for flag in ("batch_size",)]
                + [f"--capacity_fraction={FLAGS.capacity_fraction}"],
                cwd=tree,
                env={**os.environ, "TF_CONFIG": tf_config("chief", 0), "PYTHONPATH": tree},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    finally:
        for server in servers:
            server.kill()
            server.wait()
    if chief.returncode:
        sys.exit(f"error: the {name} run failed: see {work_dir}/{name}-chief.log")
    with open(out) as stream:
        return json.load(stream)


def _print(runs: dict[str, list[dict]]) -> None:
    print(
        f"\n{FLAGS.events:,} ML-1M events, batch {FLAGS.batch_size:,}, tables at "
        f"{FLAGS.capacity_fraction:g} of the ids (lru), {FLAGS.ps} ps tasks, "
        f"{FLAGS.workers} workers ({2 * FLAGS.workers} steps in flight); mean of "
        f"{FLAGS.repeats} runs each"
    )
    header = (
        "trainer     | events/s | vs unprotected | resolve | schedule | wait | drains | "
        "users evicted / refused | items evicted / refused | prequential HR@10"
    )
    print(header)
    print("-" * len(header))
    base = np.mean([run["events_per_second"] for run in runs["unprotected"]])
    for mode, results in runs.items():
        rate = np.mean([run["events_per_second"] for run in results])
        ms = {
            k: np.mean([run["ms_per_step"][k] for run in results])
            for k in results[0]["ms_per_step"]
        }
        tables = results[-1]["tables"]
        users, items = tables["embedding_user"], tables["embedding_item"]
        print(
            f"{mode:11} | {rate:8,.0f} | {rate / base:13.2f}x | {ms['resolve']:7.1f} | "
            f"{ms['schedule']:8.1f} | {ms['wait']:4.1f} | {results[-1]['drains'] or 0:6} | "
            f"{users['evicted']:>11,} / {users['refused']:<9,} | "
            f"{items['evicted']:>11,} / {items['refused']:<9,} | "
            f"{_mean(run['prequential_hr'] for run in results)}"
        )
    print("runs (events/s): " + "; ".join(
        f"{mode} " + ", ".join(f"{run['events_per_second']:,.0f}" for run in results)
        for mode, results in runs.items()
    ))  # fmt: skip


def _mean(values) -> str:
    values = [value for value in values if value is not None]
    return f"{np.mean(values):.4f}" if values else "n/a"


def main(argv: list[str]) -> None:
    del argv
    if not FLAGS.ratings or not os.path.isfile(FLAGS.ratings):
        sys.exit(f"error: --ratings must name ML-1M's ratings.dat, got {FLAGS.ratings!r}")
    if FLAGS.chief:
        _chief(FLAGS.chief, FLAGS.out)
        return
    work_dir = FLAGS.work_dir or tempfile.mkdtemp(prefix="ncf-in-flight-")
    os.makedirs(work_dir, exist_ok=True)
    print(f"start: load average {_load()}")
    print(machine.cpu_line())
    trees = _trees()
    runs: dict[str, list[dict]] = {mode: [] for mode in trees}
    for round_index in range(FLAGS.repeats):
        for mode, tree in trees.items():
            runs[mode].append(_run(mode, tree, work_dir, f"{mode}-{round_index}"))
            rate = runs[mode][-1]["events_per_second"]
            print(f"{mode} round {round_index + 1}: {rate:,.0f} events/s", flush=True)
    _print(runs)
    print(f"end: load average {_load()}")


if __name__ == "__main__":
    app.run(main)
