"""Online training benchmark: ML-1M replayed through a real Redis, one run.

    python scripts/benchmark_online.py --ratings ../shared/data/ml-1m/ratings.dat

It starts its own redis-server, splits ML-1M as the offline benchmark does (each
user's last interaction held out, 999 sampled evaluation negatives), publishes the
other ratings into a stream in timestamp order, and measures

- sustained throughput: events/s trained by ``online_main`` (4 negatives each) at
  each boost level, the O0 run as the baseline (ratio), from the Redis stream, the
  same events in a Kafka topic (a tansu broker it starts, scripts/tansu_broker.py;
  --kafka_partitions, keyed by user) or as a folder of CSV files (--sources), with
  each source's rate to Redis's; with --trees, the trainers of
  other checkouts (another commit: ``git worktree add``) take turns with this one's
  in the same runs, and the first of them at O1 (or its first level) is the baseline;
  --variant adds runs of this checkout with more flags (nothing scored, another
  batch). Before any change to the step's path, run it against the checkout before
  the change (docs/benchmarks.md says how) and keep the ratio;
- freshness of whole versions (the TensorFlow Serving way: ncf-serve's publications
  are scripts/benchmark_online_serving.py's): ratings replayed at --live_rate events/s
  while ``online_main`` exports a whole version every 2 s and publishes nothing; for
  each version, the time from the publication of the oldest rating it newly contains
  to the version's appearance; once from each stream
  among --sources (redis, kafka; Redis where there is none). With --live_ids N the
  trainer first trains a warm-up of N events of N new users (ids from 10,000,000,
  none of ML-1M's; each with an item drawn from the training ratings, by --seed), so
  that its user table holds N + 6,040 live ids while the timed replay runs;
  --capacity sets both tables' capacity (default: the trainer's), which must hold
  them. The line also gives the live ids at the end and the mean export and
  checkpoint seconds;
- cluster: the trainer on a loopback parameter-server cluster (``--serve_as`` tasks
  of one TF_CONFIG: 2 ps tasks and 1, then 2 workers) beside the one-process trainer
  on the same --cluster_events events, taking turns (--repeats rounds): events/s and
  ratio, where the coordinator's time goes per step of --cluster_batch_size events
  (resolving ids to rows, scheduling, waiting for the workers, the first step left
  out; the rest of a step's share of the sustained rate: reading the stream, callbacks)
  and the rows on each ps task;
- capacity: --capacity_ids events of as many new users trained on clusters of 1, 2
  and 4 ps tasks (--capacity_ps) and one worker: the user rows each ps task holds and
  its peak RSS, so that the split of the model shows in memory;
- accuracy: the prequential protocol's curve of the full pass (HR@10, NDCG@10, AUC by
  window of the stream, and by cold and warm users), then HR@10 of the final
  export against the 999 negatives, beside offline NeuMF trained for
  --offline_epochs epoch(s) with the same network on the same split (ratio).

Each trainer is a separate process reading the same stream through its own consumer
group. The load average is printed beside the numbers: the machine is shared.
--parts chooses what is measured (a quick comparison of two commits:
``--parts throughput --boost_levels O1 --trees old=/tmp/old-checkout``). Freshness
with a million live users at a capacity of 2^26:

    python scripts/benchmark_online.py --ratings ../shared/data/ml-1m/ratings.dat \
        --parts freshness --live_ids 1000000 --capacity 67108864
"""

from __future__ import annotations

import bisect
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from official.utils.misc import machine  # before TensorFlow: official sets its environment

# isort: split
import numpy as np
import tensorflow as tf
from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_runs  # noqa: E402
import plots  # noqa: E402  (sibling scripts)
import replay_events  # noqa: E402
import tansu_broker  # noqa: E402
from online_runs import sustained_events_per_second  # noqa: E402

from recommendation.data import movielens, preprocessing_cache
from recommendation.data.data_preprocessing import DataConfig  # noqa: E402
from recommendation.model import neumf_model
from recommendation.online.sources import (  # noqa: E402
    kafka_connection,
    redis_entries,
)
from recommendation.online.sources.kafka_connection import KafkaOptions  # noqa: E402
from recommendation.online.state import versioned_export  # noqa: E402
from recommendation.online_main import OnlineConfig  # noqa: E402
from recommendation.producer import negative_sampling  # noqa: E402
from recommendation.training import cycles
from recommendation.training.ncf_common import NcfConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("ratings", None, "ML-1M ratings.dat (inside a folder named ml-1m).")
flags.DEFINE_string("work_dir", None, "Scratch folder (default: a new temporary one).")
flags.DEFINE_list("boost_levels", ["O0", "O1", "O2"], "Boost levels to time.")
flags.DEFINE_integer("throughput_events", 300_000, "Events per throughput run.")
flags.DEFINE_integer("repeats", 2, "Throughput runs per boost level (interleaved).")
flags.DEFINE_string(
    "plot_dir",
    None,
    "Also draw the freshness run there (matplotlib, the benchmark extra): freshness.png "
    "(default: no figures).",
)
flags.DEFINE_float("live_rate", 10_000, "Replay rate of the freshness run, events/s.")
flags.DEFINE_float("live_seconds", 30, "Length of the freshness run's replay.")
flags.DEFINE_integer(
    "live_ids", 0, "New users trained before the freshness replay (live ids it runs with)."
)
flags.DEFINE_integer(
    "capacity", None, "Both tables' capacity in the freshness run (default: the trainer's)."
)
flags.DEFINE_integer("offline_epochs", 1, "Epochs of the offline baseline (0: skip it).")
flags.DEFINE_integer("seed", 1, "Seed of the evaluation negatives and the models.")
flags.DEFINE_list(
    "trees",
    [],
    "NAME=PATH checkouts whose trainers take turns with this checkout's in the "
    "throughput runs (the first is the baseline of the ratios).",
)
flags.DEFINE_list(
    "sources",
    ["redis"],
    "Where the throughput runs read the training events: redis (the stream), kafka (a "
    "topic of a local tansu broker), folder (CSV files, --events_dir); any of them. The "
    "freshness run reads each stream among them (Redis where there is none).",
)
flags.DEFINE_integer(
    "kafka_partitions", 1, "Partitions of the kafka source's topics (events keyed by user)."
)
flags.DEFINE_multi_string(
    "variant",
    [],
    "NAME:FLAGS, a throughput run of this checkout at O1 with more ncf-online flags "
    "(space-separated), beside the others: 'nothing scored:--prequential_every=1000000'.",
)
flags.DEFINE_list(
    "parts",
    ["throughput", "full_pass", "freshness", "offline"],
    "What to measure: throughput, full_pass (with the export's HR@10), freshness, "
    "offline (beside the full pass only), cluster, capacity.",
)
flags.DEFINE_integer("cluster_events", 300_000, "Events per run of the cluster part.")
flags.DEFINE_integer("cluster_batch_size", 4096, "Events per step of the cluster part.")
flags.DEFINE_list("cluster_workers", ["1", "2"], "Worker counts of the cluster runs.")
flags.DEFINE_integer("cluster_ps", 2, "Ps tasks of the cluster runs.")
flags.DEFINE_integer("capacity_ids", 1_000_000, "New users of the capacity part's stream.")
flags.DEFINE_list("capacity_ps", ["1", "2", "4"], "Ps task counts of the capacity runs.")
flags.mark_flag_as_required("ratings")
flags.register_validator("live_ids", lambda value: value >= 0, "--live_ids must not be negative")
flags.register_validator(
    "capacity", lambda value: value is None or value > 0, "--capacity must be positive"
)

THIS_TREE = "this"
WARM_UP_STALL_SECONDS = 300  # start-up and tracing included
PROGRESS_SECONDS = 10
EXPORT_SECONDS = 2  # the freshness part's whole versions


def _split(ratings_path: str, work_dir: str, seed: int):
    """The offline split and evaluation blocks, and the training ratings in time order."""
    data_dir = os.path.dirname(os.path.dirname(os.path.abspath(ratings_path)))
    if os.path.basename(os.path.dirname(os.path.abspath(ratings_path))) != movielens.ML_1M:
        sys.exit(f"error: {ratings_path} must be ml-1m/ratings.dat (the ML-1M release layout)")
    config = DataConfig(
        dataset=movielens.ML_1M, data_dir=data_dir, cache_dir=os.path.join(work_dir, "cache")
    )
    data = preprocessing_cache.load_or_build(config).data
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocks = negative_sampling.eval_blocks(data, 999, seed, pool)
    events = replay_events.load_events(ratings_path, movielens.DAT_FORMAT)
    held_out = data.user_ids.astype(np.int64) * 10**7 + data.item_ids[data.eval_items]
    keep = ~np.isin(events[:, 0] * 10**7 + events[:, 1], held_out)
    return config, data, blocks, events[keep]


def _trees() -> dict[str, str]:
    """Checkout name -> root, the given ones first (the baseline), then this one."""
    trees = {}
    for item in FLAGS.trees:
        name, _, path = item.partition("=")
        if not path or name == THIS_TREE or not os.path.isdir(os.path.join(path, "recommendation")):
            sys.exit(
                f"error: --trees wants NAME=PATH of a checkout (name not {THIS_TREE!r}): {item}"
            )
        trees[name] = os.path.abspath(path)
    trees[THIS_TREE] = ROOT
    return trees


def _redis(redis_url: str, stream: str) -> str:
    """The trainer's source flags for `stream` of the Redis at `redis_url`."""
    return f"--redis_url={redis_url} --stream={stream}"


def _start_broker() -> tansu_broker.TansuBroker:
    try:
        return tansu_broker.start_broker()
    except tansu_broker.BrokerMissing as missing:
        sys.exit(f"error: --sources kafka needs a broker: {missing}")


def _kafka(broker: tansu_broker.TansuBroker, events: np.ndarray) -> tuple[str, float]:
    """`events` published to topic ``train`` of `broker` (--kafka_partitions, keyed by
    user): the trainer's source flags, and the publication's events/s (unpaced, every
    delivery confirmed)."""
    access = kafka_connection.resolve(KafkaOptions(servers=broker.servers), environ={})
    replay_events.ensure_topic(access, "train", FLAGS.kafka_partitions)
    start = time.perf_counter()
    replay_events.replay(replay_events.KafkaPublisher(access, "train"), events, 0, chunk=5000)
    rate = len(events) / (time.perf_counter() - start)
    return f"--kafka_servers={broker.servers} --kafka_topic=train", rate


def _trainer(
    source: str, group: str, work_dir: str, *extra: str, tree: str = ROOT
) -> subprocess.Popen:
    """``online_main`` of the checkout at `tree` (its own modules first on the path),
    reading `source`: ``--redis_url=... --stream=...``, ``--kafka_servers=...
    --kafka_topic=...`` or ``--events_dir=...``."""
    folder = os.path.join(work_dir, group)
    log = open(os.path.join(work_dir, f"{group}.log"), "w")
    environment = {**os.environ, "PYTHONPATH": tree}
    reading = [f"--events_dir={source}"] if os.path.isdir(source) else source.split()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recommendation.online_main",
            *reading,
            f"--group={group}",
            f"--model_dir={folder}/model",
            f"--summary_file={folder}/summary.json",
            "--log_every_secs=0.5",  # a few reports in a 2 s window
            f"--seed={FLAGS.seed}",
            *extra,
        ],
        cwd=tree,
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _summary(work_dir: str, group: str) -> dict:
    with open(os.path.join(work_dir, group, "summary.json")) as summary:
        return json.load(summary)


def _throughput_runs() -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, tree root, more flags) of each throughput run: every checkout at every
    --boost_levels, then this one's --variant runs at O1."""
    runs = [
        (f"{tree}: boost {level}", root, (f"--boost_level={level}",))
        for tree, root in _trees().items()
        for level in FLAGS.boost_levels
    ]
    for variant in FLAGS.variant:
        name, _, more = variant.partition(":")
        runs.append((f"{THIS_TREE} {name}: boost O1", ROOT, ("--boost_level=O1", *more.split())))
    return runs


def _throughput(sources: dict[str, str], work_dir: str, events: int) -> dict:
    """Sustained events/s by (source, run) (`_throughput_runs`): they take turns,
    --repeats rounds, so that a change in the machine's load falls on all of them
    alike."""
    runs = [(source, *run) for source in sources for run in _throughput_runs()]
    rates: dict[tuple[str, str], list[float]] = {(run[0], run[1]): [] for run in runs}
    loads: dict[tuple[str, str], list[str]] = {key: [] for key in rates}
    for round_index in range(FLAGS.repeats):
        for number, (source, name, root, more) in enumerate(runs):
            group = f"throughput-{number}-{round_index}"
            loads[source, name].append(online_runs.load_average())
            process = _trainer(
                sources[source],
                group,
                work_dir,
                *more,
                f"--max_events={events}",
                "--idle_timeout_secs=5",
                tree=root,
            )
            process.wait()
            rates[source, name].append(sustained_events_per_second(_summary(work_dir, group)))
            logging.info("%s, %s: %.0f events/s", source, name, rates[source, name][-1])
    return {
        key: {
            "events": events,
            "rate": float(np.mean(rates[key])),
            "runs": rates[key],
            "load": loads[key][0],
        }
        for key in rates
    }


def _tf_config(spec: dict, kind: str, index: int) -> str:
    return json.dumps({"cluster": spec, "task": {"type": kind, "index": index}})


def _peak_rss_mb(pid: int) -> float:
    """A live process's peak resident memory (VmHWM), MB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _cluster_run(
    redis_url: str,
    work_dir: str,
    group: str,
    events: int,
    workers: int,
    ps: int,
    stream: str = "train",
    extra: tuple[str, ...] = (),
) -> tuple[dict, list[float]]:
    """One trainer on a fresh loopback cluster of `ps` ps tasks and `workers` workers
    (``online_main --serve_as``), or alone when `workers` is 0: its summary, and each
    ps task's peak RSS in MB at its end."""
    addresses = [f"localhost:{online_runs.free_port()}" for _ in range(1 + ps + workers)]
    spec = {"chief": addresses[:1], "ps": addresses[1 : 1 + ps], "worker": addresses[1 + ps :]}
    servers = []
    environment = dict(os.environ)
    if workers:
        for kind in ("ps", "worker"):
            for index in range(len(spec[kind])):
                log = open(os.path.join(work_dir, f"{group}-{kind}{index}.log"), "w")
                servers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "recommendation.online_main", f"--serve_as={kind}"],
                        cwd=ROOT,
                        env={**environment, "TF_CONFIG": _tf_config(spec, kind, index)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        os.environ["TF_CONFIG"] = _tf_config(spec, "chief", 0)
    try:
        process = _trainer(
            _redis(redis_url, stream),
            group,
            work_dir,
            f"--max_events={events}",
            f"--batch_size={FLAGS.cluster_batch_size}",
            "--idle_timeout_secs=5",
            *extra,
        )
    finally:
        os.environ.pop("TF_CONFIG", None)
    process.wait()
    peaks = [_peak_rss_mb(server.pid) for server in servers[:ps] if workers]
    for server in servers:
        server.kill()
        server.wait()
    if process.returncode:
        sys.exit(f"error: the {group} trainer failed: see {work_dir}/{group}.log")
    return _summary(work_dir, group), peaks


def _cluster_runs(redis_url: str, work_dir: str, events: int) -> dict[int, list[dict]]:
    """Summaries of the one-process trainer (0 workers) and of the cluster with each
    of --cluster_workers workers, taking turns for --repeats rounds."""
    counts = [0, *(int(count) for count in FLAGS.cluster_workers)]
    runs: dict[int, list[dict]] = {count: [] for count in counts}
    for round_index in range(FLAGS.repeats):
        for count in counts:
            group = f"cluster-{count}-{round_index}"
            runs[count].append(
                _cluster_run(redis_url, work_dir, group, events, count, FLAGS.cluster_ps)[0]
            )
            logging.info(
                "%d workers: %.0f events/s", count, sustained_events_per_second(runs[count][-1])
            )
    return runs


def _capacity_runs(redis_url: str, work_dir: str, events: np.ndarray) -> dict[int, tuple]:
    """--capacity_ids events of as many new users, trained on clusters of each of
    --capacity_ps ps tasks (one worker): by ps count, the summary and each ps task's
    peak RSS in MB."""
    rows = online_runs.new_user_events(events, FLAGS.capacity_ids, FLAGS.seed)
    publisher = replay_events.RedisPublisher(online_runs.redis_client(redis_url), "capacity")
    replay_events.replay(publisher, rows, rate=0, chunk=5000)
    capacity = 1 << (FLAGS.capacity_ids + online_runs.ML_1M_USERS).bit_length()
    runs = {}
    for count in (int(value) for value in FLAGS.capacity_ps):
        runs[count] = _cluster_run(
            redis_url,
            work_dir,
            f"capacity-{count}",
            FLAGS.capacity_ids,
            1,
            count,
            stream="capacity",
            extra=(f"--user_capacity={capacity}",),
        )
        logging.info("%d ps tasks: peak RSS %s MB", count, runs[count][1])
    return runs


def _print_capacity(runs: dict[int, tuple]) -> None:
    width = OnlineConfig().model.mf_dim + OnlineConfig().model.layers[0] // 2
    print(
        f"capacity: {FLAGS.capacity_ids:,} new users on clusters of 1 worker and N ps "
        f"tasks; a row and its Adam moments take {12 * width} bytes (width {width})"
    )
    print("ps tasks | user rows per ps task | their bytes, MB each | peak RSS per ps, MB")
    print("---------+-----------------------+----------------------+--------------------")
    for count, (summary, peaks) in runs.items():
        users = summary["cluster"]["rows_per_ps"]["user"]
        held = " / ".join(f"{rows:,}" for rows in users)
        sizes = " / ".join(f"{rows * 12 * width / 2**20:.0f}" for rows in users)
        print(f"{count:8} | {held:21} | {sizes:20} | {' / '.join(f'{p:,.0f}' for p in peaks)}")
    print()


def _print_cluster(runs: dict[int, list[dict]]) -> None:
    base = float(np.mean([sustained_events_per_second(summary) for summary in runs[0]]))
    print(
        f"cluster on loopback: {FLAGS.cluster_ps} ps tasks, events/s sustained (mean of "
        f"{FLAGS.repeats} interleaved runs), the coordinator's ms per step"
    )
    print(
        "trainer                   | events/s | vs one process | resolve | schedule | "
        "wait | rest | rows per ps task (users; items)"
    )
    print("-" * 26 + "+----------+----------------+---------+----------+------+------+" + "-" * 32)
    for count, summaries in runs.items():
        rate = float(np.mean([sustained_events_per_second(summary) for summary in summaries]))
        label = "one process (O1)" if count == 0 else f"{count} worker(s)"
        parts = "       - |        - |    - |    - | -"
        if count:
            ms = {
                key: float(np.mean([run["cluster"]["ms_per_step"][key] for run in summaries]))
                for key in ("resolve", "schedule", "wait")
            }
            rest = 1e3 * FLAGS.cluster_batch_size / rate - sum(ms.values())
            rows = summaries[-1]["cluster"]["rows_per_ps"]
            shards = "; ".join(" / ".join(f"{n:,}" for n in rows[t]) for t in ("user", "item"))
            parts = (
                f"{ms['resolve']:7.1f} | {ms['schedule']:8.1f} | {ms['wait']:4.1f} | "
                f"{rest:4.1f} | {shards}"
            )
        print(f"{label:25} | {rate:8,.0f} | {rate / base:13.2f}x | {parts}")
    print()


def _full_pass(redis_url: str, work_dir: str) -> tuple[dict, str, str]:
    load = online_runs.load_average()
    export_dir = os.path.join(work_dir, "full", "export")
    process = _trainer(
        _redis(redis_url, "train"),
        "full",
        work_dir,
        f"--export_dir={export_dir}",
        "--idle_timeout_secs=5",
    )
    process.wait()
    return _summary(work_dir, "full"), versioned_export.latest_export(export_dir), load


def _hit_rate(export_dir: str, data, blocks) -> float:
    """HR@10 of an export on the evaluation blocks (raw ids, 999 negatives + held-out)."""
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    users = np.repeat(data.user_ids[blocks.users].astype(np.int64), blocks.block_size)
    items = data.item_ids[blocks.items.reshape(-1)].astype(np.int64)
    scores = np.concatenate(
        [
            serve(user_id=users[i : i + 200_000], item_id=items[i : i + 200_000])["scores"].numpy()
            for i in range(0, len(users), 200_000)
        ]
    )
    hits, _ = neumf_model.compute_hr_ndcg(
        scores.reshape(-1, blocks.block_size), tf.constant(blocks.duplicate_mask), 10
    )
    return float(tf.reduce_mean(hits))


class _ExportWatcher(threading.Thread):
    """Notes when each export version appears and the stream position it holds."""

    def __init__(self, export_dir: str) -> None:
        super().__init__(daemon=True)
        self.export_dir, self.seen, self.stop = export_dir, [], threading.Event()

    def run(self) -> None:
        known = set()
        while not self.stop.is_set():
            for version in versioned_export.versions(self.export_dir):
                if version not in known:
                    known.add(version)
                    path = os.path.join(self.export_dir, str(version))
                    try:
                        position = versioned_export.read_info(path)["position"]
                    except (tf.errors.NotFoundError, FileNotFoundError):
                        continue  # already replaced by a newer one
                    self.seen.append((time.time(), position))
            time.sleep(0.02)


def _check_capacity() -> None:
    """Exits unless the freshness run's user table holds --live_ids and ML-1M's users
    (a full table would refuse or evict them, and the run would not hold them live)."""
    if not FLAGS.live_ids and FLAGS.capacity is None:
        return
    capacity = FLAGS.capacity or OnlineConfig().model.user_capacity
    needed = FLAGS.live_ids + online_runs.ML_1M_USERS
    if capacity < needed:
        given = "--capacity" if FLAGS.capacity is not None else "the trainer's default capacity"
        sys.exit(
            f"error: --live_ids {FLAGS.live_ids:,} and ML-1M's {online_runs.ML_1M_USERS:,} "
            f"users need {needed:,} user rows, {given} is {capacity:,}: raise --capacity to "
            f"{needed:,} or more"
        )


class _LiveRedis:
    """The freshness run's events in Redis stream ``live``: the trainer's flags, how many
    warm-up events an export's position covers, and when the first event after a
    position was published (its entry id's milliseconds: the server's clock at XADD)."""

    def __init__(self, redis_url: str) -> None:
        self.client = online_runs.redis_client(redis_url)
        self.publisher = replay_events.RedisPublisher(self.client, "live")
        self.flags = _redis(redis_url, "live")
        self.name = "redis"
        # After each chunk of the warm-up: the last entry id, and the events published.
        self._last_ids: list[tuple[int, int]] = []
        self._published: list[int] = []

    def publish_warm_up(self, rows: np.ndarray) -> None:
        """Publishes `rows` unpaced, noting the last entry id after each chunk."""

        def mark(published: int) -> None:
            last_id = self.client.xrevrange("live", count=1)[0][0]
            self._last_ids.append(redis_entries.stream_id(last_id))
            self._published.append(published)

        replay_events.replay(self.publisher, rows, rate=0, chunk=2000, on_chunk=mark)

    def covered(self, position) -> int:
        entry_id = redis_entries.redis_entry_id(position)
        if not entry_id:
            return 0
        index = bisect.bisect_right(self._last_ids, redis_entries.stream_id(entry_id))
        return self._published[index - 1] if index else 0

    def key(self, position):
        return redis_entries.redis_entry_id(position)

    def first_published_ms(self, previous, position) -> int:
        del position  # the stream's order is the publication's
        first_new = self.client.xrange("live", min=f"({self.key(previous)}", count=1)
        return redis_entries.stream_id(first_new[0][0])[0]


class _LiveKafka:
    """The freshness run's events in Kafka topic ``live`` (--kafka_partitions, keyed by
    user, empty at the start): an export's position covers the sum of its offsets, and
    the first event after a position was published at its message's timestamp (the
    producer's clock at produce)."""

    def __init__(self, broker: tansu_broker.TansuBroker) -> None:
        self.access = kafka_connection.resolve(KafkaOptions(servers=broker.servers), environ={})
        replay_events.ensure_topic(self.access, "live", FLAGS.kafka_partitions)
        self.publisher = replay_events.KafkaPublisher(self.access, "live")
        self.flags = f"--kafka_servers={broker.servers} --kafka_topic=live"
        self.name = "kafka"

    def publish_warm_up(self, rows: np.ndarray) -> None:
        replay_events.replay(self.publisher, rows, rate=0, chunk=5000)

    def covered(self, position) -> int:
        return sum(position["offsets"].values())

    def key(self, position):
        return tuple(sorted(position["offsets"].items()))

    def first_published_ms(self, previous, position) -> int:
        """The earliest timestamp of the first message after `previous` in each partition
        that `position` moved on."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(self.access.settings(**{"group.id": "freshness"}))
        times = []
        try:
            for partition, offset in position["offsets"].items():
                start = previous["offsets"].get(partition, 0)
                if offset > start:
                    consumer.assign([TopicPartition("live", int(partition), start)])
                    message = consumer.consume(1, 10)[0]
                    times.append(message.timestamp()[1])
        finally:
            consumer.close()
        return min(times)


def _wait_for_warm_up(
    process: subprocess.Popen,
    watcher: _ExportWatcher,
    live: _LiveRedis | _LiveKafka,
    total: int,
    whole: bool,
    log_path: str,
) -> float:
    """Seconds until an export holds the whole warm-up of `total` events (`whole`; else
    until the first export). Exits with an error if the trainer stops first or its
    exports make no progress for WARM_UP_STALL_SECONDS."""
    start = last_change = last_report = time.monotonic()
    last_position = None
    while True:
        position = live.key(watcher.seen[-1][1]) if watcher.seen else None
        done = live.covered(watcher.seen[-1][1]) if watcher.seen else 0
        if watcher.seen and (not whole or done == total):
            return time.monotonic() - start
        now = time.monotonic()
        if process.poll() is not None:
            sys.exit(
                f"error: the freshness trainer exited (code {process.returncode}) after "
                f"{now - start:.0f} s, with {done:,} of the {total:,} warm-up events in an "
                f"export: see its log {log_path}"
            )
        if position != last_position:  # it trained more
            last_position, last_change = position, now
        elif now - last_change > WARM_UP_STALL_SECONDS:
            process.kill()
            process.wait()
            sys.exit(
                f"error: the freshness trainer's exports made no progress for "
                f"{WARM_UP_STALL_SECONDS} s ({done:,} of the {total:,} warm-up events in "
                f"one after {now - start:.0f} s); stopped it: see its log {log_path}"
            )
        if now - last_report >= PROGRESS_SECONDS:
            last_report = now
            logging.info(
                "warm-up: %s of %s events in an export after %.0f s (%s exports)",
                f"{done:,}",
                f"{total:,}",
                now - start,
                len(watcher.seen),
            )
        time.sleep(0.1)


def _freshness(live: _LiveRedis | _LiveKafka, work_dir: str, events: np.ndarray) -> dict:
    """Replays at --live_rate into `live` and measures publication-to-export times,
    after a warm-up of --live_ids new users (none: ML-1M's first events only)."""
    warm_up = 5000
    rows = np.concatenate(
        [online_runs.new_user_events(events, FLAGS.live_ids, FLAGS.seed), events[:warm_up]]
    )
    start = time.perf_counter()
    live.publish_warm_up(rows)
    logging.info(
        "warm-up: published %s events in %.1f s", f"{len(rows):,}", time.perf_counter() - start
    )
    group = f"live-{live.name}"
    export_dir = os.path.join(work_dir, group, "export")
    watcher = _ExportWatcher(export_dir)
    watcher.start()
    capacity = (
        [f"--user_capacity={FLAGS.capacity}", f"--item_capacity={FLAGS.capacity}"]
        if FLAGS.capacity is not None
        else []
    )
    process = _trainer(
        live.flags,
        group,
        work_dir,
        f"--export_dir={export_dir}",
        f"--export_every_secs={EXPORT_SECONDS}",
        "--publish_every_secs=0",
        *capacity,
    )
    try:
        # started, traced, the warm-up trained (or, without live ids, a first export)
        warm_up_seconds = _wait_for_warm_up(
            process,
            watcher,
            live,
            len(rows),
            FLAGS.live_ids > 0,
            os.path.join(work_dir, f"{group}.log"),
        )
        load = online_runs.load_average()
        count = int(FLAGS.live_rate * FLAGS.live_seconds)
        live_start_ms = time.time() * 1000
        seconds = replay_events.replay(
            live.publisher, events[warm_up : warm_up + count], FLAGS.live_rate, chunk=500
        )
        time.sleep(6)  # let the last events reach an export
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # finishes the step, checkpoints, exits
        process.wait()
        watcher.stop.set()
        watcher.join()
    delays, seen = [], []
    for (_, previous), (seen_at, position) in zip(watcher.seen, watcher.seen[1:], strict=False):
        if not live.key(previous) or live.key(position) == live.key(previous):
            continue
        published_ms = live.first_published_ms(previous, position)
        if published_ms >= live_start_ms:
            delays.append(seen_at - published_ms / 1000)
            seen.append(seen_at - live_start_ms / 1000)
    summary = _summary(work_dir, group)
    return {
        "source": live.name,
        "delays": np.array(delays),
        "seen": np.array(seen),  # each delay's export, seconds after the replay began
        "rate": count / seconds,
        "load": load,
        "stopped_by": summary["stopped_by"],
        "tables": summary["tables"],
        "export_seconds": summary["export_seconds"],
        "checkpoint": _checkpoint_seconds(summary),
        "warm_up": (FLAGS.live_ids, warm_up_seconds),
    }


def _offline(config: DataConfig, work_dir: str) -> tuple[float, float, str]:
    load = online_runs.load_average()
    start = time.perf_counter()
    # The online trainer's defaults: its network is ncf-main's default NeuMF, and each
    # step of batch_size events trains on every event and its num_neg negatives.
    online = OnlineConfig()
    summary = cycles.run(
        NcfConfig(
            data=config,
            model_dir=os.path.join(work_dir, "offline"),
            train_epochs=FLAGS.offline_epochs,
            batch_size=online.batch_size * (1 + online.model.num_neg),
            num_eval_negatives=999,
            seed=FLAGS.seed,
        )
    ).summary
    return summary["best_hr"], time.perf_counter() - start, load


def _baseline_run() -> str:
    """The ratios' baseline run (`_throughput_runs`): with --trees the first checkout
    at O1 (else its first level), without them this checkout at O0 (else its first)."""
    tree = next(iter(_trees()))
    level = "O0" if not FLAGS.trees else "O1"
    level = level if level in FLAGS.boost_levels else FLAGS.boost_levels[0]
    return f"{tree}: boost {level}"


def _print_throughput(throughput: dict, full) -> None:
    base_run = _baseline_run()
    print(
        f"sustained events/s (mean of {FLAGS.repeats} interleaved runs each, runs in "
        f"brackets); ratios to '{base_run}' reading the same source"
    )
    print(
        "run                                  |    events | sustained events/s |     ratio | load"
    )
    print(
        "-------------------------------------+-----------+--------------------+-----------+-----"
    )
    rows = [((source, name), r) for (source, name), r in throughput.items()]
    if full is not None:
        summary, _, load = full
        rate = sustained_events_per_second(summary)
        full_row = {"events": summary["events"], "rate": rate, "load": load}
        rows.append((("redis", "full pass, defaults (O1)"), full_row))
    for (source, name), r in rows:
        base = throughput.get((source, base_run), {}).get("rate")
        ratio = f"{r['rate'] / base:8.2f}x" if base else "        -"
        runs = " (" + ", ".join(f"{x:,.0f}" for x in r["runs"]) + ")" if "runs" in r else ""
        label = f"{source} {name}"
        print(f"{label:36} | {r['events']:9,} | {r['rate']:18,.0f} | {ratio} | {r['load']}{runs}")
    for (source, name), r in throughput.items():
        redis_rate = throughput.get(("redis", name), {}).get("rate")
        if source != "redis" and redis_rate:
            print(f"{source} / redis, {name}: {r['rate'] / redis_rate:.2f}x")
    print()


def _seconds(value: float | None) -> str:
    """Mean seconds of a write, or "-" where the run made none."""
    return "-" if value is None else f"{value:.2f} s"


def _checkpoint_seconds(summary: dict) -> str:
    """Mean seconds of a full checkpoint and of a delta, with their counts."""
    return ", ".join(
        f"{kind} {_seconds(made['seconds'])} ({made['count']})"
        for kind, made in summary["checkpoints"].items()
    )


def _print_freshness(fresh: dict) -> None:
    delays, tables = fresh["delays"], fresh["tables"]
    print(
        f"freshness from {fresh['source']}: replay at {fresh['rate']:,.0f} events/s, "
        f"whole versions every {EXPORT_SECONDS} s, no publications "
        f"(load average {fresh['load']}), stopped by {fresh['stopped_by']}"
    )
    new_users, warm_up_seconds = fresh["warm_up"]
    warm_up = (
        f"; {new_users:,} new users trained first ({warm_up_seconds:.0f} s)" if new_users else ""
    )
    print(
        f"  {tables['user']['ids'] + tables['item']['ids']:,} live ids at the end "
        f"(users {tables['user']['ids']:,} of {tables['user']['capacity']:,}, items "
        f"{tables['item']['ids']:,} of {tables['item']['capacity']:,}); mean export "
        f"{_seconds(fresh['export_seconds'])}, mean checkpoint "
        f"{fresh['checkpoint']}{warm_up}"
    )
    if len(delays):
        print(
            f"  {len(delays)} exports: publication -> export p50 {np.median(delays):.2f} s, "
            f"p90 {np.percentile(delays, 90):.2f} s, max {float(delays.max()):.2f} s\n"
        )


def _plot_freshness(fresh: dict, plot_dir: str, cpu: str) -> str:
    """``freshness.png`` (from Redis; ``freshness-kafka.png`` from Kafka): each export's
    publication-to-export delay at the time it appeared, the export period dashed;
    `cpu`, the machine line, under it."""
    live = f", {fresh['warm_up'][0]:,} new users trained first" if fresh["warm_up"][0] else ""
    name = "freshness.png" if fresh["source"] == "redis" else f"freshness-{fresh['source']}.png"
    return plots.line_chart(
        os.path.join(plot_dir, name),
        f"Freshness from {fresh['source'].capitalize()}: replay at {fresh['rate']:,.0f} "
        f"events/s{live}",
        "export seen, s after the replay began",
        "publication to export, s",
        {"each export": (fresh["seen"], fresh["delays"])},
        f"{cpu}; load average {fresh['load']}",
        threshold=(f"export period ({EXPORT_SECONDS} s)", float(EXPORT_SECONDS)),
        y_from_zero=True,
    )


def _print_accuracy(full, full_hr: float, offline) -> None:
    results = full[0]["prequential"]
    print(
        f"prequential HR@10 (recommendation/online/prequential.py: 1 event in "
        f"{results['every']}, {results['negatives']} negatives), full pass, by window:"
    )
    print(" from event | scored | HR@10  | NDCG@10 | AUC")
    for window in results["windows"]:
        print(
            f"{window['start']:11,} | {window['scored']:6,} | {window['hr']:.4f} | "
            f"{window['ndcg']:.4f}  | {window['auc']:.4f}"
        )
    for cohort in ("all", "cold", "warm"):
        numbers = results[cohort]
        print(
            f"{cohort:>4} ({numbers['scored']:,} scored): HR@10 {numbers['hr']:.4f}, "
            f"NDCG@10 {numbers['ndcg']:.4f}, AUC {numbers['auc']:.4f}"
        )
    print()

    print("final HR@10, 999 negatives, last interaction per user:")
    print(f"  online, one pass (final export)         {full_hr:.4f}")
    if offline is not None:
        hr, seconds, load = offline
        print(
            f"  offline, {FLAGS.offline_epochs} epoch(s), same network   {hr:.4f} "
            f"({seconds:.0f} s, load average {load})"
        )
        print(f"  ratio online / offline                  {full_hr / hr:.2f}")


def main(argv: list[str]) -> None:
    del argv
    parts = {"throughput", "full_pass", "freshness", "offline", "cluster", "capacity"}
    unknown = set(FLAGS.parts) - parts
    if unknown:
        sys.exit(f"error: unknown --parts {sorted(unknown)}")
    unknown = set(FLAGS.sources) - {"redis", "kafka", "folder"}
    if unknown:
        sys.exit(f"error: unknown --sources {sorted(unknown)}: redis, kafka or folder")
    _trees()  # checks --trees before anything runs
    _check_capacity()
    if FLAGS.plot_dir:
        plots.require(FLAGS.plot_dir)
    work_dir = FLAGS.work_dir or tempfile.mkdtemp(prefix="ncf-online-bench-")
    os.makedirs(work_dir, exist_ok=True)
    print(f"start: load average {online_runs.load_average()}")
    cpu = machine.cpu_line()
    print(cpu)
    config, data, blocks, train_events = _split(FLAGS.ratings, work_dir, FLAGS.seed)
    server, redis_url = online_runs.start_redis(work_dir)
    throughput, full, full_hr, fresh, clustered, capacity = {}, None, None, [], None, None
    broker = _start_broker() if "kafka" in FLAGS.sources else None
    published = {}
    try:
        start = time.perf_counter()
        replay_events.replay(
            replay_events.RedisPublisher(online_runs.redis_client(redis_url), "train"),
            train_events,
            rate=0,
            chunk=5000,
        )
        published["unpaced XADD, pipelined"] = len(train_events) / (time.perf_counter() - start)
        if "throughput" in FLAGS.parts:
            sources = {"redis": _redis(redis_url, "train")}
            if "kafka" in FLAGS.sources:
                sources["kafka"], rate = _kafka(broker, train_events)
                published[f"Kafka, unpaced, {FLAGS.kafka_partitions} partition(s)"] = rate
            if "folder" in FLAGS.sources:
                events_dir = os.path.join(work_dir, "events")
                replay_events.replay(replay_events.DirectoryPublisher(events_dir), train_events, 0)
                sources["folder"] = events_dir
            sources = {source: sources[source] for source in FLAGS.sources}
            throughput = _throughput(sources, work_dir, FLAGS.throughput_events)
        if "full_pass" in FLAGS.parts:
            full = _full_pass(redis_url, work_dir)
            full_hr = _hit_rate(full[1], data, blocks)
        if "freshness" in FLAGS.parts:
            # From each stream among --sources (Redis where there is none).
            streams = [source for source in FLAGS.sources if source != "folder"] or ["redis"]
            for source in streams:
                live = _LiveRedis(redis_url) if source == "redis" else _LiveKafka(broker)
                fresh.append(_freshness(live, work_dir, train_events))
        if "cluster" in FLAGS.parts:
            clustered = _cluster_runs(redis_url, work_dir, FLAGS.cluster_events)
        if "capacity" in FLAGS.parts:
            capacity = _capacity_runs(redis_url, work_dir, train_events)
    finally:
        server.terminate()
        server.wait()
        if broker is not None:
            broker.kill()
    # The offline baseline is a ratio to the full pass's export: measured with it only.
    wanted = "offline" in FLAGS.parts and FLAGS.offline_epochs and full is not None
    offline = _offline(config, work_dir) if wanted else None
    print(
        f"\nOnline training benchmark: ML-1M, {len(train_events):,} training events "
        f"({data.num_users:,} users, {data.num_items:,} items), one evaluation hold-out per user"
    )
    for how, rate in published.items():
        print(f"publication ({how}): {rate:,.0f} events/s")
    print()
    if throughput or full is not None:
        _print_throughput(throughput, full)
    for run in fresh:
        _print_freshness(run)
        if FLAGS.plot_dir:
            _plot_freshness(run, FLAGS.plot_dir, cpu)
    if clustered is not None:
        _print_cluster(clustered)
    if capacity is not None:
        _print_capacity(capacity)
    if full is not None:
        _print_accuracy(full, full_hr, offline)
    print(f"end: load average {online_runs.load_average()}")


if __name__ == "__main__":
    app.run(main)
