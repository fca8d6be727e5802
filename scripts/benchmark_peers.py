"""ncf-online beside the online learners a user would install instead, on one stream,
by one prequential protocol.

    python scripts/benchmark_peers.py --events_dir /tmp/ml1m-events --name ml-1m
    python scripts/benchmark_peers.py --events_dir /tmp/stream2m --name 2m-users \\
        --user_capacities 100000,400000 --item_capacity 65536 --plot_dir docs/images

Every system reads the same event folder in the same order and is measured by
`recommendation/online/prequential.py` (1 event in 8, chosen by a hash of the event,
scored before it is learned against 99 items seen before it; HR@10, NDCG@10, AUC by
cold and warm users):

- ncf-online under each policy of --policies (its user table at each of
  --user_capacities, its item table at --item_capacity), a process each
  (`online_runs.stream_run`, peak RSS polled from outside);
- river's ``reco.BiasedMF`` (no eviction: one run at river's defaults, and one at each
  of --river_settings), with --river_python (the python of
  ``scripts/peers/setup_river.sh``'s environment), if given;
- TorchRec's managed-collision tables (``mch_lru``, ``mch_lfu``) and plain hashing
  (``hash``) at each capacity, with --torchrec_python (``setup_torchrec.sh``), if given;
- the baseline ladder: popularity so far and recent popularity at each half-life of
  --popularity_half_lives (``peers/popularity_online.py``, event by event), and on a
  generated stream the generator's references (each candidate's true popularity, and
  the oracle: that and the user's true taste) from the folder's references file.

For each: steady events/s (after the first second or report: start-up and tracing
left out), peak RSS, bytes per live id (the peak RSS above that of a process that only
imports the system's framework, over the ids it holds at the end: its tables, whole
where they are allocated whole, its model and its working memory) and the protocol's
numbers. Prints a table and writes each run's JSON to --work_dir; with
--plot_dir, a chart of HR@10 against events/s. The systems take turns (each run on
its own, one after another): the load average is printed beside the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_runs  # noqa: E402  (sibling scripts)
import plots  # noqa: E402

from recommendation.data.stream_references import FILE_NAME as REFERENCES_FILE  # noqa: E402

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers")
TORCHREC_TABLES = ("mch_lru", "mch_lfu", "hash")

FLAGS = flags.FLAGS
flags.DEFINE_string("events_dir", None, "The event folder every system reads.")
flags.DEFINE_string("name", "stream", "The stream's name in the table and the chart.")
flags.DEFINE_list("user_capacities", ["65536"], "User-table capacities (ids).")
flags.DEFINE_integer("item_capacity", 32768, "Item-table capacity (ids).")
flags.DEFINE_list("policies", ["none", "lru", "lfu", "ttl:200"], "ncf-online's user policies.")
flags.DEFINE_string("river_python", None, "Python of river's environment (setup_river.sh).")
flags.DEFINE_multi_string(
    "river_settings",
    [],
    "More river runs, each with these river_online.py flags (space-separated), beside the "
    "one at river's defaults: e.g. the rate chosen on validation streams.",
)
flags.DEFINE_string("torchrec_python", None, "Python of TorchRec's environment.")
flags.DEFINE_list(
    "popularity_half_lives",
    [],
    "Recent-popularity rungs of the ladder: half-lives in events (popularity so far always runs).",
)
flags.DEFINE_string("work_dir", None, "Where the runs' files go (default: a temporary folder).")
flags.DEFINE_string("plot_dir", None, "Write the chart here.")
flags.DEFINE_list(
    "results_from",
    [],
    "Run nothing: the table and chart of the runs whose JSON files are in these "
    "--work_dir folders of earlier invocations, in order; a system at a capacity that an "
    "earlier folder of the list holds is left out (ours run again after a change, "
    "listed first, beside the peers of an earlier invocation).",
)


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _imports_only(python: str, modules: str) -> int:
    """Peak RSS (bytes) of a `python` that only imports `modules`."""
    code = f"import {modules}, sys; sys.stdout.write(open('/proc/self/status').read())"
    status = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    line = next(line for line in status.stdout.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _ours(capacity: int, policy: str, work: str) -> dict:
    """ncf-online at `capacity` under `policy`: its summary and what is measured of it."""
    extra = (f"--item_capacity={FLAGS.item_capacity}", f"--user_evict_policy={policy}")
    online_runs.fresh_folder(work)
    run = online_runs.stream_run(FLAGS.events_dir, capacity, work, more_flags=extra)
    summary = run["summary"]
    return {
        "steady_events_per_second": run["steady_events_per_second"],
        "peak_rss": run["peak_rss"],
        "ids": run["ids"],
        "tables": summary["tables"],
        "prequential": summary["prequential"],
    }


def _peer(python: str, script: str, work: str, *extra: str) -> dict:
    """A peer harness over the folder, with the python of its environment; its result,
    and its peak RSS polled from outside (as ncf-online's)."""
    online_runs.fresh_folder(work)
    summary_file = os.path.join(work, "result.json")
    command = [python, os.path.join(PEERS, script), f"--events_dir={FLAGS.events_dir}"]
    command += ["--seed=1", f"--summary_file={summary_file}", *extra]
    with open(os.path.join(work, "stderr.log"), "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        peak = 0
        while process.poll() is None:
            peak = max(peak, machine.peak_rss_bytes(process.pid) or 0)
            time.sleep(0.05)
    if process.returncode:
        sys.exit(f"error: {script} failed: see {work}/stderr.log")
    with open(summary_file) as file:
        result = json.load(file)
    tables = result["tables"]
    return {
        "steady_events_per_second": result["steady_events_per_second"],
        "peak_rss": max(peak, result.get("peak_rss") or 0),
        "ids": sum(table["ids"] for table in tables.values()),
        "tables": tables,
        "prequential": result["prequential"],
    }


def _rate(value: float | None) -> str:
    """Events/s as printed (n/a: too short a run to have a steady part)."""
    return "n/a" if value is None else f"{value:,.0f}"


def _measured(run: dict, framework: int) -> dict:
    """`run` with its bytes per live id: peak RSS above `framework` (bytes), over its ids."""
    return {**run, "bytes_per_id": (run["peak_rss"] - framework) / max(1, run["ids"])}


def _runs(work: str) -> list[tuple[str, str, dict]]:
    """(system, capacity, result) of every run, one after another."""
    frameworks = {"ncf-online": _imports_only(sys.executable, "recommendation.online_main")}
    systems = []  # (system, its framework, capacity, run)
    for capacity in (int(value) for value in FLAGS.user_capacities):
        for policy in FLAGS.policies:
            run = lambda folder, c=capacity, p=policy: _ours(c, p, folder)  # noqa: E731
            systems.append((f"ncf-online {policy}", "ncf-online", f"{capacity:,}", run))
        for tables in TORCHREC_TABLES if FLAGS.torchrec_python else ():
            extra = (
                f"--tables={tables}",
                f"--user_capacity={capacity}",
                f"--item_capacity={FLAGS.item_capacity}",
            )
            run = lambda folder, extra=extra: _peer(  # noqa: E731
                FLAGS.torchrec_python, "torchrec_online.py", folder, *extra
            )
            systems.append((f"TorchRec {tables}", "TorchRec", f"{capacity:,}", run))
    if FLAGS.torchrec_python:
        frameworks["TorchRec"] = _imports_only(FLAGS.torchrec_python, "torch, torchrec")
    frameworks["numpy"] = _imports_only(sys.executable, "numpy")
    for half_life in [None, *FLAGS.popularity_half_lives]:
        more = () if half_life is None else (f"--half_life_events={half_life}",)
        run = lambda folder, more=more: _peer(  # noqa: E731
            sys.executable, "popularity_online.py", folder, *more
        )
        name = "popularity so far" if half_life is None else f"recent popularity {half_life}"
        systems.append((name, "numpy", "all ids", run))
    if FLAGS.river_python:
        frameworks["river"] = _imports_only(FLAGS.river_python, "river")
        for settings in ["", *FLAGS.river_settings]:
            more = tuple(settings.split())
            run = lambda folder, more=more: _peer(  # noqa: E731
                FLAGS.river_python, "river_online.py", folder, *more
            )
            name = f"river BiasedMF {settings}".strip()
            systems.append((name, "river", "all ids", run))
    runs = []
    for index, (system, framework, capacity, run) in enumerate(systems):
        folder = os.path.join(work, f"{index:02d}")
        result = _measured(run(folder), frameworks[framework])
        _keep(runs, work, index, system, capacity, result)
        hr = result["prequential"]["all"]["hr"]
        print(
            f"{system} at {capacity}: {_rate(result['steady_events_per_second'])} events/s, "
            f"HR@10 {hr:.4f}",
            flush=True,
        )
    for index, (system, capacity, result) in enumerate(_references(), len(systems)):
        _keep(runs, work, index, system, capacity, result)
    return runs


def _keep(runs: list, work: str, index: int, system: str, capacity: str, result: dict) -> None:
    """Adds a run to `runs` and its JSON to `work` (what --results_from reads)."""
    runs.append((system, capacity, result))
    with open(os.path.join(work, f"{index:02d}.json"), "w") as file:
        json.dump({"system": system, "capacity": capacity, **result}, file)


def _references() -> list[tuple[str, str, dict]]:
    """The generator's references (a generated stream's folder holds them; none for
    other streams), as rows of the table: the protocol's numbers only."""
    path = os.path.join(FLAGS.events_dir, REFERENCES_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as file:
        scores = json.load(file)
    no_speed = {"steady_events_per_second": None, "peak_rss": None, "bytes_per_id": None}
    return [
        (
            f"generator's {name} reference",
            "reference",
            {**no_speed, "tables": {}, "prequential": scores[name]},
        )
        for name in ("popularity", "oracle")
    ]


def _earlier_runs() -> list[tuple[str, str, dict]]:
    """(system, capacity, result) of the runs saved in each of --results_from, the
    first folder's where two hold one system at one capacity. ncf-online's steady rate
    is read again from its run's summary, by today's `online_runs` rule."""
    runs, seen = [], set()
    for folder in FLAGS.results_from:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
        if not names:
            sys.exit(f"error: --results_from {folder} holds no run's JSON file")
        for name in names:
            with open(os.path.join(folder, name)) as file:
                result = json.load(file)
            summary_path = os.path.join(folder, name[: -len(".json")], "summary.json")
            if os.path.exists(summary_path):
                with open(summary_path) as file:
                    rate = online_runs.sustained_events_per_second(json.load(file))
                result["steady_events_per_second"] = rate
            key = (result.pop("system"), result.pop("capacity"))
            if key not in seen:
                seen.add(key)
                runs.append((*key, result))
    return runs


def _table(runs: list[tuple[str, str, dict]]) -> None:
    print(
        f"\n{FLAGS.name}: user capacity | system | steady events/s | peak RSS MB | bytes per "
        "live id | prequential HR@10 all / cold / warm | NDCG@10 | AUC | users evicted"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for system, capacity, result in runs:
        numbers = result["prequential"]
        users = result["tables"].get("user")
        evicted = "n/a" if users is None else f"{users.get('evicted', 0):,}"
        peak, per_id = result["peak_rss"], result["bytes_per_id"]
        print(
            f"| {capacity} | {system} | {_rate(result['steady_events_per_second'])} | "
            f"{'n/a' if peak is None else f'{peak / 2**20:,.0f}'} | "
            f"{'n/a' if per_id is None else f'{per_id:,.0f}'} | "
            f"{numbers['all']['hr']:.4f} / {numbers['cold']['hr']:.4f} / "
            f"{numbers['warm']['hr']:.4f} | {numbers['all']['ndcg']:.4f} | "
            f"{numbers['all']['auc']:.4f} | {evicted} |"
        )


def _chart(runs: list[tuple[str, str, dict]], cpu: str) -> None:
    series: dict[str, tuple[list[float], list[float]]] = {}
    for system, _, result in runs:
        if result["steady_events_per_second"] is None:
            continue
        xs, ys = series.setdefault(system, ([], []))  # a point per capacity
        xs.append(result["steady_events_per_second"])
        ys.append(result["prequential"]["all"]["hr"])
    plots.line_chart(
        os.path.join(FLAGS.plot_dir, f"peers_{FLAGS.name}.png"),
        f"Online learners on {FLAGS.name}: HR@10 against speed, a point per capacity",
        "steady events/s",
        "prequential HR@10 (1 event in 8)",
        series,
        cpu,
    )


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.results_from:
        runs = _earlier_runs()
        _table(runs)
        if FLAGS.plot_dir:
            plots.require(FLAGS.plot_dir)
            _chart(runs, machine.cpu_line())
        return
    if not FLAGS.events_dir or not os.path.isdir(FLAGS.events_dir):
        sys.exit(f"error: --events_dir must be a folder of event files, got {FLAGS.events_dir!r}")
    for python in (FLAGS.river_python, FLAGS.torchrec_python):
        if python and not os.access(python, os.X_OK):
            sys.exit(f"error: {python} is not an executable python: run its setup script")
    if FLAGS.plot_dir:
        plots.require(FLAGS.plot_dir)
    cpu = machine.cpu_line()
    print(cpu)
    print("command: python " + " ".join(sys.argv))
    print(f"start: load average {_load()}", flush=True)
    work = FLAGS.work_dir or tempfile.mkdtemp(prefix="ncf-peers-")
    runs = _runs(work)
    _table(runs)
    print(f"end: load average {_load()}")
    if FLAGS.plot_dir:
        _chart(runs, cpu)


if __name__ == "__main__":
    app.run(main)
