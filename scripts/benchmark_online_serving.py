"""ncf-serve beside a live ncf-online: how fresh its answers are at any size, what
publishing costs the trainer, and how fast the server answers while it applies them.

    python scripts/benchmark_online_serving.py --ratings ../shared/data/ml-1m/ratings.dat \
        --live_ids 100000,1000000,10000000 --plot_dir docs/images

It starts its own redis-server and, for each part (--parts):

- freshness: for each N of --live_ids, a trainer (ncf-online, its defaults: a
  publication every 0.5 s, whole versions rarely) reads a Redis stream and a server
  (ncf-serve, started first) follows its export folder. The trainer first trains N
  events of N new users and ML-1M's first 5,000 ratings (the warm-up: N + 6,040 live
  users, their rows all in the server), then ML-1M is replayed at --live_rate events/s
  for --live_seconds, once the run's first checkpoint (a full one) is on disk (a full
  checkpoint comes every --full_checkpoint_every checkpoints, 300 s; what one costs
  training is printed beside). Each event's freshness is the time the server applied
  the first publication holding it (its status' ``applied_at``, polled every 10 ms) less the
  event's publication (its stream entry id's milliseconds): p50, p90, p99 and max over
  every replayed event. For each N of --whole_version_ids the same run is made the
  TensorFlow Serving way: no publications, a whole version every 2 s, which the server
  loads. Beside each: the server's memory (RSS) above its import (taken before any
  version existed) against the bytes of the rows it holds, and its peak. These
  trainers run on the system's allocator (`FRESHNESS_TRAINER_ENV`: memory);
- trainer: the trainer's steady events/s (unpaced: --trainer_live_ids new users, then
  ML-1M) with its publications (the default) and without (``--publish_every_secs=0``),
  --repeats rounds taking turns, and the ratio;
- server: a server of the ML-1M model (trained on ML-1M's first --served_events
  ratings) answering wrk (--wrk_connections, --wrk_seconds): ``recommend`` top-10 for
  one random ML-1M user a request, while the trainer trains the rest at --live_rate:
  requests/s and latency p50 / p99 with no publication arriving (the trainer publishes
  nothing and writes no version meanwhile: the baseline), with publications arriving,
  and with a whole version every 2 s loaded by the server; ratios to the baseline.

The machine is shared: the load average is printed beside the numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_runs  # noqa: E402  (sibling scripts)
import plots  # noqa: E402
import replay_events  # noqa: E402

from recommendation.data import movielens  # noqa: E402
from recommendation.model.network import NeuMF  # noqa: E402
from recommendation.online.online_ncf import OnlineParams  # noqa: E402
from recommendation.online.sources import redis_entries  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("ratings", None, "ML-1M ratings.dat.")
flags.DEFINE_string("work_dir", None, "Scratch folder (default: a new temporary one).")
flags.DEFINE_list("parts", ["freshness", "trainer", "server"], "What to measure.")
flags.DEFINE_list("live_ids", ["100000", "1000000", "10000000"], "Sizes of the freshness runs.")
flags.DEFINE_list(
    "whole_version_ids", ["1000000"], "Sizes of the freshness runs the whole-version way."
)
flags.DEFINE_float("live_rate", 10_000, "Replay rate of the live phases, events/s.")
flags.DEFINE_float("live_seconds", 30, "Length of a freshness run's replay.")
flags.DEFINE_integer("trainer_live_ids", 1_000_000, "New users of the trainer part's stream.")
flags.DEFINE_integer("repeats", 2, "Rounds of the trainer part (its runs take turns).")
flags.DEFINE_integer("served_events", 800_000, "ML-1M ratings trained before the server part.")
flags.DEFINE_integer("wrk_connections", 4, "Connections wrk keeps open.")
flags.DEFINE_integer("wrk_seconds", 20, "Length of each wrk run.")
flags.DEFINE_string("plot_dir", None, "Also draw serving-freshness.png there (matplotlib).")
flags.DEFINE_integer("seed", 1, "Seed of the models and of the new users' items.")
flags.mark_flag_as_required("ratings")

WARM_UP_RATINGS = 5000
STALL_SECONDS = 300  # a warm-up or catch-up that moves no further for this long fails
# Columns of a row: NeuMF's default widths and the bias.
ROW_BYTES = 4 * (NeuMF.table_width(OnlineParams.mf_dim, OnlineParams.layers) + 1)


def _entry(entry_id: str | bytes) -> int:
    """A stream entry id as one ordered integer."""
    milliseconds, sequence = redis_entries.stream_id(entry_id)
    return milliseconds << 20 | sequence


class _Process:
    """A program of this checkout, its log in the work folder."""

    def __init__(
        self, work_dir: str, name: str, module: str, *flags: str, env: dict | None = None
    ) -> None:
        self.log = os.path.join(work_dir, f"{name}.log")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, *flags],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        with open(self.log) as log:
            return log.read()

    def check(self, what: str) -> None:
        if self.process.poll() is not None:
            sys.exit(f"error: {self.log} ended (code {self.process.returncode}) {what}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait()


class _Server(_Process):
    """ncf-serve on a free port: its status and its memory."""

    def __init__(self, work_dir: str, name: str, export_dir: str) -> None:
        super().__init__(
            work_dir,
            name,
            "recommendation.serve_main",
            "--model_name=ncf",
            f"--model_base_path={export_dir}",
            "--rest_api_host=127.0.0.1",
            "--rest_api_port=0",
        )
        deadline = time.monotonic() + 120
        while not (found := re.search(r"on http://127.0.0.1:(\d+)/", self.text())):
            self.check("before it listened")
            if time.monotonic() > deadline:
                sys.exit(f"error: {self.log} did not say where it listens")
            time.sleep(0.05)
        self.port = int(found[1])
        self.imported_rss = machine.resident_bytes(self.process.pid)

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/v1/models/ncf", timeout=30
            ) as response:
                return json.loads(response.read())["publications"]
        except urllib.error.HTTPError:
            return None  # no version yet


def _trainer(
    work_dir: str, name: str, stream: str, redis_url: str, *flags: str, env: dict | None = None
) -> _Process:
    folder = os.path.join(work_dir, name)
    return _Process(
        work_dir,
        name,
        "recommendation.online_main",
        f"--redis_url={redis_url}",
        f"--stream={stream}",
        f"--group={name}",
        f"--model_dir={folder}/model",
        f"--summary_file={folder}/summary.json",
        "--log_every_secs=1",
        f"--seed={FLAGS.seed}",
        *flags,
        env=env,
    )


# The freshness runs' trainers use the system's allocator: oneDNN's (TensorFlow's
# default on x86-64) keeps every buffer a growing table freed, and a trainer of 10^7
# ids then holds about 14 GB, beyond what a 24-GB machine spares beside the server and
# Redis. The live phase trains 10,000 events/s, far below either allocator's rate.
FRESHNESS_TRAINER_ENV = {"TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1"}


def _summary(work_dir: str, name: str) -> dict:
    with open(os.path.join(work_dir, name, "summary.json")) as summary:
        return json.load(summary)


def _held(status: dict | None) -> int:
    """The last stream entry a server's state holds (0: none)."""
    entry_id = redis_entries.redis_entry_id((status or {}).get("position"))
    return _entry(entry_id) if entry_id else 0


def _wait_until_held(server: _Server, trainer: _Process, last: int, what: str) -> float:
    """Seconds until `server` holds stream entry `last`; exits if a process ends or it
    moves no further for STALL_SECONDS."""
    start = last_move = last_report = time.monotonic()
    held = -1
    while (now_held := _held(server.status())) < last:
        now = time.monotonic()
        trainer.check(f"before the server held {what}")
        server.check(f"before it held {what}")
        if now_held != held:
            held, last_move = now_held, now
        elif now - last_move > STALL_SECONDS:
            sys.exit(f"error: {what} made no progress for {STALL_SECONDS} s: see {trainer.log}")
        if now - last_report > 10:
            last_report = now
            status = server.status() or {}
            logging.info(
                "%s: %.0f s, the server holds %s users (publication %s)",
                what,
                now - start,
                f"{status.get('users', 0):,}",
                status.get("publication"),
            )
        time.sleep(0.1)
    return time.monotonic() - start


class _StatusPoller(threading.Thread):
    """Notes each state a server serves: (applied_at, last stream entry it holds)."""

    def __init__(self, server: _Server) -> None:
        super().__init__(daemon=True)
        self.server, self.seen, self.stop = server, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status = self.server.status()
            if status is not None and (not self.seen or self.seen[-1][1] != _held(status)):
                self.seen.append((status["applied_at"], _held(status)))
            time.sleep(0.01)


def _stream_entries(client, stream: str, after: int) -> np.ndarray:
    """The entries of `stream` after entry `after`, as `_entry` integers."""
    found, start = [], "-"
    while True:
        page = client.xrange(stream, min=start, count=50_000)
        found += [_entry(entry_id) for entry_id, _ in page]
        if len(page) < 50_000:
            break
        start = "(" + page[-1][0].decode()
    entries = np.array(found, np.int64)
    return entries[entries > after]


def _freshness(redis_url: str, work_dir: str, events: np.ndarray, live_ids: int, whole: bool):
    """One freshness run (module docstring) at `live_ids` new users; `whole`: the
    whole-version way."""
    way = "whole versions" if whole else "publications"
    name = f"fresh-{'whole' if whole else 'pub'}-{live_ids}"
    client = online_runs.redis_client(redis_url)
    warm_up = np.concatenate(
        [online_runs.new_user_events(events, live_ids, FLAGS.seed), events[:WARM_UP_RATINGS]]
    )
    publisher = replay_events.RedisPublisher(client, name)
    start = time.perf_counter()
    replay_events.replay(publisher, warm_up, rate=0, chunk=5000)
    last_warm_up = _entry(client.xrevrange(name, count=1)[0][0])
    logging.info(
        "%s: warm-up of %s events published in %.0f s",
        name,
        f"{len(warm_up):,}",
        time.perf_counter() - start,
    )
    export_dir = os.path.join(work_dir, name, "export")
    server = _Server(work_dir, f"{name}-server", export_dir)
    capacity = 1 << (live_ids + online_runs.ML_1M_USERS).bit_length()
    mode = ["--publish_every_secs=0", "--export_every_secs=2"] if whole else []
    trainer = _trainer(
        work_dir,
        name,
        name,
        redis_url,
        f"--export_dir={export_dir}",
        f"--user_capacity={capacity}",
        *mode,
        env=FRESHNESS_TRAINER_ENV,
    )
    poller = _StatusPoller(server)
    try:
        warm_up_seconds = _wait_until_held(server, trainer, last_warm_up, f"{name} warm-up")
        # A run's first checkpoint is full, at its start: the window begins after it, and
        # what a full checkpoint (one in every --full_checkpoint_every) costs training is
        # reported beside it.
        manifest = os.path.join(work_dir, name, "model", "deltas.json")
        while not os.path.exists(manifest):
            trainer.check("before its first checkpoint")
            time.sleep(0.1)
        poller.start()
        load = online_runs.load_average()
        count = int(FLAGS.live_rate * FLAGS.live_seconds)
        live = events[WARM_UP_RATINGS : WARM_UP_RATINGS + count]
        replay_start = time.time()
        seconds = replay_events.replay(publisher, live, FLAGS.live_rate, chunk=500)
        last = _entry(client.xrevrange(name, count=1)[0][0])
        _wait_until_held(server, trainer, last, f"{name} replay")
        time.sleep(0.1)
        rss = machine.resident_bytes(server.process.pid)
        peak_rss = machine.peak_rss_bytes(server.process.pid)
        status = server.status()
    finally:
        poller.stop.set()
        trainer.stop()
        server.stop()
    poller.join()
    entries = _stream_entries(client, name, last_warm_up)
    client.delete(name)
    held = np.array([entry for _, entry in poller.seen])
    applied = np.array([at for at, _ in poller.seen])
    published = (entries >> 20) / 1000.0
    delays = applied[np.searchsorted(held, entries)] - published  # the first state holding it
    # Each state's oldest new event: the first entry past the state before.
    oldest = np.searchsorted(entries, held[:-1], side="right")
    states = [
        (applied[i + 1] - replay_start, applied[i + 1] - published[first])
        for i, first in enumerate(oldest)
        if first < len(entries) and held[i + 1] > held[i]
    ]
    summary = _summary(work_dir, name)
    rows = status["users"] + status["items"]
    return {
        "name": name,
        "way": way,
        "live_ids": live_ids,
        "ids": rows,
        "delays": delays,
        "states": states,
        "rate": count / seconds,
        "load": load,
        "warm_up_seconds": warm_up_seconds,
        "memory": (rss - server.imported_rss, peak_rss - server.imported_rss, rows * ROW_BYTES),
        "summary": summary,
    }


def _trainer_rates(redis_url: str, work_dir: str, events: np.ndarray) -> dict:
    """Steady events/s with and without publications, taking turns (module docstring):
    on ML-1M with --trainer_live_ids users held (each run resumes a copy of one model
    trained on that many new users first), and while they flood in (the new users
    themselves, each event a new row to publish: the worst case)."""
    client = online_runs.redis_client(redis_url)
    publisher = replay_events.RedisPublisher(client, "flood")
    new_users = online_runs.new_user_events(events, FLAGS.trainer_live_ids, FLAGS.seed)
    replay_events.replay(publisher, new_users, rate=0, chunk=5000)
    # ML-1M three times over: the run's first version (a copy of the users held, written
    # beside training) weighs on its rate as it would on a trainer that runs for long.
    steady = np.concatenate([events] * 3)
    replay_events.replay(replay_events.RedisPublisher(client, "steady"), steady, 0, chunk=5000)
    capacity = 1 << (FLAGS.trainer_live_ids + online_runs.ML_1M_USERS).bit_length()
    warm = os.path.join(work_dir, "rate-warm")
    warm_up = _trainer(
        work_dir,
        "rate-warm",
        "flood",
        redis_url,
        f"--user_capacity={capacity}",
        "--idle_timeout_secs=3",
        "--publish_every_secs=0",
    )
    if warm_up.process.wait() != 0:
        sys.exit(f"error: the warm-up trainer failed: see {warm_up.log}")
    ways = {"publications (default)": (), "no publications": ("--publish_every_secs=0",)}
    rates = {(stream, way): [] for stream in ("steady", "flood") for way in ways}
    for round_index in range(FLAGS.repeats):
        for stream in ("steady", "flood"):
            for number, (way, more) in enumerate(ways.items()):
                name = f"rate-{stream}-{number}-{round_index}"
                if stream == "steady":  # the model holding the new users, resumed
                    shutil.copytree(
                        os.path.join(warm, "model"), os.path.join(work_dir, name, "model")
                    )
                trainer = _trainer(
                    work_dir,
                    name,
                    stream,
                    redis_url,
                    f"--export_dir={os.path.join(work_dir, name, 'export')}",
                    f"--user_capacity={capacity}",
                    "--idle_timeout_secs=3",
                    *more,
                )
                if trainer.process.wait() != 0:
                    sys.exit(f"error: the trainer failed: see {trainer.log}")
                rate = online_runs.sustained_events_per_second(_summary(work_dir, name))
                rates[stream, way].append(rate)
                logging.info(
                    "%s, %s, round %d: %s events/s", stream, way, round_index + 1, f"{rate:,.0f}"
                )
    for stream in ("flood", "steady"):
        client.delete(stream)
    return {"rates": rates, "events": {"steady": len(steady), "flood": len(new_users)}}


WRK_SCRIPT = """
math.randomseed(%d)
request = function()
  local body = '{"signature_name": "recommend", "inputs": {"user_id": [' ..
    math.random(1, %d) .. '], "k": 10}}'
  return wrk.format("POST", "/v1/models/ncf:predict", {["Content-Type"] = "application/json"}, body)
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), summary.errors.status))
end
"""


def _wrk(port: int, script: str) -> dict:
    """wrk against `port` for --wrk_seconds: requests/s, p50 and p99 (ms), non-2xx."""
    result = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{FLAGS.wrk_connections}",
            f"-d{FLAGS.wrk_seconds}s",
            "--timeout=10s",
            "--latency",
            "-s",
            script,
            f"http://127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    requests, duration, p50, p99, errors = map(
        int, re.search(r"RESULT (.*)", result.stdout)[1].split()
    )
    return {
        "rps": requests / (duration / 1e6),
        "p50": p50 / 1e3,
        "p99": p99 / 1e3,
        "errors": errors,
    }


def _server_runs(redis_url: str, work_dir: str, events: np.ndarray) -> dict:
    """The server part (module docstring): one trainer and server per way."""
    script = os.path.join(work_dir, "recommend.lua")
    with open(script, "w") as out:
        out.write(WRK_SCRIPT % (FLAGS.seed, online_runs.ML_1M_USERS))
    # The model trains on the first ratings with its defaults, then its trainer is
    # restarted the way measured (from its checkpoint) for the live phase.
    ways = {
        "no publications arriving": ("--publish_every_secs=0", "--export_every_secs=100000"),
        "publications arriving (default)": (),
        "whole versions every 2 s": ("--publish_every_secs=0", "--export_every_secs=2"),
    }
    client = online_runs.redis_client(redis_url)
    served, live = events[: FLAGS.served_events], events[FLAGS.served_events :]
    results = {}
    for number, (way, more) in enumerate(ways.items()):
        name = f"serve-{number}"
        publisher = replay_events.RedisPublisher(client, name)
        replay_events.replay(publisher, served, rate=0, chunk=5000)
        last = _entry(client.xrevrange(name, count=1)[0][0])
        export_dir = os.path.join(work_dir, name, "export")
        server = _Server(work_dir, f"{name}-server", export_dir)
        trainer = _trainer(work_dir, name, name, redis_url, f"--export_dir={export_dir}")
        try:
            _wait_until_held(server, trainer, last, f"{name} warm-up")
            trainer.stop()
            trainer = _trainer(work_dir, name, name, redis_url, f"--export_dir={export_dir}", *more)
            while "restored" not in trainer.text():
                trainer.check("before it restored its checkpoint")
                time.sleep(0.1)
            time.sleep(3)  # a new run's first version loaded by the server
            load = online_runs.load_average()
            replaying = threading.Thread(
                target=replay_events.replay,
                args=(publisher, live, FLAGS.live_rate, 500),
                daemon=True,
            )
            replaying.start()
            results[way] = {**_wrk(server.port, script), "load": load}
            replaying.join()
        finally:
            trainer.stop()
            server.stop()
        client.delete(name)
        logging.info("%s: %s", way, results[way])
    return results


def _print_freshness(runs: list[dict]) -> None:
    print(
        f"freshness: an event's publication -> ncf-serve answering with it (ML-1M replayed at "
        f"{FLAGS.live_rate:,.0f} events/s for {FLAGS.live_seconds:.0f} s, every replayed event)"
    )
    print(
        "   live ids | way            |   p50 s |   p90 s |   p99 s |   max s | server memory "
        "above import (peak) / rows | load"
    )
    for run in runs:
        delays, (above, peak, rows) = run["delays"], run["memory"]
        print(
            f"{run['ids']:>11,} | {run['way']:14} | {np.median(delays):7.2f} | "
            f"{np.percentile(delays, 90):7.2f} | {np.percentile(delays, 99):7.2f} | "
            f"{delays.max():7.2f} | {above / 2**20:,.0f} MB ({peak / 2**20:,.0f} MB) / "
            f"{rows / 2**20:,.0f} MB = {above / rows:.2f}x | {run['load']}"
        )
    for run in runs:
        summary = run["summary"]
        made = summary.get("publications") or {"count": 0, "rows": 0, "seconds": 0}
        copy, write = summary["export_copy_seconds"] or 0, summary["export_seconds"] or 0
        full = summary["checkpoints"]["full"]
        print(
            f"  {run['name']}: replay at {run['rate']:,.0f} events/s; warm-up held after "
            f"{run['warm_up_seconds']:.0f} s; a version copied in {copy:.3f} s (training "
            f"waits), written in {write:.2f} s; {made['count']:,} publications of "
            f"{made['rows'] or 0:,.0f} rows, {made['seconds'] or 0:.3f} s from take to file; "
            f"a full checkpoint: training waited {full['wait_seconds'] or 0:.2f} s, written "
            f"in {full['seconds'] or 0:.2f} s"
        )
    base = next((r for r in runs if r["way"] == "publications"), None)
    for run in runs:
        if base is not None and run is not base and run["way"] == "publications":
            print(
                f"  median at {run['ids']:,} / at {base['ids']:,}: "
                f"{np.median(run['delays']) / np.median(base['delays']):.2f}x"
            )
    print()


def _print_trainer(result: dict) -> None:
    rates = result["rates"]
    print(
        f"trainer: steady events/s, unpaced, {FLAGS.repeats} rounds taking turns; "
        f"steady: ML-1M three times over ({result['events']['steady']:,} events) with "
        f"{FLAGS.trainer_live_ids:,} users held; flood: {result['events']['flood']:,} new "
        "users, each event a new row"
    )
    for stream in ("steady", "flood"):
        means = {}
        for (kind, way), values in rates.items():
            if kind == stream:
                means[way] = float(np.mean(values))
                runs = ", ".join(f"{v:,.0f}" for v in values)
                print(f"  {stream:6} {way:24} {means[way]:10,.0f}  ({runs})")
        ways = list(means)
        print(f"  {stream:6} ratio {ways[0]} / {ways[1]}: {means[ways[0]] / means[ways[1]]:.3f}x")
    print()


def _print_server(results: dict) -> None:
    print(
        f"server: recommend top-10 of one ML-1M user a request, wrk -c{FLAGS.wrk_connections} "
        f"for {FLAGS.wrk_seconds:.0f} s, the trainer training at {FLAGS.live_rate:,.0f} events/s"
    )
    print("way                              | requests/s |  p50 ms |  p99 ms | non-2xx | load")
    base = next(iter(results.values()))
    for way, r in results.items():
        print(
            f"{way:32} | {r['rps']:10,.0f} | {r['p50']:7.2f} | {r['p99']:7.2f} | "
            f"{r['errors']:7} | {r['load']}  ({r['rps'] / base['rps']:.2f}x the requests/s, "
            f"{r['p99'] / base['p99']:.2f}x the p99)"
        )
    print()


def _plot(runs: list[dict], cpu: str) -> str:
    series = {
        f"{run['ids']:,} live ids, {run['way']}": tuple(zip(*run["states"], strict=True))
        for run in runs
        if run["states"]
    }
    return plots.line_chart(
        os.path.join(FLAGS.plot_dir, "serving-freshness.png"),
        f"ncf-serve's freshness: ML-1M replayed at {FLAGS.live_rate:,.0f} events/s",
        "state served, s after the replay began",
        "oldest event it newly holds: its publication to the answer, s",
        series,
        cpu,
        threshold=("1 s", 1.0),
        y_from_zero=True,
    )


def main(argv: list[str]) -> None:
    del argv
    unknown = set(FLAGS.parts) - {"freshness", "trainer", "server"}
    if unknown:
        sys.exit(f"error: unknown --parts {sorted(unknown)}: freshness, trainer or server")
    if "server" in FLAGS.parts and not shutil.which("wrk"):
        sys.exit("error: the server part needs wrk: apt-get install -y wrk")
    if FLAGS.plot_dir:
        plots.require(FLAGS.plot_dir)
    work_dir = FLAGS.work_dir or tempfile.mkdtemp(prefix="ncf-serving-bench-")
    os.makedirs(work_dir, exist_ok=True)
    cpu = machine.cpu_line()
    print(cpu)
    print(f"start: load average {online_runs.load_average()}")
    events = replay_events.load_events(FLAGS.ratings, movielens.DAT_FORMAT)
    redis_server, redis_url = online_runs.start_redis(work_dir)
    try:  # each part's table as soon as it is measured
        if "freshness" in FLAGS.parts:
            fresh = [
                _freshness(redis_url, work_dir, events, live_ids, whole=False)
                for live_ids in map(int, FLAGS.live_ids)
            ]
            fresh += [
                _freshness(redis_url, work_dir, events, live_ids, whole=True)
                for live_ids in map(int, FLAGS.whole_version_ids)
            ]
            _print_freshness(fresh)
            if FLAGS.plot_dir:
                print(f"wrote {_plot(fresh, cpu)}\n")
        if "trainer" in FLAGS.parts:
            _print_trainer(_trainer_rates(redis_url, work_dir, events))
        if "server" in FLAGS.parts:
            _print_server(_server_runs(redis_url, work_dir, events))
    finally:
        redis_server.terminate()
        redis_server.wait()
    print(f"end: load average {online_runs.load_average()}")


if __name__ == "__main__":
    app.run(main)
