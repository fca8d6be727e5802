"""The Kafka source (`KafkaSource`) and its group claim (`KafkaClaim`) in this process, on
a real Kafka-protocol broker (tansu): every partition read, a restore resuming at each
partition's offset, dead letters, lost events, outages, start-up errors, the claim."""

from __future__ import annotations

import json
import re

import pytest
from absl import logging

pytest.importorskip("confluent_kafka", reason="the kafka extra (confluent-kafka) is missing")

# isort: split
from official.core import writer_lease
from recommendation.online.sources import kafka_claim, kafka_messages, kafka_source
from recommendation.online.sources.dead_letters import DeadLetterFile
from recommendation.online.sources.group_claim import GroupClaimError
from recommendation.online.sources.kafka_connection import (
    KafkaAccessError,
    KafkaOptions,
    resolve,
)


def _source(broker, tmp_path, topic: str = "events", **options) -> kafka_source.KafkaSource:
    access = resolve(KafkaOptions(servers=broker.servers), environ={})
    dead = options.pop("dead_letters", None) or DeadLetterFile(str(tmp_path / "dead.jsonl"))
    source = kafka_source.KafkaSource(access, topic, "trainer", dead, **options)
    source.connect()
    return source


def _read(source, count: int, chunk: int = 100) -> tuple[list[str], list, dict | None]:
    """Reads until `count` events arrived: their ids, (user, item, timestamp) and the
    position after the last chunk."""
    ids, events, position = [], [], None
    for _ in range(400):
        if len(ids) >= count:
            break
        read = source.read(chunk, 0.05)
        if read is not None:
            ids += read.ids
            events += list(zip(read.users, read.items, read.timestamps, strict=True))
            position = read.position
    assert len(ids) == count, (len(ids), count)
    return ids, events, position


def _values(count: int, partitions: int, start: int = 0) -> list[tuple[int, bytes]]:
    return [(i % partitions, f"{i},{i % 7},{i}".encode()) for i in range(start, start + count)]


def _warnings(monkeypatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(logging, "warning", lambda text, *args: said.append(text % args))
    return said


def test_every_partition_is_read_and_a_restore_resumes_at_each_offset(kafka_broker, tmp_path):
    kafka_broker.create_topic("events", 3)
    produced = kafka_broker.produce("events", _values(600, 3))
    source = _source(kafka_broker, tmp_path)
    first, _, middle = _read(source, 300)
    rest, _, end = _read(source, 300)
    assert sorted(first + rest) == sorted(produced)  # each event once, all partitions
    assert {i.split(":")[0] for i in first + rest} == {"0", "1", "2"}
    assert end["offsets"] == {"0": 200, "1": 200, "2": 200}
    assert end["topic_id"] and end["lost_events"] == 0 and end["lost_events_exact"]
    source.close()

    restarted = _source(kafka_broker, tmp_path)
    restarted.restore(middle)  # what a checkpoint after the first 300 holds
    again, _, _ = _read(restarted, 300)
    assert sorted(again) == sorted(set(produced) - set(first))  # exactly the rest
    assert restarted.read(100, 0.5) is None
    restarted.close()


def test_malformed_events_are_dead_lettered_once_and_counted(kafka_broker, tmp_path):
    kafka_broker.create_topic("events", 2)
    bad = [
        (0, b"1,2"),
        (1, b'{"user": 1, "item": 2, "timestamp": NaN}'),
        (0, b"-3,1,1"),
        (1, b"7" * 100_000 + b",1,1"),
        (0, b"\xff,1,1"),
    ]
    good = [(0, b'{"user": 5, "item": 6, "timestamp": 7}'), (1, b"8,9,10\n")]
    ids = kafka_broker.produce("events", _values(40, 2) + bad + good)
    dead_topic = kafka_messages.DeadLetterTopic(
        {"bootstrap.servers": kafka_broker.servers, "group.id": "trainer", "log_level": 0},
        "events.dead",
        "events",
    )
    for dead_letters in (DeadLetterFile(str(tmp_path / "dead.jsonl")), dead_topic):
        source = _source(kafka_broker, tmp_path, dead_letters=dead_letters)
        trained, events, position = _read(source, 42)
        assert sorted(trained) == sorted(ids[:40] + ids[45:])
        assert (5, 6, 7) in events and (8, 9, 10) in events
        assert position["dead_letters"] == 5
        source.restore({**position, "offsets": {"0": 0, "1": 0}, "dead_letters": 0})
        _read(source, 42)  # read again (a restart from before them): written once only
        source.close()
    letters = [json.loads(line) for line in open(tmp_path / "dead.jsonl")]
    assert sorted(letter["id"] for letter in letters) == sorted(ids[40:45])
    assert all(len(letter["payload"]) < 2000 for letter in letters)
    on_topic = [json.loads(value) for value in _topic_values(kafka_broker, "events.dead", 5)]
    assert sorted(letter["id"] for letter in on_topic) == sorted(ids[40:45])
    assert {letter["topic"] for letter in on_topic} == {"events"}


def _topic_values(broker, topic: str, count: int) -> list[bytes]:
    """`count` values of `topic` (all its partitions)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(broker.settings(**{"group.id": "reader"}))
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, partition, 0) for partition in partitions])
    values: list[bytes] = []
    for _ in range(100):
        values += [message.value() for message in consumer.consume(100, 0.1)]
        if len(values) >= count:
            break
    consumer.close()
    return values


class _RetentionDeleted(kafka_source.KafkaSource):
    """A source whose broker's first offsets are `first` (as after retention deleted
    the records before them; tansu keeps every record)."""

    first: dict[int, int] = {}

    def _watermarks(self, partition: int) -> tuple[int, int]:
        low, high = super()._watermarks(partition)
        return max(low, self.first.get(partition, 0)), high


def test_events_deleted_before_the_trainer_read_them_are_counted_exactly(
    kafka_broker, tmp_path, monkeypatch
):
    kafka_broker.create_topic("events", 2)
    produced = kafka_broker.produce("events", _values(200, 2))
    source = _source(kafka_broker, tmp_path)
    topic_id = _read(source, 200)[2]["topic_id"]
    source.close()
    # A checkpoint after the first 20 events of each partition.
    position = {"topic_id": topic_id, "offsets": {"0": 20, "1": 20}, "dead_letters": 0}
    said = _warnings(monkeypatch)
    access = resolve(KafkaOptions(servers=kafka_broker.servers), environ={})
    dead = DeadLetterFile(str(tmp_path / "dead.jsonl"))
    restarted = _RetentionDeleted(access, "events", "trainer", dead)
    restarted.first = {0: 50}  # offsets 20 to 49 of partition 0 deleted
    restarted.connect()
    restarted.restore(position)
    ids, _, after = _read(restarted, 160 - 30)
    assert sorted(ids) == sorted(i for i in produced if _offset(i) >= (50 if i[0] == "0" else 20))
    assert (after["lost_events"], after["lost_events_exact"]) == (30, True)
    assert (
        "30 events of partition 0 of Kafka topic 'events' (offsets 20 to 49) were deleted "
        "before the trainer read them: they are not trained (30 lost events in all)"
    ) in said[0]
    restarted.restore({**after, "offsets": {"0": 50}})  # the count travels with the offset
    _read(restarted, 100 - 50 + 100)
    assert restarted.lost_events == 30
    restarted.close()


def _offset(source_id: str) -> int:
    return int(source_id.split(":")[1])


def test_a_broker_restart_that_lost_the_topic_is_said_counted_and_read_on(
    kafka_broker, tmp_path, monkeypatch
):
    kafka_broker.create_topic("events", 2)
    kafka_broker.produce("events", _values(100, 2))
    source = _source(kafka_broker, tmp_path)  # the topic's id read every 5 s
    _, _, before = _read(source, 100)
    said = _warnings(monkeypatch)
    kafka_broker.kill()  # memory storage: the topic and its offsets are gone
    assert source.read(100, 0.5) is None
    kafka_broker.start()
    kafka_broker.create_topic("events", 2)
    # Past the offsets the source held (50 a partition): fetched there at once, its
    # records would be trained before the new id is seen, and again from the start.
    produced = kafka_broker.produce("events", _values(160, 2, start=1000))
    ids, events, after = _read(source, 160)
    assert source.read(100, 0.5) is None  # nothing twice
    assert sorted(ids) == sorted(produced)  # the new topic from its start
    assert sorted(stamp for _, _, stamp in events) == list(range(1000, 1160))
    assert source.reconnects == 1  # one outage, said once
    assert [line for line in said if "unavailable" in line][:1] and (
        len([line for line in said if "unavailable" in line]) == 1
    )
    recreated = [line for line in said if "deleted and created again" in line]
    assert len(recreated) == 1 and "partition 0 at 50, partition 1 at 50" in recreated[0]
    assert after["topic_id"] != before["topic_id"]
    assert (after["lost_events"], after["lost_events_exact"]) == (0, False)
    assert after["offsets"] == {"0": 80, "1": 80}
    source.close()


def test_a_broker_that_does_not_answer_is_one_clear_error_at_start(kafka_broker, tmp_path):
    kafka_broker.kill()
    with pytest.raises(KafkaAccessError) as refused:
        _source(kafka_broker, tmp_path)
    assert re.fullmatch(
        rf"cannot reach Kafka at {kafka_broker.servers} \(.*Connection refused.*\): start the "
        r"broker or fix --kafka_servers \(while connecting for topic 'events'\)",
        str(refused.value),
    )


def _their_claim(broker, model_dir: str, **fields) -> dict:
    """A claim of group ``trainer`` of topic ``events`` as another live trainer (pid 1)
    would have written it."""
    access = resolve(KafkaOptions(servers=broker.servers), environ={})
    theirs = kafka_claim.KafkaClaim(access, "events", "trainer", model_dir)
    theirs.record.update({"pid": 1, "pid_started": writer_lease._start_time(1), **fields})
    theirs._transact(lambda found: True)
    return theirs.record


def _claim(broker, model_dir: str, **options) -> kafka_claim.KafkaClaim:
    access = resolve(KafkaOptions(servers=broker.servers), environ={})
    return kafka_claim.KafkaClaim(access, "events", "trainer", model_dir, **options)


def test_a_group_claim_refuses_another_model_and_passes_once_released(kafka_broker, monkeypatch):
    theirs = _their_claim(kafka_broker, "/models/a")
    with pytest.raises(GroupClaimError) as refused:
        _claim(kafka_broker, "/models/b").acquire()
    assert str(refused.value).startswith(
        "consumer group 'trainer' of topic 'events' is read by the model in /models/a "
        "(ncf-online (pid 1 on host "
    )
    assert "give this model its own --group (it reads the topic from its start)" in str(
        refused.value
    )
    same = _claim(kafka_broker, "/models/a/", renew_seconds=0.05)
    same.acquire()  # its own model_dir: at once, without a word
    assert same._current()["token"] == same.record["token"] != theirs["token"]
    same.check()
    same.release()
    said = _warnings(monkeypatch)
    other = _claim(kafka_broker, "/models/b")
    other.acquire()
    assert said[0].startswith(
        "taking over consumer group 'trainer' of topic 'events' from the model in /models/a"
    )
    assert "it stopped and released it" in said[0]
    _their_claim(kafka_broker, "/models/a")  # taken back (this one was paused too long)
    with pytest.raises(GroupClaimError, match="was taken over by the model in /models/a"):
        other.check()
    other.release()


def test_two_trainers_claiming_at_once_are_ordered_by_the_log(kafka_broker):
    first, second = _claim(kafka_broker, "/models/a"), _claim(kafka_broker, "/models/b")
    second._catch_up()  # it read the (empty) log, then the first claimed ...
    first.acquire()
    read_to_the_end = second._catch_up
    reads: list = []

    def stale_once(through=None):
        reads.append(through)
        if len(reads) > 1:
            read_to_the_end(through)

    second._catch_up = stale_once  # ... before it read again: both wrote "after nothing"
    with pytest.raises(GroupClaimError, match="is read by the model in /models/a"):
        second.acquire()
    assert reads[0] is None and reads[1] is not None  # it wrote, then read its record void
    assert _claim(kafka_broker, "/models/c")._current()["token"] == first.record["token"]
    first.release()


def test_the_password_comes_from_its_file_before_the_environment_and_needs_a_user(
    tmp_path, monkeypatch
):
    said = _warnings(monkeypatch)
    path = tmp_path / "pw"
    path.write_text("from-the-file\n")
    path.chmod(0o600)
    environ = {"NCF_KAFKA_PASSWORD": "from-the-environment", "NCF_KAFKA_USERNAME": "u"}
    access = resolve(KafkaOptions(servers="h:1", password_file=str(path)), environ)
    assert (access.username, access.password) == ("u", "from-the-file")
    assert said == [
        f"NCF_KAFKA_PASSWORD is ignored: the password comes from --kafka_password_file {path}"
    ]
    assert "from-the-file" not in repr(access)
    assert access.settings()["security.protocol"] == "SASL_PLAINTEXT"
    with pytest.raises(KafkaAccessError, match="a Kafka password is given .* but no user"):
        resolve(KafkaOptions(servers="h:1"), {"NCF_KAFKA_PASSWORD": "x"})
    path.write_text("")
    with pytest.raises(KafkaAccessError, match=f"--kafka_password_file {path} is empty"):
        resolve(KafkaOptions(servers="h:1", password_file=str(path)), {})
