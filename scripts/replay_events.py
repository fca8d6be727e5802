"""Replays a MovieLens ratings file as a live event stream, in timestamp order.

    REDIS_PASSWORD=... python scripts/replay_events.py \
        --ratings ../shared/data/ml-1m/ratings.dat \
        --redis_url redis://localhost:6379/0 --stream events --rate 5000
    python scripts/replay_events.py --ratings ratings.csv --events_dir /tmp/events

Each rating becomes one event (user, item, timestamp): a Redis stream entry with
``user``, ``item`` and ``timestamp`` fields (``XADD``, pipelined), or a line
``user,item,timestamp`` appended to ``events-NNNNN.csv`` files in a folder (whole lines
only, a new file every --file_events events), the two sources `online_main` reads.
--rate paces publication (events per second; 0 = as fast as possible); --limit and
--skip select a slice of the time-ordered ratings. Redis is reached as the trainer
reaches it (`redis_connection`: the password from REDIS_PASSWORD or
--redis_password_file, TLS with rediss:// and --redis_ca_file, never printed).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import official  # noqa: F401  (before TensorFlow: it sets TensorFlow's environment)

# isort: split
import numpy as np
import redis
import tensorflow as tf
from absl import app, flags, logging

from official.utils.flags import core
from recommendation.data import movielens, ratings_readers
from recommendation.online.sources import redis_connection
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


def replay(
    publisher,
    events: np.ndarray,
    rate: float,
    chunk: int = 1000,
    on_chunk: Callable[[int], None] | None = None,
) -> float:
    """Publishes `events` in chunks at `rate` events/s (0: unpaced); returns seconds.

    Args:
        publisher: `RedisPublisher` or `DirectoryPublisher`.
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
    return time.perf_counter() - start


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line (defined on demand: the benchmark imports this module)."""
    flags.DEFINE_string(
        "ratings", None, "MovieLens ratings file (ratings.dat, ratings.csv, u.data)."
    )
    flags.DEFINE_enum("file_format", "auto", ["auto", *_FORMATS], "Layout of --ratings.")
    core.define_flags(redis_connection.REDIS_FLAGS, RedisOptions())
    flags.DEFINE_string("stream", "events", "Redis stream key.")
    flags.DEFINE_string("events_dir", None, "Publish CSV event files into this folder instead.")
    flags.DEFINE_integer("file_events", 1_000_000, "Events per file in --events_dir.")
    flags.DEFINE_float("rate", 0.0, "Events per second (0: as fast as possible).")
    flags.DEFINE_integer("skip", 0, "Skip this many events (in time order) first.")
    flags.DEFINE_integer("limit", None, "Publish at most this many events.")
    flags.mark_flag_as_required("ratings")
    flags.register_multi_flags_validator(
        ["redis_url", "events_dir"],
        lambda values: bool(values["redis_url"]) != bool(values["events_dir"]),
        message="give exactly one target: --redis_url redis://HOST:PORT/DB or --events_dir DIR",
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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        events = load_events(FLAGS.ratings, file_format_for(FLAGS.ratings, FLAGS.file_format))
        events = events[FLAGS.skip :][: FLAGS.limit]
        if FLAGS.redis_url:
            seconds, target = _replay_to_redis(events)
        else:
            target = FLAGS.events_dir
            logging.info("publishing %d events to %s", len(events), target)
            seconds = replay(DirectoryPublisher(target, FLAGS.file_events), events, FLAGS.rate)
    except (movielens.DataError, RedisAccessError) as error:
        sys.exit(f"error: {error}")
    print(
        f"published {len(events):,} events in {seconds:.1f} s "
        f"({len(events) / max(seconds, 1e-9):,.0f} events/s) to {target}"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=redis_connection.parse_flags)
