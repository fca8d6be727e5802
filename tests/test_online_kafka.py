"""ncf-online end to end on a real Kafka-protocol broker (tansu): kill -9 and restart
over a topic of three partitions, the error line where no broker answers, and the SASL
password never shown."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
from conftest import free_ports, the_error_line, throwaway_password
from test_online_main import (
    CHECKPOINT_STEPS,
    _checkpoint_state,
    _events,
    _finish,
    _kill_after_a_checkpoint,
    _lines,
    _start,
)


def _values(events) -> list[tuple[int, bytes]]:
    """The events as CSV messages, spread over three partitions."""
    return [(index % 3, f"{u},{i},{t}".encode()) for index, (u, i, t) in enumerate(events.tolist())]


class _Producer(threading.Thread):
    """Writes messages in chunks at about `rate` a second; their ids land in `ids`."""

    def __init__(self, broker, values: list, rate: float, chunk: int = 50) -> None:
        super().__init__(daemon=True)
        self.broker, self.values, self.rate, self.chunk = broker, values, rate, chunk
        self.ids: list[str] = []

    def run(self) -> None:
        start = time.monotonic()
        for offset in range(0, len(self.values), self.chunk):
            time.sleep(max(0.0, start + offset / self.rate - time.monotonic()))
            self.ids += self.broker.produce("events", self.values[offset : offset + self.chunk])


def _after(ids: list[str], offsets: dict) -> list[str]:
    """The ids at or after each partition's offset in `offsets` (a position's)."""
    return [i for i in ids if int(i.split(":")[1]) >= offsets.get(i.split(":")[0], 0)]


def _committed(broker, partitions: int) -> dict[str, int]:
    """The offsets group ``trainer`` committed, by partition."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(broker.settings(**{"group.id": "trainer"}))
    found = consumer.committed([TopicPartition("events", p) for p in range(partitions)], 10)
    consumer.close()
    return {str(tp.partition): tp.offset for tp in found if tp.offset >= 0}


def test_kill_9_and_restart_train_every_event_of_every_partition_once(kafka_broker, tmp_path):
    kafka_broker.create_topic("events", 3)
    model_dir = tmp_path / "model"
    first_audit, second_audit = tmp_path / "first.txt", tmp_path / "second.txt"
    flags = [
        f"--kafka_servers={kafka_broker.servers}",
        f"--model_dir={model_dir}",
        f"--checkpoint_every_steps={CHECKPOINT_STEPS}",
        "--checkpoint_every_secs=600",
    ]
    dead = kafka_broker.produce("events", [(0, b"1,2")])  # dead-lettered by the first run
    producer = _Producer(kafka_broker, _values(_events(4000, seed=0)), rate=1500)
    producer.start()
    first, _ = _start(tmp_path, "first", *flags, f"--trained_events_log={first_audit}")
    _kill_after_a_checkpoint(first, first_audit, model_dir, 1500)
    _, step, _, position = _checkpoint_state(model_dir)
    producer.join()
    dead += kafka_broker.produce("events", [(1, b'{"user": 1}'), (2, b"x,1,1")])
    more = kafka_broker.produce("events", _values(_events(900, seed=1)))

    second, out = _start(
        tmp_path, "second", *flags, f"--trained_events_log={second_audit}", "--idle_timeout_secs=3"
    )
    text = _finish(second, out, tmp_path, "second")
    assert f"restored {model_dir}" in text and f"step={step} " in text
    events = [i for i in producer.ids + more if i not in dead]
    after = _after(events, position["offsets"])
    first_trained, second_trained = _lines(first_audit), _lines(second_audit)
    assert len(first_trained) < 4000  # it was killed in the middle
    # The restarted trainer read exactly the events after its checkpoint's offsets, once
    # each, in all three partitions; those before were trained by the killed one.
    assert sorted(second_trained) == sorted(after) and len(set(second_trained)) == len(after)
    assert set(events) - set(after) <= set(first_trained)
    assert {i.split(":")[0] for i in second_trained} == {"0", "1", "2"}
    assert "dead letters 3, lost events 0, reconnects 0" in text
    # The group's committed offsets are the last checkpoint's (what lag tools read).
    final = _checkpoint_state(model_dir)[3]
    assert final["offsets"] == {p: n for p, n in _committed(kafka_broker, 3).items()}
    assert sum(final["offsets"].values()) == 4903


@pytest.mark.integration
def test_start_up_errors_are_one_line_and_the_password_is_never_shown(kafka_broker, tmp_path):
    password = throwaway_password()
    env = {**os.environ, "NCF_KAFKA_PASSWORD": password}
    common = ["--kafka_username=trainer"]
    nowhere = f"127.0.0.1:{free_ports(1)[0]}"  # no broker listens there
    # tansu takes no SASL login: the broker refuses it, as a wrong password would be.
    refused, _ = _start(
        tmp_path,
        "refused",
        f"--kafka_servers={kafka_broker.servers}",
        f"--model_dir={tmp_path / 'a'}",
        *common,
        env=env,
    )
    down, _ = _start(
        tmp_path,
        "down",
        f"--kafka_servers={nowhere}",
        f"--model_dir={tmp_path / 'b'}",
        *common,
        env=env,
    )
    for name, process in (("refused", refused), ("down", down)):
        process.wait(timeout=240)
        result = _completed(process, tmp_path, name)
        line = the_error_line(result)
        assert password not in result.stdout + result.stderr, name
        if name == "down":
            assert line.startswith(f"error: cannot reach Kafka at {nowhere} (")
        else:
            assert line.startswith(
                f"error: Kafka at {kafka_broker.servers} refused user trainer with the "
                "password from NCF_KAFKA_PASSWORD ("
            )


def _completed(process, tmp_path, name: str) -> subprocess.CompletedProcess:
    """The finished `process` as a `subprocess.CompletedProcess` (its captured output)."""
    return subprocess.CompletedProcess(
        process.args,
        process.returncode,
        open(tmp_path / f"{name}.out").read(),
        open(tmp_path / f"{name}.err").read(),
    )
