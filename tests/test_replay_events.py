"""scripts/replay_events.py: MovieLens ratings into a Redis stream, a Kafka topic or an
event folder, in timestamp order."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_ROWS, load_script, write_movielens

from recommendation.online import sources
from recommendation.online.sources.dead_letters import DeadLetterFile
from recommendation.online.sources.kafka_connection import KafkaAccessError, KafkaOptions, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "replay_events.py")
IN_TIME_ORDER = [(u, i) for u, i, _ in sorted(TINY_ROWS, key=lambda row: row[2])]


def _script():
    return load_script("replay_events")


def _run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_publishes_a_ratings_file_to_redis_in_time_order(redis_server, tmp_path):
    ratings = write_movielens(str(tmp_path / "ratings.dat"), TINY_ROWS, "dat")
    result = _run(f"--ratings={ratings}", f"--redis_url={redis_server.url}", "--rate=100")
    assert result.returncode == 0, result.stderr
    assert f"published {len(TINY_ROWS)} events" in result.stdout
    entries = redis_server.client().xrange("events")
    published = [(int(f[b"user"]), int(f[b"item"])) for _, f in entries]
    assert published == IN_TIME_ORDER


def test_publishes_to_kafka_keyed_by_user_each_users_events_in_order_in_one_partition(
    kafka_broker, tmp_path
):
    rng = np.random.default_rng(0)
    # 12 users' 120 ratings, interleaved in time; each timestamp twice (the stable order).
    rows = [(int(rng.integers(1, 13)), item, 1000 + item // 2) for item in range(120)]
    ratings = write_movielens(str(tmp_path / "ratings.dat"), rows, "dat")
    result = _run(
        f"--ratings={ratings}",
        f"--kafka_servers={kafka_broker.servers}",
        "--kafka_topic=ratings",
        "--kafka_partitions=3",
        "--rate=2000",
    )
    assert result.returncode == 0, result.stderr
    assert "published 120 events in" in result.stdout and "(3 partitions)" in result.stdout
    published = kafka_broker.messages("ratings", 120)  # each event once, none more
    assert all(published.values()), published  # all 3 partitions hold some users
    by_user: dict[int, list[tuple[int, int]]] = {}
    for partition, messages in published.items():
        for key, value in messages:
            user, item, timestamp = (int(field) for field in value.split(b","))
            assert key == str(user).encode()
            by_user.setdefault(user, []).append((item, timestamp, partition))
    for user, events in by_user.items():
        assert len({partition for _, _, partition in events}) == 1, user
        expected = [(item, stamp) for u, item, stamp in rows if u == user]  # time order
        assert [(item, stamp) for item, stamp, _ in events] == expected, user

    # A message the broker never confirms is an error, not a silent loss.
    replay = _script()
    access = resolve(KafkaOptions(servers=kafka_broker.servers), environ={})
    publisher = replay.KafkaPublisher(access, "ratings", flush_seconds=1)
    kafka_broker.kill()
    events = replay.load_events(ratings, replay.file_format_for(ratings, "dat"))
    with pytest.raises(KafkaAccessError, match=r"^5 events not delivered to Kafka topic"):
        replay.replay(publisher, events[:5], rate=0)


def test_event_folder_files_are_read_back_by_the_directory_source(tmp_path):
    replay = _script()
    ratings = write_movielens(str(tmp_path / "u.data"), TINY_ROWS, "u.data")
    events = replay.load_events(ratings, replay.file_format_for(ratings, "auto"))
    publisher = replay.DirectoryPublisher(str(tmp_path / "events"), file_events=4)
    seconds = replay.replay(publisher, events, rate=0, chunk=3)
    assert seconds >= 0 and sorted(os.listdir(tmp_path / "events")) == [
        "events-00000.csv",
        "events-00001.csv",
        "events-00002.csv",
    ]
    source = sources.DirectorySource(str(tmp_path / "events"), DeadLetterFile(str(tmp_path / "d")))
    chunk = source.read(100, 0.1)
    assert list(zip(chunk.users.tolist(), chunk.items.tolist(), strict=True)) == IN_TIME_ORDER
    assert np.all(np.diff(chunk.timestamps) >= 0)


@pytest.mark.integration
def test_bad_input_exits_with_one_clear_line(tmp_path):
    result = _run(f"--ratings={tmp_path / 'missing.dat'}", f"--events_dir={tmp_path}")
    last = result.stderr.strip().splitlines()[-1]  # TensorFlow's start-up notes come first
    assert result.returncode == 1 and last.startswith("error:") and "missing.dat" in last
