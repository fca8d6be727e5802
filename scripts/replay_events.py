"""Replays a MovieLens ratings file as a live event stream, in timestamp order.

    REDIS_PASSWORD=... python scripts/replay_events.py \
        --ratings ../shared/data/ml-1m/ratings.dat \
        --redis_url redis://localhost:6379/0 --stream events --rate 5000
    python scripts/replay_events.py --ratings ratings.dat \
        --kafka_servers localhost:9092 --kafka_topic events --kafka_partitions 3
    python scripts/replay_events.py --ratings ratings.csv --events_dir /tmp/events

Each rating becomes one event (user, item, timestamp): a Redis stream entry with
``user``, ``item`` and ``timestamp`` fields (``XADD``, pipelined), a Kafka message
whose value is ``user,item,timestamp`` keyed by the user (one user's events in one
partition, in order), or a line ``user,item,timestamp`` appended to
``events-NNNNN.csv`` files in a folder (whole lines only, a new file every
--file_events events): the sources `online_main` reads. --rate paces publication
(events per second; 0 = as fast as possible); --limit and --skip select a slice of the
time-ordered ratings. Redis and Kafka are reached as the trainer reaches them
(`redis_connection`, `kafka_connection`: the password from REDIS_PASSWORD or
--redis_password_file, NCF_KAFKA_PASSWORD or --kafka_password_file, never printed; TLS
files by flag). A Kafka topic that does not exist is created with --kafka_partitions
partitions; every message's delivery is confirmed, and one that is not delivered ends
the replay with an ``error:`` line.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Protocol

import official  # noqa: F401  (before TensorFlow: it sets TensorFlow's environment)

# isort: split
import numpy as np
import redis
import tensorflow as tf
from absl import app, flags, logging

from official.utils.flags import core
from recommendation.data import movielens, ratings_readers
from recommendation.online.sources import kafka_connection, redis_connection
from recommendation.online.sources.kafka_connection import (
    KafkaAccess,
    KafkaAccessError,
    KafkaOptions,
)
from recommendation.online.sources.redis_connection import RedisAccessError, RedisOptions

_FORMATS = {
    "dat": movielens.DAT_FORMAT,
    "csv": movielens.CSV_FORMAT,
    "u.data": movielens.U_DATA_FORMAT,
}


def file_format_for(path: str, name: str) -> movielens.FileFormat:
    """The layout `name` names, or (``auto``) the one the file name implies."""
    if name != "auto":
        return _FORMATS[name]
    for suffix, file_format in (("u.data", "u.data"), (".dat", "dat"), (".csv", "csv")):
        if path.endswith(suffix):
            return _FORMATS[file_format]
    raise movielens.DataError(
        f"cannot tell the format of {path}: pass --file_format dat, csv or u.data"
    )


def load_events(path: str, file_format: movielens.FileFormat) -> np.ndarray:
    """`(n, 3)` int64 (user, item, timestamp) rows in timestamp order (stable)."""
    ratings = ratings_readers.read_ratings_file(path, file_format)
    if ratings.timestamps is None:
        raise movielens.DataError(f"{path} has no timestamps to replay in order")
    order = np.argsort(ratings.timestamps, kind="stable")
    return np.stack([ratings.users, ratings.items, ratings.timestamps], axis=1)[order].astype(
        np.int64
    )


class Publisher(Protocol):
    """Where `replay` publishes."""

    def publish(self, events: np.ndarray) -> None:
        """Publishes `(n, 3)` (user, item, timestamp) rows, in order."""

    def flush(self) -> None:
        """Returns once everything published is stored (a replay's time includes it)."""


class RedisPublisher:
    """Appends events to a Redis stream, one entry per event, pipelined."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self.client, self.stream = client, stream

    def acl_rules(self) -> str:
        """The ACL rules that allow a Redis user what publishing sends."""
        return redis_connection.acl_rules(("ping", "xadd"), (self.stream,))

    def publish(self, events: np.ndarray) -> None:
        pipe = self.client.pipeline(transaction=False)
        for user, item, timestamp in events.tolist():
            pipe.xadd(self.stream, {"user": user, "item": item, "timestamp": timestamp})
        pipe.execute()

    def flush(self) -> None:
        """Nothing is held: each publish waits for its replies."""


class DirectoryPublisher:
    """Appends events as CSV lines to ``events-NNNNN.csv`` in a folder, starting a new
    file every `file_events` events."""

    def __init__(self, directory: str, file_events: int = 1_000_000) -> None:
        self.directory, self.file_events = directory, file_events
        self.written = 0
        tf.io.gfile.makedirs(directory)

    def publish(self, events: np.ndarray) -> None:
        while len(events):
            room = self.file_events - self.written % self.file_events
            part, events = events[:room], events[room:]
            name = f"events-{self.written // self.file_events:05d}.csv"
            lines = "".join(f"{u},{i},{t}\n" for u, i, t in part.tolist())
            with tf.io.gfile.GFile(os.path.join(self.directory, name), "a") as out:
                out.write(lines)
            self.written += len(part)

    def flush(self) -> None:
        """Nothing is held: each publish closes its file."""


class KafkaPublisher:
    """Writes events to a Kafka topic as messages ``user,item,timestamp`` (the values
    the Kafka source converts at once) keyed by the user: the partitioner hashes the
    key as Java clients do (murmur2), so one user's events land in one partition, and
    the producer is idempotent, so retries neither reorder nor repeat them.

    Every message's delivery is confirmed (librdkafka reports each failed one, after
    its retries): `publish` raises at the first failure, `flush` also where some are
    still undelivered after `flush_seconds`.

    Args:
        access: The brokers (`kafka_connection.resolve`).
        topic: The topic (`ensure_topic`).
        flush_seconds: Longest wait for the last deliveries.
    """

    def __init__(self, access: KafkaAccess, topic: str, flush_seconds: float = 60.0) -> None:
        self.access, self.topic, self.flush_seconds = access, topic, flush_seconds
        self.watch = kafka_connection.BrokerWatch(access)
        self.failed: list = []  # the errors of the messages not delivered
        settings = access.settings(
            **{
                "client.id": "replay_events",
                "enable.idempotence": True,
                "partitioner": "murmur2_random",
                "delivery.report.only.error": True,  # reports of the failed only: faster
                "on_delivery": self._report,
                "error_cb": self.watch,
            }
        )
        self.producer = kafka_connection.client_module().Producer(settings)

    def _report(self, error, message) -> None:
        del message  # reported once its retries failed: it is not in the topic
        self.failed.append(error)

    def publish(self, events: np.ndarray) -> None:
        produce = self.producer.produce
        for user, item, timestamp in events.tolist():
            value = b"%d,%d,%d" % (user, item, timestamp)
            while True:
                try:
                    produce(self.topic, value, key=b"%d" % user)
                    break
                except BufferError:  # the local queue is full: let the brokers take some
                    self.producer.poll(0.05)
                    self._raise_if_failed()
        self.producer.poll(0)  # serves the delivery reports
        self._raise_if_failed()

    def flush(self) -> None:
        left = self.producer.flush(self.flush_seconds)
        self._raise_if_failed()
        if left:
            raise KafkaAccessError(
                f"{left:,} events not delivered to Kafka topic {self.topic!r} at "
                f"{self.access.servers} in {self.flush_seconds:.0f} s: check the brokers "
                "and publish again"
            )

    def _raise_if_failed(self) -> None:
        problem = self.watch.refused or (self.failed[0] if self.failed else None)
        if problem is not None:
            raise KafkaAccessError(
                self.access.explain(problem, f"publishing to topic {self.topic!r}")
                + f"; {len(self.failed):,} events not delivered so far, and the replay stopped"
            )


def ensure_topic(access: KafkaAccess, topic: str, partitions: int | None) -> int:
    """Creates `topic` with `partitions` partitions where it does not exist (says so
    where it exists with another count: partitions are never taken away); returns its
    partition count.

    Raises:
        KafkaAccessError: The brokers cannot be reached or refuse, or the topic does not
            exist and `partitions` is None.
    """
    client = kafka_connection.client_module()
    from confluent_kafka.admin import AdminClient, NewTopic

    watch = kafka_connection.BrokerWatch(access)
    admin = AdminClient(access.settings(error_cb=watch))
    try:
        # Every topic: asking for one by name may create it with the broker's defaults.
        found = admin.list_topics(timeout=10).topics.get(topic)
        if found is None and partitions:
            try:
                admin.create_topics([NewTopic(topic, partitions, -1)])[topic].result(30)
                logging.info("created Kafka topic %r with %d partitions", topic, partitions)
            except client.KafkaException as error:
                if error.args[0].code() != client.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
            found = admin.list_topics(timeout=10).topics.get(topic)
    except client.KafkaException as error:
        raise KafkaAccessError(
            access.explain(
                watch.refused or watch.last or error.args[0], f"publishing to topic {topic!r}"
            )
        ) from None
    if found is None:
        raise KafkaAccessError(
            f"Kafka topic {topic!r} does not exist at {access.servers}: pass "
            "--kafka_partitions N to create it with N partitions"
        )
    if partitions and len(found.partitions) != partitions:
        logging.warning(
            "Kafka topic %r exists with %d partitions, not --kafka_partitions %d: "
            "publishing to its %d",
            topic,
            len(found.partitions),
            partitions,
            len(found.partitions),
        )
    return len(found.partitions)


def replay(
    publisher: Publisher,
    events: np.ndarray,
    rate: float,
    chunk: int = 1000,
    on_chunk: Callable[[int], None] | None = None,
) -> float:
    """Publishes `events` in chunks at `rate` events/s (0: unpaced); returns seconds,
    the last chunk stored included.

    Args:
        publisher: `RedisPublisher`, `KafkaPublisher` or `DirectoryPublisher`.
        events: `(n, 3)` rows to publish, in order.
        rate: Events per second, or 0.
        chunk: Events per publish call (smaller chunks pace more smoothly).
        on_chunk: Called with the number published so far after each chunk.
    """
    start = time.perf_counter()
    if rate:
        chunk = max(1, min(chunk, int(rate / 20)))  # at least 20 chunks a second
    for offset in range(0, len(events), chunk):
        if rate:
            delay = start + offset / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        publisher.publish(events[offset : offset + chunk])
        if on_chunk is not None:
            on_chunk(min(offset + chunk, len(events)))
    publisher.flush()
    return time.perf_counter() - start


FLAGS = flags.FLAGS
_TARGETS = ("redis_url", "kafka_servers", "events_dir")


def define_flags() -> None:
    """The command line (defined on demand: the benchmark imports this module)."""
    flags.DEFINE_string(
        "ratings", None, "MovieLens ratings file (ratings.dat, ratings.csv, u.data)."
    )
    flags.DEFINE_enum("file_format", "auto", ["auto", *_FORMATS], "Layout of --ratings.")
    core.define_flags(redis_connection.REDIS_FLAGS, RedisOptions())
    flags.DEFINE_string("stream", "events", "Redis stream key.")
    core.define_flags(kafka_connection.KAFKA_FLAGS, KafkaOptions())
    flags.DEFINE_string("kafka_topic", "events", "Kafka topic.")
    flags.DEFINE_integer(
        "kafka_partitions",
        None,
        "Create --kafka_topic with this many partitions where it does not exist.",
    )
    flags.DEFINE_string("events_dir", None, "Publish CSV event files into this folder instead.")
    flags.DEFINE_integer("file_events", 1_000_000, "Events per file in --events_dir.")
    flags.DEFINE_float("rate", 0.0, "Events per second (0: as fast as possible).")
    flags.DEFINE_integer("skip", 0, "Skip this many events (in time order) first.")
    flags.DEFINE_integer("limit", None, "Publish at most this many events.")
    flags.mark_flag_as_required("ratings")
    flags.register_multi_flags_validator(
        list(_TARGETS),
        lambda values: [bool(values[name]) for name in _TARGETS].count(True) == 1,
        message="give exactly one target: --redis_url redis://HOST:PORT/DB, --kafka_servers "
        "HOST:PORT or --events_dir DIR",
    )
    flags.register_validator(
        "kafka_partitions",
        lambda value: value is None or value > 0,
        message="--kafka_partitions must be positive",
    )
    flags.register_validator(
        "rate", lambda value: value >= 0, message="--rate must not be negative"
    )
    flags.register_validator(
        "skip", lambda value: value >= 0, message="--skip must not be negative"
    )
    flags.register_validator(
        "limit", lambda value: value is None or value > 0, message="--limit must be positive"
    )


def _replay_to_redis(events: np.ndarray) -> tuple[float, str]:
    """Publishes `events` to the Redis of the flags; returns seconds and the URL shown."""
    access = redis_connection.resolve(
        core.config_from_flags(redis_connection.REDIS_FLAGS, RedisOptions(), FLAGS)
    )
    publisher = RedisPublisher(access.client(), FLAGS.stream)
    with access.errors_explained(publisher.acl_rules()):
        publisher.client.ping()
        logging.info("publishing %d events to %s", len(events), access.shown)
        return replay(publisher, events, FLAGS.rate), access.shown


def _replay_to_kafka(events: np.ndarray) -> tuple[float, str]:
    """Publishes `events` to the Kafka topic of the flags (created if missing);
    returns seconds and the topic shown."""
    access = kafka_connection.resolve(
        core.config_from_flags(kafka_connection.KAFKA_FLAGS, KafkaOptions(), FLAGS)
    )
    partitions = ensure_topic(access, FLAGS.kafka_topic, FLAGS.kafka_partitions)
    target = f"Kafka topic {FLAGS.kafka_topic!r} ({partitions} partitions) at {access.servers}"
    logging.info("publishing %d events to %s", len(events), target)
    return replay(KafkaPublisher(access, FLAGS.kafka_topic), events, FLAGS.rate), target


def main(argv: list[str]) -> None:
    del argv  # redis_connection.parse_flags refuses arguments that are not flags
    try:
        events = load_events(FLAGS.ratings, file_format_for(FLAGS.ratings, FLAGS.file_format))
        events = events[FLAGS.skip :][: FLAGS.limit]
        if FLAGS.redis_url:
            seconds, target = _replay_to_redis(events)
        elif FLAGS.kafka_servers:
            seconds, target = _replay_to_kafka(events)
        else:
            target = FLAGS.events_dir
            logging.info("publishing %d events to %s", len(events), target)
            seconds = replay(DirectoryPublisher(target, FLAGS.file_events), events, FLAGS.rate)
    except (movielens.DataError, RedisAccessError, KafkaAccessError) as error:
        sys.exit(f"error: {error}")
    print(
        f"published {len(events):,} events in {seconds:.1f} s "
        f"({len(events) / max(seconds, 1e-9):,.0f} events/s) to {target}"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=redis_connection.parse_flags)
