"""online_main end to end on a real redis-server: kill -9 and restart, a Redis restart,
dead letters, exports polled while written, bad flags."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis
import tensorflow as tf
from absl import flags as absl_flags
from conftest import damage_checkpoint

from official.core import writer_lease
from official.utils.flags import core
from recommendation import online_main
from recommendation.online import callbacks, online_ncf, run_summary
from recommendation.online.state import serving_export, versioned_export
from recommendation.online_main import OnlineConfig
from recommendation.training import ncf_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64
CHECKPOINT_STEPS = 10
# A tiny model: the tests are about the loop, not the accuracy.
MODEL = online_ncf.OnlineParams(
    mf_dim=4,
    layers=(8, 4),
    mlp_regularization=(0.0, 0.0),
    user_capacity=512,
    item_capacity=256,
)
MODEL_FLAGS = [
    "--num_factors=4",
    "--layers=8,4",
    "--user_capacity=512",
    "--item_capacity=256",
    "--prequential_negatives=9",
    f"--batch_size={BATCH}",
    "--sink_size=1",
    "--log_every_secs=1",
    "--seed=1",
]


def _events(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 300, count)
    return np.stack([users, users % 40 + rng.integers(0, 20, count), np.arange(count)], axis=1)


class _Publisher(threading.Thread):
    """Publishes events at `rate` per second in chunks, retrying a chunk while Redis is
    down (a retried chunk may land twice: every entry in the stream counts)."""

    def __init__(self, server, events: np.ndarray, rate: float, chunk: int = 50) -> None:
        super().__init__(daemon=True)
        self.server, self.events, self.rate, self.chunk = server, events, rate, chunk

    def run(self) -> None:
        client, start = self.server.client(), time.monotonic()
        for offset in range(0, len(self.events), self.chunk):
            time.sleep(max(0.0, start + offset / self.rate - time.monotonic()))
            while True:
                try:
                    pipe = client.pipeline(transaction=False)
                    for user, item, stamp in self.events[offset : offset + self.chunk].tolist():
                        pipe.xadd("events", {"user": user, "item": item, "timestamp": stamp})
                    pipe.execute()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)
                    client = self.server.client()


def _start(
    tmp_path, name: str, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Starts the trainer with `flags` (its environment: this one, or `env`)."""
    out = str(tmp_path / f"{name}.out")
    with open(out, "w") as stdout, open(str(tmp_path / f"{name}.err"), "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "recommendation.online_main", *MODEL_FLAGS, *flags],
            cwd=ROOT,
            env={**(os.environ if env is None else env), "PYTHONPATH": ROOT},
            stdout=stdout,
            stderr=stderr,
        )
    return process, out


def _finish(process: subprocess.Popen, out: str, tmp_path, name: str, timeout=240) -> str:
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    text = open(out).read()
    assert process.returncode == 0, text + open(str(tmp_path / f"{name}.err")).read()[-3000:]
    return text


def _wait_for(condition, timeout: float = 180, what: str = "", process=None) -> None:
    """Waits for `condition`; fails at once if `process` (the trainer) dies first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process is None or process.poll() is None, f"the trainer died before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _lines(path) -> list[str]:
    return open(path).read().split() if os.path.exists(path) else []


def _kill_after_a_checkpoint(process, audit, model_dir, events: int) -> None:
    """SIGKILLs the trainer `process` once its trained-events log `audit` holds `events`
    and `model_dir` a checkpoint: a kill in the middle of a stream."""
    _wait_for(
        lambda: len(_lines(audit)) >= events and tf.train.latest_checkpoint(str(model_dir)),
        what="training and a checkpoint",
        process=process,
    )
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def _stream_ids(client) -> list[str]:
    return [entry_id.decode() for entry_id, _ in client.xrange("events")]


def _checkpoint_state(model_dir) -> tuple[str, int, str, dict]:
    """What a restart restores from `model_dir` (the full checkpoint and its deltas),
    read by a fresh model in this process: the last checkpoint applied, its step, the
    table digest and the stream position."""
    rec_model = online_ncf.build_rec_model(MODEL)
    checkpoint = callbacks.CheckpointCallback(str(model_dir), every_steps=1)
    checkpoint.set_rec_model(rec_model)
    checkpoint.on_train_begin()
    step, digest = int(rec_model.step.numpy()), callbacks.table_digest(rec_model.network)
    return checkpoint.restored_from, step, digest, rec_model.position


def _entry_key(entry_id: str) -> tuple[int, int]:
    milliseconds, sequence = entry_id.split("-")
    return int(milliseconds), int(sequence)


def _summary_step(text: str) -> int:
    return int(re.search(r"step (\d+), prequential", text).group(1))


def test_kill_9_and_restart_trains_every_event_after_the_checkpoint_again(redis_server, tmp_path):
    model_dir = tmp_path / "model"
    first_audit, second_audit = tmp_path / "first.txt", tmp_path / "second.txt"
    flags = [
        f"--redis_url={redis_server.url}",
        f"--model_dir={model_dir}",
        f"--checkpoint_every_steps={CHECKPOINT_STEPS}",
        "--checkpoint_every_secs=600",
    ]
    client = redis_server.client()
    client.xadd("events", {"user": 1, "item": 2})  # dead-lettered by the first process
    publisher = _Publisher(redis_server, _events(4000, seed=0), rate=1500)
    publisher.start()
    first, _ = _start(tmp_path, "first", *flags, f"--trained_events_log={first_audit}")
    _kill_after_a_checkpoint(first, first_audit, model_dir, 1500)
    checkpoint, step, digest, position = _checkpoint_state(model_dir)
    # A full checkpoint every 10 (the default), one every 10 steps, and at least 23
    # steps trained: it restores deltas.
    assert os.path.basename(checkpoint).startswith("delta-"), checkpoint
    publisher.join()
    for bad in (
        {"json": "{oops"},
        {"user": 1, "item": 2},
        {"user": "u1", "item": 2, "timestamp": 3},
    ):
        client.xadd("events", bad)
    _Publisher(redis_server, _events(1000, seed=1), rate=1e6).run()

    second, out = _start(
        tmp_path, "second", *flags, f"--trained_events_log={second_audit}", "--idle_timeout_secs=3"
    )
    text = _finish(second, out, tmp_path, "second")

    restored = re.search(r"restored (\S+): step=(\d+) users=\d+ items=\d+ tables=(\w+)", text)
    assert restored, text
    assert restored.group(1) == checkpoint and int(restored.group(2)) == step
    assert restored.group(3) == digest  # the same hash-table contents
    first_trained = _lines(first_audit)
    # Checkpoints every 10 steps of one step a sink, so at a multiple of 10; a delta
    # follows a full one, so at 20 or later: true wherever the kill (timing) lands.
    assert step % CHECKPOINT_STEPS == 0 and step >= 2 * CHECKPOINT_STEPS, step
    assert len(first_trained) < 4000  # it was killed in the middle
    dead = {fields[b"id"].decode() for _, fields in client.xrange("events:dead")}
    events = [entry_id for entry_id in _stream_ids(client) if entry_id not in dead]
    after = [entry_id for entry_id in events if _entry_key(entry_id) > _entry_key(position["id"])]
    # The restarted process was handed exactly the events after its checkpoint, once
    # each; those before it were trained by the killed process, in its checkpoint.
    second_trained = _lines(second_audit)
    assert sorted(second_trained) == sorted(after) and len(set(second_trained)) == len(after)
    assert set(events) - set(after) <= set(first_trained)
    assert len(set(first_trained) & set(second_trained)) <= CHECKPOINT_STEPS * BATCH
    # One dead letter before the kill and three after: each recorded once, and the
    # summary counts all four (the first travelled in the checkpoint or was read again).
    assert "dead letters 4" in text and client.xlen("events:dead") == 4
    assert client.xpending("events", "trainer")["pending"] == 0  # all acknowledged


# Entries no example can be made of, one of each kind.
MALFORMED_ENTRIES = (
    {"user": "99999999999999999999999", "item": 1, "timestamp": 1},
    {"json": '{"user": 1, "item": 18446744073709551616, "timestamp": 1}'},
    {"json": '{"user": 1, "item": 2, "timestamp": NaN}'},
    {"user": -3, "item": 1, "timestamp": 1},
    {"user": "7" * 100_000, "item": 1, "timestamp": 1},
    {"user": b"\xff", "item": 1, "timestamp": 1},
    {"user": 1, "item": 2},
)


def test_a_crash_before_the_first_checkpoint_dead_letters_once_and_exports_above_it(
    redis_server, tmp_path
):
    client = redis_server.client()
    events = _events(600, seed=4)
    _Publisher(redis_server, events[:300], rate=1e6).run()
    bad_ids = [client.xadd("events", fields).decode() for fields in MALFORMED_ENTRIES]
    _Publisher(redis_server, events[300:], rate=1e6).run()
    model_dir, export_base = tmp_path / "model", tmp_path / "export"
    flags = [
        f"--redis_url={redis_server.url}",
        f"--model_dir={model_dir}",
        f"--export_dir={export_base}",
        "--export_every_steps=2",
        "--checkpoint_every_steps=100000",
        "--checkpoint_every_secs=600",
    ]
    first_audit = tmp_path / "first.txt"
    first, _ = _start(tmp_path, "first", *flags, f"--trained_events_log={first_audit}")
    _wait_for(
        lambda: len(_lines(first_audit)) == 600 and versioned_export.versions(str(export_base)),
        what="every event trained and an export",
        process=first,
    )
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert tf.train.latest_checkpoint(str(model_dir)) is None  # killed before any
    crashed_versions = versioned_export.versions(str(export_base))

    second, out = _start(tmp_path, "second", *flags, "--idle_timeout_secs=3")
    text = _finish(second, out, tmp_path, "second")
    assert "restored" not in text  # from nothing: every event read again
    dead = client.xrange("events:dead")
    assert [entry_id.decode() for entry_id, _ in dead] == bad_ids  # once each, by entry id
    assert [fields[b"id"].decode() for _, fields in dead] == bad_ids
    assert all(len(fields[b"payload"]) < 2000 for _, fields in dead)
    assert "dead letters 7" in text
    assert client.xpending("events", "trainer")["pending"] == 0
    # The restarted run's versions are all above the crashed run's, and the newest is
    # its final model.
    kept = versioned_export.versions(str(export_base))
    assert min(kept) > max(crashed_versions)
    newest = versioned_export.read_info(versioned_export.latest_export(str(export_base)))
    assert newest["step"] == _summary_step(text)
    assert not [name for name in os.listdir(export_base) if name.startswith(".")]
    position = newest["position"]
    assert (position["id"], position["dead_letters"]) == (_stream_ids(client)[-1], 7)

    more_bad = [client.xadd("events", fields).decode() for fields in MALFORMED_ENTRIES[:2]]
    _Publisher(redis_server, _events(100, seed=5), rate=1e6).run()
    third, out = _start(tmp_path, "third", *flags, "--idle_timeout_secs=3")
    text = _finish(third, out, tmp_path, "third")
    assert "restored" in text and "dead letters 9" in text  # the total over the runs
    assert [e.decode() for e, _ in client.xrange("events:dead")] == bad_ids + more_bad


def _write_lines(path, lines: list[str]) -> None:
    with open(path, "a") as out:
        out.writelines(line + "\n" for line in lines)


@pytest.mark.integration
def test_event_folder_lines_that_are_no_examples_are_dead_lettered_once_across_restarts(
    tmp_path,
):
    events_dir, model_dir = tmp_path / "events", tmp_path / "model"
    events_dir.mkdir()
    good = [f'{{"user": {u}, "item": {i}, "timestamp": {t}}}' for u, i, t in _events(400, 6)]
    bad = [
        '{"user": 99999999999999999999999, "item": 1, "timestamp": 1}',
        '{"user": 1, "item": 2, "timestamp": NaN}',
        '{"user": -1, "item": 2, "timestamp": 1}',
        '{"user": "' + "7" * (2 << 20) + '", "item": 1, "timestamp": 1}',  # > a 1 MiB read
        '{"user": 1, "item": 2}',
    ]
    _write_lines(events_dir / "a.jsonl", good[:200] + bad + good[200:])
    _write_lines(events_dir / "b.csv", ["1,2,3", "9223372036854775808,1,1", "4,5,6"])
    dead_file = tmp_path / "dead.jsonl"
    flags = [
        f"--events_dir={events_dir}",
        f"--model_dir={model_dir}",
        f"--dead_letter_file={dead_file}",
        "--idle_timeout_secs=3",
    ]
    first_audit, second_audit = tmp_path / "first.txt", tmp_path / "second.txt"
    first, out = _start(tmp_path, "first", *flags, f"--trained_events_log={first_audit}")
    text = _finish(first, out, tmp_path, "first")
    assert "dead letters 6" in text
    assert len(_lines(first_audit)) == len(set(_lines(first_audit))) == 402
    letters = [json.loads(line) for line in open(dead_file)]
    assert sorted(letter["id"].split(":")[0] for letter in letters) == ["a.jsonl"] * 5 + ["b.csv"]
    assert sum("longer than the 1,048,576 read at once" in x["error"] for x in letters) == 1

    _write_lines(events_dir / "a.jsonl", [bad[0], good[0]])
    _write_lines(events_dir / "b.csv", ["x,1,1"])
    second, out = _start(tmp_path, "second", *flags, f"--trained_events_log={second_audit}")
    text = _finish(second, out, tmp_path, "second")
    assert "dead letters 8" in text  # the total over both runs
    ids = [json.loads(line)["id"] for line in open(dead_file)]
    assert len(ids) == len(set(ids)) == 8
    assert len(_lines(second_audit)) == 1  # only the new good line


def _recorded(method, name: str, calls: list[str]):
    """`method`, appending `name` to `calls` each time it runs."""

    def record(self, *args):
        calls.append(name)
        return method(self, *args)

    return record


def test_the_last_metric_report_comes_before_the_checkpoint_and_export_at_the_end(
    tmp_path, monkeypatch
):
    # The last events/s a run reports (and the benchmark's window) is its training's:
    # the durable checkpoint and the export written when it stops come after the report
    # (a 49 MB durable save took up to 0.85 s in benchmark runs of about 2 s).
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    _write_lines(events_dir / "a.csv", [f"{u},{i},{t}" for u, i, t in _events(300, 7)])
    calls = []
    for kind, method in (
        (callbacks.MetricLogger, "_report"),
        (callbacks.CheckpointCallback, "act"),
        (serving_export.ExportCallback, "act"),
    ):
        monkeypatch.setattr(kind, method, _recorded(getattr(kind, method), kind.__name__, calls))
    config = OnlineConfig(
        events_dir=str(events_dir),
        model_dir=str(tmp_path / "model"),
        export_dir=str(tmp_path / "export"),
        model=MODEL,
        batch_size=BATCH,
        sink_size=1,
        log_every_secs=3600.0,
        max_events=256,
        seed=1,
    )
    summary = online_main.run(config)
    assert summary["events"] == 256
    assert calls[-3:] == ["MetricLogger", "CheckpointCallback", "ExportCallback"]


def test_redis_restart_during_training_loses_nothing(redis_server, tmp_path):
    audit = tmp_path / "trained.txt"
    publisher = _Publisher(redis_server, _events(3000, seed=2), rate=1000)
    publisher.start()
    trainer, out = _start(
        tmp_path,
        "trainer",
        f"--redis_url={redis_server.url}",
        f"--model_dir={tmp_path / 'model'}",
        f"--trained_events_log={audit}",
        "--checkpoint_every_secs=0.5",
        "--idle_timeout_secs=6",
    )
    _wait_for(lambda: len(_lines(audit)) >= 800, what="training to start")
    redis_server.kill()
    time.sleep(1.0)
    redis_server.start()
    publisher.join()
    text = _finish(trainer, out, tmp_path, "trainer")
    reconnects = int(re.search(r"reconnects (\d+)", text).group(1))
    # How many attempts failed while Redis was down is timing; each one logged its wait,
    # and one outage makes them one run of doubling waits from 0.05 s (a successful
    # read resets the backoff).
    errors = open(tmp_path / "trainer.err").read()
    retry = r"redis unavailable \(.*\); retrying in ([\d.]+) s"
    waits = [float(wait) for wait in re.findall(retry, errors)]
    assert reconnects == len(waits) >= 1
    assert waits == pytest.approx([min(2.0, 0.05 * 2**i) for i in range(reconnects)])
    trained = collections.Counter(_lines(audit))
    assert sorted(trained) == sorted(_stream_ids(redis_server.client()))  # every one, once
    assert max(trained.values()) == 1


@pytest.mark.integration
def test_exports_are_never_seen_half_written(tmp_path):
    events_dir, export_base = tmp_path / "events", tmp_path / "export"
    events_dir.mkdir()
    with open(events_dir / "a.csv", "w") as out:
        out.writelines(f"{u},{i},{t}\n" for u, i, t in _events(6000, seed=3).tolist())
    seen, errors, done = set(), [], threading.Event()

    def poll() -> None:
        while not done.is_set():
            latest = versioned_export.latest_export(str(export_base))
            if latest is None or latest in seen:
                time.sleep(0.01)
                continue
            seen.add(latest)
            try:
                info = versioned_export.read_info(latest)
                served = tf.saved_model.load(latest).signatures["serving_default"]
                scores = served(
                    user_id=tf.constant([1, 2], tf.int64), item_id=tf.constant([3, 4], tf.int64)
                )["scores"]
                assert info["version"] == int(os.path.basename(latest))
                # Which versions the poll sees is timing, so no score is known: each
                # version served gives probabilities (a sigmoid's open range).
                assert np.all((scores.numpy() > 0) & (scores.numpy() < 1))
            except Exception as error:  # noqa: BLE001 (reported by the test)
                # A version renamed aside while being read fails with whatever its
                # missing files raise (NotFound, a bare OpError...); one still there
                # failed as it was written: half-written.
                if os.path.exists(latest):
                    errors.append(f"{latest}: {error!r}")

    reader = threading.Thread(target=poll, daemon=True)
    reader.start()
    trainer, out = _start(
        tmp_path,
        "trainer",
        f"--events_dir={events_dir}",
        f"--model_dir={tmp_path / 'model'}",
        f"--export_dir={export_base}",
        "--export_every_steps=8",
        "--keep_exports=2",
        "--idle_timeout_secs=2",
    )
    text = _finish(trainer, out, tmp_path, "trainer")
    done.set()
    reader.join()
    assert not errors, errors
    assert len(seen) >= 2, text
    assert len(versioned_export.versions(str(export_base))) == 2
    final = versioned_export.latest_export(str(export_base))
    position = versioned_export.read_info(final)["position"]
    assert position["offsets"] == {"a.csv": os.path.getsize(events_dir / "a.csv")}
    assert (position["dead_letters"], position["rewritten_files"]) == (0, 0)
    assert not [n for n in os.listdir(export_base) if n.startswith(".")]  # no leftovers


@pytest.mark.integration
@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "give exactly one source"),
        (["--redis_url=redis://127.0.0.1:1/0"], "cannot reach Redis"),
        (
            ["--events_dir=/nowhere", "--model_dir=/dev/null"],
            "error: --model_dir /dev/null is a file, not a folder",
        ),
    ],
)
def test_bad_input_exits_with_one_clear_line(tmp_path, flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "recommendation.online_main", f"--model_dir={tmp_path}", *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and message in result.stderr
    assert "Traceback" not in result.stderr


def _parse(*args: str) -> absl_flags.FlagValues:
    flag_values = absl_flags.FlagValues()
    online_main.define_online_flags(flag_values)
    flag_values(["online_main", *args])
    return flag_values


_ABSL_FLAGS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok"}


def test_every_flag_is_one_table_row_whose_default_is_its_fields():
    """Each default is written once: in `OnlineConfig`, never beside a flag definition."""
    parsed = _parse("--events_dir=/e")
    rows = {spec.name: spec for spec in core.specs(online_main.ONLINE_FLAGS)}
    assert len(rows) == len(core.specs(online_main.ONLINE_FLAGS))
    names = {parsed[name].name for name in parsed} - _ABSL_FLAGS
    assert names == set(rows)
    for name in names:
        assert parsed[name].default == core.flag_default(rows[name], OnlineConfig()), name


def test_the_default_command_line_runs_the_config_defaults():
    config = online_main.config_from_flags(_parse("--events_dir=/e"))
    assert config == OnlineConfig(events_dir="/e")


def test_the_defaults_a_user_sees_are_online_mains():
    parsed = _parse("--events_dir=/e")
    expected = {
        "batch_size": 4096,
        "model_dir": "/tmp/ncf-online",
        "num_factors": 8,
        "layers": ["64", "32", "16", "8"],
        "num_neg": 4,
        "learning_rate": 0.01,
        "row_optimizer": "adagrad",
        "row_learning_rate": 0.2,
        "bias_terms": True,
        "top_k": 10,
        "seed": None,
        "user_capacity": 2**16,
        "item_capacity": 2**15,
        "keep_exports": 3,
        "sink_size": 4,
        "linger_seconds": 0.2,
        "checkpoint_every_secs": 30.0,
        "export_every_secs": 300.0,
        "publish_every_secs": 0.5,
        "amp_level": "O0",
        "boost_level": "O1",
        "inter_op_parallelism_threads": 0,
        "intra_op_parallelism_threads": 1,
    }
    assert {name: parsed[name].default for name in expected} == expected


def test_concepts_shared_with_ncf_main_are_its_flags():
    # The same name, help, short name and checks; only the field (and default) is online's.
    ncf = {spec.name: spec for spec in core.specs((*ncf_flags.DATA_FLAGS, *ncf_flags.NCF_FLAGS))}
    online = {spec.name: spec for spec in core.specs(online_main.ONLINE_FLAGS)}
    names = ("num_factors", "layers", "num_neg", "learning_rate", "top_k", "seed")
    for name in (*names, "inter_op_parallelism_threads", "intra_op_parallelism_threads"):
        assert dataclasses.replace(online[name], field="") == dataclasses.replace(
            ncf[name], field=""
        ), name


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers=63,32"], "--layers must be positive integers, the first even"),
        (["--batch_size=0"], "--batch_size must be a positive number"),
        (["--max_norm=-1"], "--max_norm must be a positive number"),
        (["--linger_seconds=-1"], "--linger_seconds must not be negative"),
        (["--row_learning_rate=0"], "--row_learning_rate must be a positive number"),
        (["--bias_terms=maybe"], "Non-boolean argument to boolean flag"),
        (["--redis_url=redis://h:1/0"], "give exactly one source"),
        (["--kafka_servers=h:1"], "give exactly one source"),
        (["--kafka_cert_file=c.pem"], "give --kafka_cert_file and --kafka_key_file together"),
        (["--checkpoint_every_secs=0"], "--checkpoint_every_secs must be a positive number"),
        (["--publish_every_secs=-1"], "--publish_every_secs must not be negative"),
        (
            ["--publication_channel=pubs", "--export_dir=/x"],
            "--publication_channel is a topic or stream of the source's broker: give it with "
            "--kafka_servers or --redis_url, and --export_dir for the versions",
        ),
    ],
)
def test_bad_flags_are_rejected(args, message):
    with pytest.raises(absl_flags.IllegalFlagValueError, match=message):
        _parse("--events_dir=/e", *args)


def test_events_trimmed_before_the_trainer_read_them_are_counted_in_its_summary(
    valkey_server, tmp_path
):
    client = valkey_server.client()
    _Publisher(valkey_server, _events(300, seed=8), rate=1e6).run()
    # A trainer's consumer group read and acknowledged these, then the trainer stopped
    # and the producer went on, capping the stream at 500 entries: 1,500 never read.
    client.xgroup_create("events", "trainer", id="0")
    [[_, delivered]] = client.xreadgroup("trainer", "trainer-0", {"events": ">"})
    client.xack("events", "trainer", *[entry_id for entry_id, _ in delivered])
    pipe = client.pipeline(transaction=False)
    for user, item, stamp in _events(2000, seed=9).tolist():
        fields = {"user": user, "item": item, "timestamp": stamp}
        pipe.xadd("events", fields, maxlen=500, approximate=False)
    pipe.execute()
    model_dir, summary_file = tmp_path / "model", tmp_path / "summary.json"
    trainer, out = _start(
        tmp_path,
        "trainer",
        f"--redis_url={valkey_server.url}",
        f"--model_dir={model_dir}",
        f"--summary_file={summary_file}",
        "--idle_timeout_secs=3",
    )
    text = _finish(trainer, out, tmp_path, "trainer")
    assert "dead letters 0, lost events 1500, reconnects 0" in text
    assert (
        "1,500 entries of stream 'events' were trimmed before the trainer read them: they "
        "are not trained (1,500 lost events in all)"
    ) in open(tmp_path / "trainer.err").read()
    summary = json.load(open(summary_file))
    assert summary["events"] == 500 and summary["lost_events"] == 1500
    position = _checkpoint_state(model_dir)[3]
    assert position["lost_events"] == 1500  # checkpointed: a restart goes on from it


# ---------------------------------------------------------------------------
# Nothing acknowledged is lost: event files rewritten while the trainer was stopped,
# and checkpoints damaged on disk (the restore falls back to an older one)


def _csv(events: np.ndarray) -> list[str]:
    return [f"{u},{i},{t}" for u, i, t in events.tolist()]


def _line_ids(path, name: str, start: int = 0, version: int = 1) -> list[str]:
    """The source ids of the lines of event file `path` from byte `start` on."""
    prefix = name if version == 1 else f"{name}#{version}"
    ids, offset = [], 0
    for line in open(path, "rb"):
        if offset >= start:
            ids.append(f"{prefix}:{offset}")
        offset += len(line)
    return ids


def _trained_3000(tmp_path, seed: int):
    """A trainer's first run over 3,000 events of ``events/a.csv``: the folder, the
    file and the flags that run it again."""
    events_dir, model_dir = tmp_path / "events", tmp_path / "model"
    events_dir.mkdir()
    path = events_dir / "a.csv"
    _write_lines(path, _csv(_events(3000, seed=seed)))
    flags = [f"--events_dir={events_dir}", f"--model_dir={model_dir}", "--idle_timeout_secs=2"]
    first, out = _start(tmp_path, "first", *flags)
    assert "online: 3,000 events" in _finish(first, out, tmp_path, "first")
    return events_dir, path, flags


@pytest.mark.integration
def test_an_event_file_rotated_while_the_trainer_was_stopped_is_trained_from_its_start(tmp_path):
    """3,000 events read, the file rotated by copy and truncate and 1,000 written while
    the trainer was stopped: the same command trains the 1,000 (an offset past the
    file's new end skipped them), says so once and counts the file."""
    events_dir, path, flags = _trained_3000(tmp_path, seed=10)
    read_to = os.path.getsize(path)
    shutil.copyfile(path, events_dir / "a.csv.1")  # logrotate's copytruncate: a copy aside,
    os.truncate(path, 0)  # the file emptied in place, then the writer's next events
    _write_lines(path, _csv(_events(1000, seed=11)))
    audit = tmp_path / "second.txt"
    second, out = _start(tmp_path, "second", *flags, f"--trained_events_log={audit}")
    text = _finish(second, out, tmp_path, "second")
    assert "online: 1,000 events" in text
    assert ", rewritten files 1, rotated files 0, reconnects 0" in text
    assert sorted(_lines(audit)) == sorted(_line_ids(path, "a.csv", version=2))
    errors = open(tmp_path / "second.err").read()
    assert errors.count("was rewritten") == 1
    assert (
        f"events file a.csv in {events_dir} was rewritten (now {os.path.getsize(path):,} bytes, "
        f"shorter than the {read_to:,} read): reading it again from its start, as version 2 "
        "of it (1 rewritten files in all)"
    ) in errors


@pytest.mark.integration
def test_an_event_file_rotated_by_rename_while_stopped_has_its_tail_trained_once(tmp_path):
    """3,000 events read; while the trainer was stopped, 500 appended, the file renamed
    (logrotate's `create`) and 1,000 written to a new one: the same command trains the
    500 under the old name, then the 1,000, each once, and counts the rotation."""
    events_dir, path, flags = _trained_3000(tmp_path, seed=16)
    read_to = os.path.getsize(path)
    with open(path, "a") as tail:
        tail.writelines(f"{line}\n" for line in _csv(_events(500, seed=17)))
    os.rename(path, events_dir / "a.csv.1")
    _write_lines(path, _csv(_events(1000, seed=18)))
    audit = tmp_path / "second.txt"
    second, out = _start(tmp_path, "second", *flags, f"--trained_events_log={audit}")
    text = _finish(second, out, tmp_path, "second")
    assert "online: 1,500 events" in text and ", rotated files 1, " in text
    tail = _line_ids(events_dir / "a.csv.1", "a.csv", start=read_to)
    assert _lines(audit) == tail + _line_ids(path, "a.csv", version=2)
    assert "was renamed to a.csv.1 (rotated)" in open(tmp_path / "second.err").read()


def _damage_the_newest_delta(model_dir) -> str:
    """Cuts short the data file of the newest delta `model_dir`'s manifest lists; returns
    the checkpoint a restore falls back to (the delta before it, or the full one)."""
    manifest = json.load(open(model_dir / "deltas.json"))
    assert manifest["deltas"], manifest  # the newest listed checkpoint is a delta
    damage_checkpoint(str(model_dir / manifest["deltas"][-1]), "truncated")
    return str(model_dir / ([manifest["full"], *manifest["deltas"]][-2]))


# Checkpoints every 4 steps of 64 events; deltas between full ones (only their size
# makes one full). Over 12 steps: full at 4, deltas at 8 and 12 (together half the full
# one's size, which is mostly the hash tables' key arrays).
FALLBACK_STEPS = 12
FALLBACK_FLAGS = [
    "--checkpoint_every_steps=4",
    "--checkpoint_every_secs=600",
    "--full_checkpoint_every=100",
    "--idle_timeout_secs=2",
]


@pytest.mark.integration
def test_an_event_folder_trainer_falls_back_past_a_damaged_delta_and_trains_its_events_again(
    tmp_path,
):
    events_dir, model_dir = tmp_path / "events", tmp_path / "model"
    events_dir.mkdir()
    path = events_dir / "a.csv"
    _write_lines(path, _csv(_events(BATCH * FALLBACK_STEPS, seed=12)))
    flags = [f"--events_dir={events_dir}", f"--model_dir={model_dir}", *FALLBACK_FLAGS]
    first, out = _start(tmp_path, "first", *flags)
    _finish(first, out, tmp_path, "first")
    fallback = _damage_the_newest_delta(model_dir)
    restored, step, _, position = _checkpoint_state(model_dir)
    assert restored == fallback and step < FALLBACK_STEPS
    audit = tmp_path / "second.txt"
    second, out = _start(tmp_path, "second", *flags, f"--trained_events_log={audit}")
    text = _finish(second, out, tmp_path, "second")
    assert f"restored {fallback}: step={step} " in text
    # The events after the checkpoint restored, every one once, and no other.
    again = _line_ids(path, "a.csv", start=position["offsets"]["a.csv"])
    assert _lines(audit) == again and len(again) == BATCH * (FALLBACK_STEPS - step)
    assert "is damaged" in open(tmp_path / "second.err").read()


@pytest.mark.integration
@pytest.mark.parametrize("server_fixture, trimmed", [("redis6_server", 0), ("valkey_server", 40)])
def test_a_redis_trainer_falls_back_past_a_damaged_delta_and_trains_the_acknowledged_again(
    request, tmp_path, server_fixture, trimmed
):
    """The newest checkpoint damaged, the restore falls back to the one before: the
    entries after it, acknowledged to the damaged one, are trained again; those the
    stream no longer holds (`trimmed` of them) are counted as lost (Valkey's counters)."""
    server = request.getfixturevalue(server_fixture)
    client = server.client()
    _Publisher(server, _events(BATCH * FALLBACK_STEPS, seed=13), rate=1e6).run()
    model_dir, summary_file = tmp_path / "model", tmp_path / "summary.json"
    flags = [f"--redis_url={server.url}", f"--model_dir={model_dir}", *FALLBACK_FLAGS]
    first, out = _start(tmp_path, "first", *flags)
    _finish(first, out, tmp_path, "first")
    assert client.xpending("events", "trainer")["pending"] == 0  # all acknowledged
    fallback = _damage_the_newest_delta(model_dir)
    restored, step, _, position = _checkpoint_state(model_dir)
    assert restored == fallback and step < FALLBACK_STEPS
    after = [i for i in _stream_ids(client) if _entry_key(i) > _entry_key(position["id"])]
    assert len(after) == BATCH * (FALLBACK_STEPS - step)
    if trimmed:
        client.xtrim("events", minid=after[trimmed], approximate=False)
    audit = tmp_path / "second.txt"
    second, out = _start(
        tmp_path,
        "second",
        *flags,
        f"--trained_events_log={audit}",
        f"--summary_file={summary_file}",
    )
    text = _finish(second, out, tmp_path, "second")
    assert f"restored {fallback}: step={step} " in text
    assert _lines(audit) == after[trimmed:]  # every one still in the stream, once, in order
    assert client.xpending("events", "trainer")["pending"] == 0
    assert f", lost events {trimmed}, reconnects 0, " in text
    summary = json.load(open(summary_file))
    assert (summary["lost_events"], summary["lost_events_exact"]) == (trimmed, True)


def test_the_final_line_says_lost_events_are_unknown_where_some_may_be_uncounted():
    summary = {
        "events": 1000,
        "seconds": 2.0,
        "steps": 16,
        "prequential": None,
        "dead_letters": 0,
        "lost_events": 3,
        "lost_events_exact": True,
        "rewritten_files": None,
        "reconnects": 0,
        "tables": {},
        "failed_exports": 0,
        "failed_publications": 0,
        "failed_tensorboard_writes": 0,
        "stopped_by": "callback",
    }
    counted = run_summary.summary_line(summary)
    assert ", dead letters 0, lost events 3, reconnects 0, stopped by callback" in counted
    uncounted = run_summary.summary_line({**summary, "lost_events_exact": False})
    assert ", lost events unknown (3 counted: see the warnings), reconnects 0, " in uncounted


# ---------------------------------------------------------------------------
# A refusal ends with our error line: nothing (TensorFlow's warnings about an abandoned
# restore, absl's usage hint) may follow it


def _last_line(process: subprocess.Popen, tmp_path, name: str) -> str:
    process.wait(timeout=240)
    assert process.returncode == 1
    text = open(tmp_path / f"{name}.out").read() + open(tmp_path / f"{name}.err").read()
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.mark.integration
def test_every_refusal_ends_with_its_error_line(tmp_path):
    events_dir, model_dir = tmp_path / "events", tmp_path / "model"
    events_dir.mkdir()
    _write_lines(events_dir / "a.csv", _csv(_events(BATCH * 4, seed=14)))
    flags = [f"--events_dir={events_dir}", f"--model_dir={model_dir}", "--idle_timeout_secs=1"]
    _finish(*_start(tmp_path, "first", *flags, "--checkpoint_every_steps=4"), tmp_path, "first")
    refusals = {
        "other_flags": (flags + ["--num_factors=8"], "was made with other model flags"),
        "bad_flag": (flags + ["--row_learning_rate=0"], "--row_learning_rate=0"),
        "argument": (flags + ["stray"], "unexpected arguments: stray"),
    }
    for name, (command, message) in refusals.items():
        line = _last_line(_start(tmp_path, name, *command)[0], tmp_path, name)
        assert line.startswith("error: ") and message in line, (name, line)
    (checkpoint,) = {p.split(".")[0] for p in os.listdir(model_dir) if p.startswith("ckpt-")}
    damage_checkpoint(str(model_dir / checkpoint), "truncated")
    line = _last_line(_start(tmp_path, "damaged", *flags)[0], tmp_path, "damaged")
    assert line.startswith(f"error: no intact checkpoint in {model_dir}"), line
    shutil.rmtree(model_dir)
    with writer_lease.hold(str(model_dir), "ncf-online"):
        line = _last_line(_start(tmp_path, "leased", *flags)[0], tmp_path, "leased")
    assert line.startswith(f"error: --model_dir {model_dir} is in use by ncf-online"), line


@pytest.mark.integration
def test_a_second_model_is_refused_the_group_and_the_first_trains_every_event(
    each_redis_server, tmp_path
):
    """Two trainers of different model_dirs on one group: the second is refused before
    it reads anything, the first trains the whole stream; stopped, it releases the
    group, which a third model then takes over with a warning."""
    server = each_redis_server
    publisher = _Publisher(server, _events(3000, seed=15), rate=1500)
    publisher.start()
    first_dir, other_dir, audit = tmp_path / "a", tmp_path / "b", tmp_path / "first.txt"
    url = f"--redis_url={server.url}"
    first, out = _start(
        tmp_path,
        "first",
        url,
        f"--model_dir={first_dir}",
        f"--trained_events_log={audit}",
        "--idle_timeout_secs=3",
    )
    _wait_for(lambda: _lines(audit), what="training", process=first)
    second = _start(tmp_path, "second", url, f"--model_dir={other_dir}")[0]
    assert _last_line(second, tmp_path, "second").startswith(
        f"error: consumer group 'trainer' of stream 'events' is read by the model in {first_dir} "
        "(ncf-online (pid "
    )
    publisher.join()
    assert "online: 3,000 events" in _finish(first, out, tmp_path, "first")
    assert sorted(_lines(audit), key=_entry_key) == _stream_ids(server.client())
    third, out = _start(tmp_path, "third", url, f"--model_dir={other_dir}", "--idle_timeout_secs=1")
    assert "online: 0 events" in _finish(third, out, tmp_path, "third")
    assert (
        f"taking over consumer group 'trainer' of stream 'events' from the model in {first_dir}"
        in open(tmp_path / "third.err").read()
    )


@pytest.mark.integration
def test_each_window_of_the_curve_is_logged_as_it_closes(tmp_path):
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    _write_lines(events_dir / "a.csv", _csv(_events(3000, seed=19)))
    trainer, out = _start(
        tmp_path,
        "trainer",
        f"--events_dir={events_dir}",
        f"--model_dir={tmp_path / 'model'}",
        "--idle_timeout_secs=1",
        "--prequential_every=1",
        "--prequential_window_events=1000",
    )
    _finish(trainer, out, tmp_path, "trainer")
    said = re.findall(
        r"prequential, events ([\d,]+) to ([\d,]+): HR@10=", open(tmp_path / "trainer.err").read()
    )
    assert said == [("0", "1,000"), ("1,000", "2,000"), ("2,000", "3,000")]
