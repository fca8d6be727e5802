"""Online training on a parameter-server cluster: rows split over devices (in one
process), TF_CONFIG checks, and a loopback cluster of real processes (2 ps, 2
workers, a real Redis or Kafka broker) whose tasks are killed with SIGKILL in turn."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
from absl import logging as absl_logging
from conftest import free_ports, run_module, the_error_line
from test_online_kafka import _after, _committed, _Producer, _values
from test_online_main import (
    MODEL,
    MODEL_FLAGS,
    _entry_key,
    _events,
    _finish,
    _kill_after_a_checkpoint,
    _lines,
    _Publisher,
    _stream_ids,
    _wait_for,
)

from official.core.model_dir import ModelDirError
from recommendation.online import callbacks, cluster, online_ncf
from recommendation.online.cluster import ClusterError
from recommendation.online.state import serving_export, versioned_export
from recommendation.online.tables.row_shards import RowShards
from recommendation.serving.live_model import LiveModel
from recommendation.serving.online_version import OnlineVersion

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
PARAMS = online_ncf.OnlineParams(
    user_capacity=64,
    item_capacity=32,
    mf_dim=4,
    layers=(8, 4),
    mlp_regularization=(0.0, 0.0),
)


def test_row_shards_put_row_r_on_shard_r_mod_n():
    rows = RowShards(tf.constant([[0.0], [1.0], [2.0], [3.0], [4.0]]), "rows", [CPU] * 2)
    assert [shard.numpy().ravel().tolist() for shard in rows.shards] == [[0, 2, 4], [1, 3]]
    assert rows.gather(tf.constant([3, 0, 4, 1], tf.int64)).numpy().ravel().tolist() == [3, 0, 4, 1]
    rows.scatter_update(tf.IndexedSlices(tf.constant([[30.0], [10.0]]), tf.constant([3, 1])))
    rows.resize(tf.constant(7, tf.int64))  # two zero rows: 5 on shard 1, 6 on shard 0
    assert [shard.numpy().ravel().tolist() for shard in rows.shards] == [[0, 2, 4, 0], [10, 30, 0]]
    rows.resize(tf.constant(3, tf.int64))
    assert [shard.numpy().ravel().tolist() for shard in rows.shards] == [[0, 2], [10]]
    assert rows.rows_held() == [2, 1]


def _batches(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "user_id": tf.constant(rng.integers(0, 200, 32)),
            "item_id": tf.constant(rng.integers(0, 80, 32)),
        }
        for _ in range(count)
    ]


def _trained(shard_devices, folder, model_dir=None) -> tuple[dict, online_ncf.RecModel]:
    tf.keras.utils.set_random_seed(1)
    rec_model = online_ncf.build_rec_model(PARAMS, shard_devices=shard_devices)
    # Exports every 4 steps: the first one's tables are a fraction of the last's.
    chosen = [serving_export.ExportCallback(str(folder), every_steps=4, keep=1)]
    if model_dir:  # a full checkpoint every 3, deltas between
        chosen.append(callbacks.CheckpointCallback(model_dir, every_steps=4, full_every=3))
    summary = rec_model.online_train(_batches(44), chosen, sink_size=2)
    return summary["logs"], rec_model


def _rows(table) -> np.ndarray:
    return table.live_rows()[1].numpy()


def test_rows_split_over_three_devices_train_exactly_as_one_table(tmp_path):
    logs, whole = _trained(None, tmp_path / "whole")
    split_logs, split = _trained([CPU] * 3, tmp_path / "split", str(tmp_path / "model"))
    assert split_logs == logs
    for name in ("user_embedding", "item_embedding"):
        one, three = getattr(whole.network, name), getattr(split.network, name)
        whole.trim_tables()
        split.trim_tables()
        np.testing.assert_array_equal(_rows(three), _rows(one))
        for moment, moments in zip(one.moments, three.moments, strict=True):
            np.testing.assert_array_equal(
                moments.gather(tf.range(three.size + 1)), moment.read_value()
            )
    # 32 item rows (the item table is full): rows 3..30, 1..31 and 2..32 by shard.
    assert split.network.item_embedding.rows_per_shard() == [10, 11, 11]
    users = split.network.user_embedding
    assert sum(users.rows_per_shard()) == int(users.size.numpy())
    # What a server reads, in the last export: the same scores.
    held = [
        getattr(split.network, name).contents()[0][:4]
        for name in ("user_embedding", "item_embedding")
    ]
    users, items = (tf.concat([keys, tf.constant([12345], tf.int64)], 0) for keys in held)
    scores = []
    for folder in ("whole", "split"):
        latest = versioned_export.latest_export(str(tmp_path / folder))
        serve = tf.saved_model.load(latest).signatures["serving_default"]
        scores.append(serve(user_id=users, item_id=items)["scores"].numpy())
    assert os.path.basename(latest) == "44" and len(set(scores[0].tolist())) == 5
    np.testing.assert_array_equal(scores[1], scores[0])

    # Its checkpoints (full and deltas) restore the split rows as they were.
    restored = online_ncf.build_rec_model(PARAMS, shard_devices=[CPU] * 3)
    checkpoint = callbacks.CheckpointCallback(str(tmp_path / "model"), every_steps=4)
    checkpoint.set_rec_model(restored)
    checkpoint.on_train_begin()
    assert os.path.basename(checkpoint.restored_from).startswith("delta-")
    assert callbacks.table_digest(restored.network) == callbacks.table_digest(split.network)
    for name in ("user_embedding", "item_embedding"):
        np.testing.assert_array_equal(
            _rows(getattr(restored.network, name)), _rows(getattr(split.network, name))
        )


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ("{oops", "TF_CONFIG is not JSON"),
        ('{"task": {"type": "chief"}}', 'TF_CONFIG has no "cluster"'),
        (
            '{"cluster": {"chief": ["h:1"], "worker": ["h:2"]}, "task": {"type": "chief"}}',
            "TF_CONFIG's cluster has no ps task",
        ),
        (
            '{"cluster": {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3"]}, '
            '"task": {"type": "ps", "index": 1}}',
            "TF_CONFIG's task index 1 is not one of the 1 ps tasks",
        ),
        (
            '{"cluster": {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3"]}, '
            '"task": {"type": "evaluator"}}',
            'TF_CONFIG\'s "task" must name a job of the cluster',
        ),
    ],
)
def test_a_tf_config_that_names_no_usable_cluster_is_refused(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ClusterError, match=re.escape(message)):
        cluster.cluster_resolver()


def test_a_task_started_as_another_than_its_tf_config_says_is_refused(monkeypatch):
    spec = {"chief": ["localhost:1"], "ps": ["localhost:2"], "worker": ["localhost:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "ps"}}))
    with pytest.raises(ClusterError) as raised:
        cluster.serve("worker")
    assert str(raised.value) == "--serve_as worker, but TF_CONFIG's task is ps 0: make them agree"


def test_without_tf_config_there_is_no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cluster.cluster_resolver() is None
    with pytest.raises(ClusterError, match="--serve_as ps needs TF_CONFIG"):
        cluster.serve("ps")


def test_the_chief_waits_for_tasks_that_answer_and_names_one_that_does_not():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("localhost", 0))
        listening.listen()
        closed.bind(("localhost", 0))  # bound, never listening: connections are refused
        up, down = (f"localhost:{s.getsockname()[1]}" for s in (listening, closed))
        spec = tf.train.ClusterSpec({"chief": ["localhost:1"], "ps": [up], "worker": [up]})
        cluster.wait_for_tasks(spec, seconds=5)
        spec = tf.train.ClusterSpec({"chief": ["localhost:1"], "ps": [up], "worker": [up, down]})
        with pytest.raises(ClusterError) as raised:
            cluster.wait_for_tasks(spec, seconds=0.5)
    assert str(raised.value) == (
        f"worker task 1 at {down} does not answer after 0.5 s: start it (ncf-online "
        "--serve_as worker with its TF_CONFIG), or fix the address in TF_CONFIG"
    )


def test_a_wait_on_the_workers_is_reported_until_it_ends():
    warned = threading.Event()
    messages = []

    class Handler(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
            warned.set()

    handler = Handler()
    absl_logging.get_absl_logger().addHandler(handler)
    try:
        with cluster.reporting_waits("a step", every_seconds=0.01):
            assert warned.wait(60)  # the block is a wait that only the warning ends
    finally:
        absl_logging.get_absl_logger().removeHandler(handler)
    count = len(messages)
    assert re.fullmatch(
        r"waited \d+ s for a step: is any worker task alive\? \(start the dead ones again "
        r"with their TF_CONFIG; training goes on when one answers\)",
        messages[0],
    )
    threading.Event().wait(0.05)
    assert len(messages) == count  # no warning once the wait is over


# -- a loopback cluster of real processes --------------------------------------


class _Cluster:
    """2 ps and 2 worker tasks (``ncf-online --serve_as``) and the chief's TF_CONFIG."""

    def __init__(self, tmp_path, ports) -> None:
        self.tmp_path = tmp_path
        addresses = [f"localhost:{port}" for port in ports]
        self.spec = {"chief": addresses[:1], "ps": addresses[1:3], "worker": addresses[3:5]}
        self.tasks: dict[tuple[str, int], subprocess.Popen] = {}

    def tf_config(self, kind: str, index: int) -> str:
        return json.dumps({"cluster": self.spec, "task": {"type": kind, "index": index}})

    def start(self, kind: str, index: int) -> None:
        log = open(self.tmp_path / f"{kind}{index}.log", "a")
        self.tasks[kind, index] = subprocess.Popen(
            [sys.executable, "-m", "recommendation.online_main", f"--serve_as={kind}"],
            env={**os.environ, "TF_CONFIG": self.tf_config(kind, index)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def kill(self, kind: str, index: int) -> None:
        os.kill(self.tasks[kind, index].pid, signal.SIGKILL)
        self.tasks[kind, index].wait()

    def trainer(self, name: str, *flags: str) -> tuple[subprocess.Popen, str]:
        out = self.tmp_path / f"{name}.out"
        with open(out, "w") as stdout, open(self.tmp_path / f"{name}.err", "w") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "recommendation.online_main", *MODEL_FLAGS, *flags],
                env={**os.environ, "TF_CONFIG": self.tf_config("chief", 0)},
                stdout=stdout,
                stderr=stderr,
            )
        return process, str(out)

    def stop(self) -> None:
        for process in self.tasks.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def _restored(model_dir) -> tuple[str, online_ncf.RecModel]:
    """What a restart restores from `model_dir` (a full checkpoint and its deltas),
    read into this process with the rows split over two devices, as over the 2 ps
    tasks: the last checkpoint applied, and the model."""
    rec_model = online_ncf.build_rec_model(MODEL, shard_devices=[CPU] * 2)
    checkpoint = callbacks.CheckpointCallback(str(model_dir), every_steps=1)
    checkpoint.set_rec_model(rec_model)
    checkpoint.on_train_begin()
    return checkpoint.restored_from, rec_model


@pytest.mark.integration
def test_cluster_loses_no_event_when_a_worker_a_ps_task_or_the_trainer_is_killed(
    redis_server, tmp_path
):
    """SIGKILL a worker (the trainer goes on), then a ps task (the trainer stops with
    an error; both restarted), then the trainer (restarted): every event is trained,
    none before a restored checkpoint again, and every id is on one ps task. The last
    run publishes what changes as a one-process trainer does: a server that follows it
    from its first version holds, once caught up, what its last version holds."""
    model_dir = tmp_path / "model"
    flags = [
        f"--redis_url={redis_server.url}",
        f"--model_dir={model_dir}",
        "--checkpoint_every_steps=10",
        "--checkpoint_every_secs=600",
    ]
    client = redis_server.client()
    tasks = _Cluster(tmp_path, free_ports(5))
    try:
        for kind in ("ps", "worker"):
            for index in range(2):
                tasks.start(kind, index)
        audits = [tmp_path / f"trained{run}.txt" for run in range(3)]
        first, out = tasks.trainer("first", *flags, f"--trained_events_log={audits[0]}")
        _Publisher(redis_server, _events(1500, seed=0), rate=1e6).run()
        _wait_for(lambda: len(_lines(audits[0])) >= 1500, what="1,500 events", process=first)
        tasks.kill("worker", 1)
        _Publisher(redis_server, _events(1500, seed=1), rate=1e6).run()
        _wait_for(
            lambda: len(set(_lines(audits[0]))) >= 3000,
            what="training on one worker",
            process=first,
        )
        tasks.kill("ps", 0)
        _Publisher(redis_server, _events(500, seed=2), rate=1e6).run()
        assert first.wait(timeout=240) == 1
        error = open(tmp_path / "first.err").read().splitlines()[-1]
        assert re.match(r"error: (ps|worker) task \d stopped answering: restart it", error), error
        assert error.endswith(
            "training resumes from the last checkpoint, whose events are the only ones acknowledged"
        )

        tasks.start("ps", 0)
        tasks.start("worker", 1)
        checkpoint, restored = _restored(model_dir)
        # Checkpoints every 10 steps of 64 events, a full one every 10: after the 47 or
        # more steps of 3,000 events, a delta.
        assert os.path.basename(checkpoint).startswith("delta-"), checkpoint
        restored_at = [restored.position["id"]]
        second, _ = tasks.trainer("second", *flags, f"--trained_events_log={audits[1]}")
        _Publisher(redis_server, _events(1500, seed=3), rate=1e6).run()
        _wait_for(lambda: len(_lines(audits[1])) >= 1000, what="a restarted run", process=second)
        os.kill(second.pid, signal.SIGKILL)
        second.wait()
        restored_at.append(_restored(model_dir)[1].position["id"])
        export = tmp_path / "export"
        server = LiveModel(str(export), publication_poll_seconds=0.01)
        server.start()
        third, out = tasks.trainer(
            "third",
            *flags,
            f"--trained_events_log={audits[2]}",
            "--idle_timeout_secs=3",
            f"--export_dir={export}",
            "--publish_every_secs=0.1",
        )
        _wait_for(lambda: server.served is not None, what="the run's first version", process=third)
        first = server.served.module  # the run's start, followed in place from there
        text = _finish(third, out, tmp_path, "third")
        newest = versioned_export.latest_export(str(export))
        info = versioned_export.read_info(newest)
        _wait_for(
            lambda: (server.served.run, server.served.seq) == (info["run"], info["publication"]),
            what="the server to hold the last version's state",
        )
        server.stop()
    finally:
        tasks.stop()
    assert server.served.module is first  # followed publications, never loaded again
    last = OnlineVersion(info["model"])
    tf.train.Checkpoint(root=last).read(os.path.join(newest, "variables", "variables"))
    for name in ("users", "items"):
        held, written = getattr(server.served.module, name), getattr(last, name)
        size = int(written.size.numpy())
        assert int(held.size.numpy()) == size > 0
        np.testing.assert_array_equal(held.keys.numpy()[: size + 1], written.keys.numpy())
        np.testing.assert_array_equal(held.rows.numpy()[: size + 1], written.rows.numpy())

    events = _stream_ids(client)
    trained = [_lines(audit) for audit in audits]
    assert set(events) == set().union(*trained)  # every event trained at least once
    # A restarted run is handed the events after its checkpoint, none before it.
    for run, position in zip(trained[1:], restored_at, strict=True):
        assert run and min(_entry_key(i) for i in run) > _entry_key(position)
    assert sorted(trained[2]) == sorted(
        i for i in events if _entry_key(i) > _entry_key(restored_at[1])
    )
    assert client.xpending("events", "trainer")["pending"] == 0  # all acknowledged
    # The final checkpoint: every admitted id holds one row, on one ps task, 1/2 each.
    shards = re.search(
        r"rows per ps task: users ([\d,]+) / ([\d,]+), items ([\d,]+) / ([\d,]+)", text
    )
    assert shards, text
    _, restored = _restored(model_dir)
    restored.trim_tables()
    for table, counts in (
        (restored.network.user_embedding, shards.group(1, 2)),
        (restored.network.item_embedding, shards.group(3, 4)),
    ):
        size = int(table.size.numpy())
        keys = table.contents()[0].numpy()
        assert len(set(keys.tolist())) == len(keys) == size > 0
        assert table.embeddings.rows_held() == [size // 2 + 1, (size + 1) // 2]  # row 0 too
        assert [int(count.replace(",", "")) for count in counts] == [size // 2, (size + 1) // 2]
        rows = _rows(table)
        assert np.all(np.any(rows[1:] != 0, axis=1))  # every id's row holds its values


@pytest.mark.integration
def test_a_chief_reading_kafka_killed_and_restarted_trains_each_event_after_its_offsets_once(
    kafka_broker, tmp_path
):
    """The chief reads a topic of three partitions as ncf-online alone does: SIGKILLed
    mid-stream and started again, it trains exactly the events after its checkpoint's
    offsets, once each, and leaves the group's committed offsets at its last one."""
    kafka_broker.create_topic("events", 3)
    model_dir = tmp_path / "model"
    flags = [
        f"--kafka_servers={kafka_broker.servers}",
        f"--model_dir={model_dir}",
        "--checkpoint_every_steps=10",
        "--checkpoint_every_secs=600",
    ]
    first_audit, second_audit = tmp_path / "first.txt", tmp_path / "second.txt"
    tasks = _Cluster(tmp_path, free_ports(5))
    try:
        for kind in ("ps", "worker"):
            for index in range(2):
                tasks.start(kind, index)
        producer = _Producer(kafka_broker, _values(_events(3000, seed=0)), rate=1000)
        producer.start()
        first, _ = tasks.trainer("first", *flags, f"--trained_events_log={first_audit}")
        _kill_after_a_checkpoint(first, first_audit, model_dir, 1000)
        position = _restored(model_dir)[1].position
        producer.join()
        more = kafka_broker.produce("events", _values(_events(600, seed=1)))
        second, out = tasks.trainer(
            "second", *flags, f"--trained_events_log={second_audit}", "--idle_timeout_secs=3"
        )
        text = _finish(second, out, tmp_path, "second")
    finally:
        tasks.stop()

    events = producer.ids + more
    after = _after(events, position["offsets"])
    first_trained, second_trained = _lines(first_audit), _lines(second_audit)
    assert len(first_trained) < 3000  # it was killed in the middle
    assert sorted(second_trained) == sorted(after) and len(set(second_trained)) == len(after)
    assert set(events) - set(after) <= set(first_trained)
    assert {i.split(":")[0] for i in second_trained} == {"0", "1", "2"}
    assert "dead letters 0, lost events 0, reconnects 0" in text
    final = _restored(model_dir)[1].position
    assert final["offsets"] == _committed(kafka_broker, 3)
    assert sum(final["offsets"].values()) == 3600


@pytest.mark.integration
def test_no_step_in_flight_trains_a_row_that_another_id_holds_by_then(tmp_path):
    """A stream that evicts, frees and moves rows at every step, on 2 ps tasks and 2
    workers with two steps a worker in flight: after every resolve, each step still in
    flight finds each of its ids on the row it was resolved with (`in_flight_audit`)."""
    tasks = _Cluster(tmp_path, free_ports(5))
    audit = tmp_path / "audit.json"
    try:
        for kind in ("ps", "worker"):
            for index in range(2):
                tasks.start(kind, index)
        chief = subprocess.run(
            [sys.executable, os.path.join(os.path.dirname(__file__), "in_flight_audit.py")]
            + [str(audit)],
            env={**os.environ, "TF_CONFIG": tasks.tf_config("chief", 0)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        tasks.stop()
    assert chief.returncode == 0, chief.stderr[-3000:]
    result = json.loads(audit.read_text())
    assert result["steps"] == 160 and result["most_in_flight"] == 4
    assert result["violations"] == [], result["violations"][:5]
    # It did evict, free and move rows: 4 new users a step, freed 8 steps after their
    # last sighting; 2 new items a step in a full table of 32.
    assert result["user"]["admitted"] >= 4 * 160 and result["user"]["evicted"] > 500
    assert result["item"]["evicted"] > 200 and result["drains"] > 0


@pytest.mark.integration
def test_a_task_whose_port_is_taken_exits_with_one_line(
    monkeypatch,
):
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        address = f"localhost:{taken.getsockname()[1]}"
        spec = {"chief": ["localhost:1"], "ps": [address], "worker": ["localhost:2"]}
        task = {"cluster": spec, "task": {"type": "ps", "index": 0}}
        monkeypatch.setenv("TF_CONFIG", json.dumps(task))
        result = run_module("recommendation.online_main", "--serve_as=ps")
    assert the_error_line(result) == (
        f"error: cannot serve ps 0 at {address} (Could not start gRPC server): free the "
        "port or fix TF_CONFIG"
    )


def test_a_checkpoint_of_rows_split_otherwise_than_the_model_is_refused(tmp_path):
    model_dir = str(tmp_path / "model")
    split = online_ncf.build_rec_model(PARAMS, shard_devices=[CPU] * 2)
    split.online_train(_batches(4), [callbacks.CheckpointCallback(model_dir, every_steps=2)])
    checkpoint = tf.train.latest_checkpoint(model_dir)
    for devices, held, where in (
        (None, "in one process", "on a cluster of 2 ps tasks"),
        ([CPU] * 3, "split over 3 ps tasks", "on a cluster of 2 ps tasks"),
    ):
        other = online_ncf.build_rec_model(PARAMS, shard_devices=devices)
        restore = callbacks.CheckpointCallback(model_dir, every_steps=2)
        restore.set_rec_model(other)
        with pytest.raises(ModelDirError) as refused:
            restore.on_train_begin()
        assert str(refused.value) == (
            f"the checkpoint {checkpoint} holds the embedding_user rows split over 2 ps tasks, "
            f"this run has them {held}: resume it {where}, or start over with --clean or "
            "another --model_dir"
        )
