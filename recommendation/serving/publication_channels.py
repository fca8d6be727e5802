"""Where publications travel (`publications`): the export folder (the default, nothing
but the folder), or a Kafka topic or Redis stream for many servers, each through the
client the project reads events with.

A channel has a trainer's side (a sink: ``write`` a publication, ``prune`` what no
kept version needs) and a server's side (a reader: ``read`` publication n of a run
once it is there, ``exists``, and ``seek`` to where a version's publications start).

- `Folder`: files in ``EXPORT_BASE/publications/`` (`publications.write`). A write
  that fails leaves nothing (one object, renamed or uploaded whole), so the trainer
  takes the publication again, with what came after it, under its number.
- `KafkaTopic`: one partition of a topic (created where missing), a publication in
  parts of at most 900 KB (the brokers' default largest message is 1 MB) keyed by its
  run, with headers ``run``, ``seq``, ``part``, ``parts``. A broker can have stored a
  message its producer heard no answer for, so a publication once sent is never taken
  again: it is sent again as it is until delivered (an outage said once), and a server
  keeps the first copy of each part. Kafka's retention prunes the topic: keep it
  longer than the time between two versions.
- `RedisStream`: a stream entry per publication (fields ``run``, ``seq``, ``data``),
  sent again as it is until Redis answers; trimmed (``XTRIM MINID``) to the newest
  version's copy time, less a minute for clocks that differ.

A server seeks a broker channel by time: the first publication after a version is
taken after the version's copy (``copied_at`` in its ``export_info.json``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import redis
from absl import logging

from recommendation.online.sources import kafka_connection
from recommendation.online.sources.kafka_connection import KafkaAccess, KafkaAccessError
from recommendation.online.sources.redis_connection import RedisAccess
from recommendation.serving import publications
from recommendation.serving.publications import Publication

_PART_BYTES = 900_000
# How far before a version's copy a server starts reading a broker channel, and a
# trimmed stream keeps: clocks of the trainer and the broker may differ by this.
_CLOCK_MARGIN_SECONDS = 60.0
# Waits between two sends of a publication a broker did not take.
_RETRY_SECONDS = (0.1, 0.5, 1.0, 2.0, 5.0)


class ChannelClosed(OSError):
    """A publication not delivered before its channel was closed."""


class Folder:
    """Publications as files beside the versions (module docstring).

    Args:
        export_base: The folder of versions.
    """

    takes_again = True  # a failed write leaves nothing a server could have read
    closing = False

    def __init__(self, export_base: str) -> None:
        self.export_base = export_base
        self.where = export_base

    def write(self, publication: Publication, data: bytes) -> None:
        publications.write(self.export_base, publication.run, publication.seq, data)

    def prune(self, needed: dict[str, int], copied_at: float) -> None:
        del copied_at
        publications.prune(self.export_base, needed)

    def seek(self, since: float) -> None:
        del since  # files are read by name

    def read(self, run: str, seq: int) -> Publication | None:
        return publications.read(self.export_base, run, seq)

    def exists(self, run: str, seq: int) -> bool:
        return publications.exists(self.export_base, run, seq)

    def close(self) -> None:
        pass


class _Resending:
    """Sends a publication again, as it is, until the broker takes it: an outage is
    said once, and its end."""

    takes_again = False  # a broker may hold what it did not confirm
    where = ""

    def __init__(self) -> None:
        self.closing = False
        self.outages = 0

    def write(self, publication: Publication, data: bytes) -> None:
        failed_since = None
        for attempt in itertools.count():
            try:
                self.send(publication, data)
                break
            except (OSError, redis.RedisError, KafkaAccessError) as error:
                if self.closing:
                    raise ChannelClosed(
                        f"publication {publication.seq} not sent: {error}"
                    ) from None
                if failed_since is None:
                    failed_since = time.monotonic()
                    self.outages += 1
                    logging.warning(
                        "cannot send publication %d to %s (%s); sending it again until it "
                        "is taken (said again once it is)",
                        publication.seq,
                        self.where,
                        error,
                    )
                time.sleep(_RETRY_SECONDS[min(attempt, len(_RETRY_SECONDS) - 1)])
        if failed_since is not None:
            logging.info(
                "%s took publication %d after %.1f s",
                self.where,
                publication.seq,
                time.monotonic() - failed_since,
            )

    def send(self, publication: Publication, data: bytes) -> None:
        raise NotImplementedError


class RedisStream(_Resending):
    """Publications in a Redis stream (module docstring).

    Args:
        access: The Redis (`redis_connection.resolve`).
        stream: The stream's key.
    """

    def __init__(self, access: RedisAccess, stream: str) -> None:
        super().__init__()
        self.access, self.stream = access, stream
        self.where = f"Redis stream {stream!r} at {access.shown}"
        self.client = access.client()
        self._last_id = "0-0"
        self._held: dict[tuple[str, int], bytes] = {}

    def send(self, publication: Publication, data: bytes) -> None:
        self.client.xadd(
            self.stream, {"run": publication.run, "seq": publication.seq, "data": data}
        )

    def prune(self, needed: dict[str, int], copied_at: float) -> None:
        del needed  # entries are in time order: all before the oldest version's copy
        oldest = int((copied_at - _CLOCK_MARGIN_SECONDS) * 1000)
        self.client.xtrim(self.stream, minid=f"{max(oldest, 0)}-0")

    def seek(self, since: float) -> None:
        self._last_id = f"{max(int((since - _CLOCK_MARGIN_SECONDS) * 1000), 0)}-0"
        self._held = {}

    def _drain(self) -> None:
        while True:
            found = self.client.xread({self.stream: self._last_id}, count=100)
            if not found:
                return
            for entry_id, fields in found[0][1]:
                self._last_id = entry_id
                key = (fields[b"run"].decode(), int(fields[b"seq"]))
                self._held.setdefault(key, fields[b"data"])

    def read(self, run: str, seq: int) -> Publication | None:
        self._drain()
        self._forget_before(run, seq)
        data = self._held.get((run, seq))
        return None if data is None else _decoded(data, f"{self.where} ({run}, {seq})", run, seq)

    def exists(self, run: str, seq: int) -> bool:
        self._drain()
        return (run, seq) in self._held

    def _forget_before(self, run: str, seq: int) -> None:
        for key in [key for key in self._held if key[0] != run or key[1] < seq]:
            del self._held[key]

    def close(self) -> None:
        self.closing = True
        self.client.close()


class KafkaTopic(_Resending):
    """Publications in partition 0 of a Kafka topic (module docstring).

    Args:
        access: The brokers (`kafka_connection.resolve`).
        topic: The topic.
    """

    def __init__(self, access: KafkaAccess, topic: str) -> None:
        super().__init__()
        self.access, self.topic = access, topic
        self.where = f"Kafka topic {topic!r} at {access.servers}"
        self._client = kafka_connection.client_module()
        self._producer: Any = None
        self._consumer: Any = None
        self._failed: list = []
        self._parts: dict[tuple[str, int], dict[int, bytes]] = {}
        self._counts: dict[tuple[str, int], int] = {}

    # -- the trainer's side ------------------------------------------------------

    def _produce_to(self) -> Any:
        if self._producer is None:
            self._ensure_topic()
            settings = self.access.settings(
                **{
                    "enable.idempotence": True,
                    "on_delivery": lambda error, message: error and self._failed.append(error),
                }
            )
            self._producer = self._client.Producer(settings)
        return self._producer

    def _ensure_topic(self) -> None:
        """Creates the topic with one partition where it is missing."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self.access.settings())
        if admin.list_topics(timeout=10).topics.get(self.topic) is None:
            try:
                admin.create_topics([NewTopic(self.topic, 1, -1)])[self.topic].result(30)
            except self._client.KafkaException as error:
                if error.args[0].code() != self._client.KafkaError.TOPIC_ALREADY_EXISTS:
                    raise

    def send(self, publication: Publication, data: bytes) -> None:
        try:
            producer = self._produce_to()
            self._failed = []
            parts = [data[i : i + _PART_BYTES] for i in range(0, len(data), _PART_BYTES)] or [b""]
            for number, part in enumerate(parts):
                headers = [
                    ("run", publication.run.encode()),
                    ("seq", str(publication.seq).encode()),
                    ("part", str(number).encode()),
                    ("parts", str(len(parts)).encode()),
                ]
                producer.produce(
                    self.topic, part, key=publication.run.encode(), partition=0, headers=headers
                )
            left = producer.flush(30)
        except self._client.KafkaException as error:
            raise KafkaAccessError(
                self.access.explain(error.args[0], f"writing {self.topic!r}")
            ) from None
        if left or self._failed:
            problem = self._failed[0].str() if self._failed else f"{left} parts unanswered"
            raise KafkaAccessError(self.access.scrub(problem))

    def prune(self, needed: dict[str, int], copied_at: float) -> None:
        del needed, copied_at  # the topic's retention prunes it

    # -- the server's side -------------------------------------------------------

    def seek(self, since: float) -> None:
        from confluent_kafka import TopicPartition

        if self._consumer is None:
            self._consumer = self._client.Consumer(
                self.access.settings(**{"group.id": "ncf-serve", "enable.auto.commit": False})
            )
        start = max(int((since - _CLOCK_MARGIN_SECONDS) * 1000), 0)
        try:
            [found] = self._consumer.offsets_for_times([TopicPartition(self.topic, 0, start)], 10)
            offset = found.offset if found.offset >= 0 else self._client.OFFSET_END
        except self._client.KafkaException:  # no such topic yet: all it will hold
            offset = self._client.OFFSET_BEGINNING
        self._consumer.assign([TopicPartition(self.topic, 0, offset)])
        self._parts, self._counts = {}, {}

    def _drain(self) -> None:
        while True:
            messages = self._consumer.consume(500, 0)
            for message in messages:
                if message.error() is not None:
                    continue
                headers = {key: value.decode() for key, value in message.headers() or ()}
                key = (headers["run"], int(headers["seq"]))
                self._parts.setdefault(key, {}).setdefault(int(headers["part"]), message.value())
                self._counts[key] = int(headers["parts"])
            if len(messages) < 500:
                return

    def read(self, run: str, seq: int) -> Publication | None:
        self._drain()
        for key in [key for key in self._parts if key[0] != run or key[1] < seq]:
            del self._parts[key], self._counts[key]
        parts = self._parts.get((run, seq), {})
        if len(parts) < self._counts.get((run, seq), 1) or not parts:
            return None
        data = b"".join(parts[number] for number in range(len(parts)))
        return _decoded(data, f"{self.where} ({run}, {seq})", run, seq)

    def exists(self, run: str, seq: int) -> bool:
        self._drain()
        return (run, seq) in self._parts

    def close(self) -> None:
        self.closing = True
        if self._producer is not None:
            self._producer.flush(10)
        if self._consumer is not None:
            self._consumer.close()


def _decoded(data: bytes, where: str, run: str, seq: int) -> Publication:
    publication = publications.decode(data, where)
    if (publication.run, publication.seq) != (run, seq):
        raise publications.PublicationError(
            f"{where} holds publication {publication.seq} of run {publication.run}"
        )
    return publication


# Where publications go and come from.
Channel = Folder | RedisStream | KafkaTopic


def make_channel(
    export_base: str,
    name: str | None,
    redis_access: RedisAccess | None,
    kafka_access: KafkaAccess | None,
) -> Channel:
    """The channel of a trainer or server: the folder, or stream or topic `name` of the
    broker given."""
    if not name:
        return Folder(export_base)
    if kafka_access is not None:
        return KafkaTopic(kafka_access, name)
    return RedisStream(redis_access, name)
