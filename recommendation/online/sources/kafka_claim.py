"""One model per Kafka consumer group: `group_claim`'s claim, kept in a claims topic.

Kafka has no key to compare and set, and the commit metadata of a group's offsets (the
other place a record could live) is not kept by every broker. A topic is: the claims of
every topic and group are records of one single-partition topic, ``ncf-online.claims``
(created by the first trainer that needs it), keyed ``<topic>/<group>``, each a holder
record (`writer_lease.holder_record`) plus ``after``, the offset of the last valid
record of its key that its writer had read. A record is valid if that is still the
last valid one when it lands (the log's order decides, the same for every reader): a
compare and set, as Redis's WATCH and EXEC are. So two trainers that write at once are
ordered by the log, the second's record is void, and it reads the first's and decides
again. Every reader replays the same log to the same holder. Records whose predecessor
retention deleted begin the chain again (the first one read counts as valid).

A trainer writes a record when it takes the claim, on each renewal (every
`group_claim.RENEW_SECONDS`) and when it releases it; `check` (before each commit of
the group's offsets) reads the log to its end.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from recommendation.online.sources import kafka_connection
from recommendation.online.sources.group_claim import Claim

CLAIMS_TOPIC = "ncf-online.claims"
# Longest wait for the claims log to be read to its end or a record to land.
_WAIT_SECONDS = 15.0


def claim_key(topic: str, group: str) -> str:
    """The key of `group`'s claim of `topic` in the claims topic (Kafka topic names
    hold no ``/``)."""
    return f"{topic}/{group}"


class KafkaClaim(Claim):
    """`group_claim.Claim` kept in `CLAIMS_TOPIC` (module docstring).

    Args:
        access: The brokers (`kafka_connection.resolve`).
        topic, group, model_dir, renew_seconds, expire_seconds: `Claim`'s.
        claims_topic: The topic of the claims.
    """

    noun = "topic"
    failures = (KafkaException,)

    def __init__(
        self,
        access: kafka_connection.KafkaAccess,
        topic: str,
        group: str,
        model_dir: str,
        claims_topic: str = CLAIMS_TOPIC,
        **options: Any,
    ) -> None:
        super().__init__(
            topic, group, model_dir, f"{claims_topic}:{claim_key(topic, group)}", **options
        )
        self.access, self.claims_topic = access, claims_topic
        self._id = claim_key(topic, group).encode()
        self._lock = threading.Lock()  # the renewer and `check` share the log's reader
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._admin: AdminClient | None = None
        self._read_to = 0  # the next offset of the log to read
        self._start: int | None = None  # the log's first offset when it was first read
        self._last_valid = -1  # the offset of the last valid record of our key
        self._found: dict | None = None  # that record

    def _open(self) -> None:
        """The claims topic (created if missing) and its reader and writer."""
        if self._consumer is not None:
            return
        settings = self.access.settings(error_cb=kafka_connection.BrokerWatch(self.access))
        self._admin = AdminClient(settings)
        new = NewTopic(self.claims_topic, 1, -1)
        created = self._admin.create_topics([new])[self.claims_topic]
        try:
            created.result(_WAIT_SECONDS)
        except KafkaException as error:
            if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        self._consumer = Consumer({**settings, "group.id": self.group, "enable.auto.commit": False})
        partition = TopicPartition(self.claims_topic, 0)
        self._consumer.list_topics(self.claims_topic, timeout=_WAIT_SECONDS)
        self._start, _ = self._consumer.get_watermark_offsets(
            partition, timeout=_WAIT_SECONDS, cached=False
        )
        self._read_to = self._start
        self._consumer.assign([TopicPartition(self.claims_topic, 0, self._start)])
        self._producer = Producer({**settings, "linger.ms": 0, "acks": "all"})

    def _catch_up(self, through: int | None = None) -> None:
        """Reads the log through offset `through` (None: to its end now)."""
        self._open()
        if through is None:
            # Asked apart from the reader: a broker answers one connection's requests
            # in order, so the reader's would wait behind its own waiting fetch.
            partition = TopicPartition(self.claims_topic, 0)
            listed = self._admin.list_offsets({partition: OffsetSpec.latest()})[partition]
            end = listed.result(_WAIT_SECONDS).offset
        else:
            end = through + 1
        deadline = time.monotonic() + _WAIT_SECONDS
        while self._read_to < end:
            if time.monotonic() > deadline:
                raise KafkaException(
                    KafkaError(KafkaError._TIMED_OUT, f"{self.claims_topic} not read to {end}")
                )
            # As many as are missing: consume waits for its count or its timeout.
            for message in self._consumer.consume(min(1000, end - self._read_to), 0.5):
                if message.error() is None:
                    self._replay(message.offset(), message.key(), message.value())

    def _replay(self, offset: int, key: bytes | None, value: bytes | None) -> None:
        self._read_to = offset + 1
        if key != self._id:
            return
        try:
            record = json.loads(value)
            after = int(record["after"])
        except (TypeError, ValueError, KeyError):
            return  # not a claim
        first = self._last_valid < 0 and after < (self._start or 0)
        if after == self._last_valid or first:
            self._last_valid, self._found = offset, record

    def _append(self, record: dict) -> int:
        """Writes `record`; returns its offset."""
        landed: list = []
        value = json.dumps({**record, "after": self._last_valid}, sort_keys=True)
        self._producer.produce(
            self.claims_topic,
            value.encode(),
            key=self._id,
            partition=0,
            on_delivery=lambda error, message: landed.append((error, message)),
        )
        self._producer.flush(_WAIT_SECONDS)
        if not landed:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "claim not written"))
        error, message = landed[0]
        if error is not None:
            raise KafkaException(error)
        return message.offset()

    def _transact(self, decide: Callable[[dict | None], bool]) -> None:
        with self._lock:
            self._catch_up()
            while decide(self._found):
                offset = self._append(self.record)
                self._catch_up(through=offset)
                if self._last_valid == offset:
                    return  # it landed on the record it had read: valid

    def _current(self) -> dict | None:
        with self._lock:
            self._catch_up()
            return self._found

    def release(self) -> None:
        """`Claim.release`, then the log's reader and writer closed."""
        super().release()
        if self._consumer is not None:
            self._consumer.close()
