"""`KafkaSource`: events from every partition of a Kafka topic, assigned to the trainer
(no group rebalancing), resumed from the offsets its checkpoint holds (`sources` says
what every source does).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from absl import logging
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from recommendation.online.sources import kafka_connection
from recommendation.online.sources.event_parsing import EventChunk
from recommendation.online.sources.kafka_claim import KafkaClaim
from recommendation.online.sources.kafka_connection import KafkaAccess, KafkaAccessError
from recommendation.online.sources.kafka_messages import message_event, message_events

# Longest wait for one metadata or offsets request.
_REQUEST_SECONDS = 10.0
# What a warning about lost events advises.
LOST_ADVICE = (
    "raise the topic's retention (retention.ms, retention.bytes) above the trainer's "
    "longest lag or stop, or shorten those"
)


class KafkaSource:
    """Events from every partition of `topic`, each partition assigned with the offset to
    read next (``Consumer.assign``: a consumer group's rebalancing would hand partitions
    to whichever member joined, and joins slowly); partitions added while it runs are
    found by re-reading the topic's metadata every `metadata_seconds`.

    The position is ``{"topic_id": the topic's id (None where the broker has none),
    "offsets": {partition: next offset}, "dead_letters": count, "lost_events": count,
    "lost_events_exact": bool}``: a restore reads each partition from its offset, so
    that what a checkpoint holds is never read again and what it does not is. A
    partition the position does not name is read from its start (a model with no
    checkpoint reads the whole topic, as a new Redis group does). `commit` commits the
    checkpoint's offsets as the group's (what lag tools show); the checkpoint, not the
    group, is what a restart resumes from. Source ids are ``<partition>:<offset>``.

    Events no longer in the topic are counted in `lost_events` (the total over restarts)
    with a warning, never skipped in silence:

    - deleted by retention before the trainer read them (the offset to read is below
      the partition's first one, at a restore or while running): counted exactly, the
      first offset less the offset to read;
    - in a topic deleted and created again (its id changed, at a restore or while
      running; a broker that came back without its data is one): every partition is
      read from its start, and the old topic's events after the offsets read cannot
      be counted: `lost_events_exact` turns False;
    - where the broker keeps no topic ids, an offset past a partition's end says the
      same (an id, where there is one, is the sure sign: some brokers report a high
      watermark behind records already read).

    After any error from the brokers (a connection lost, every broker down), every
    partition is unassigned (what was fetched is dropped) until a metadata request
    succeeds and the topic's id (or, without ids, each partition's end) is checked: a
    broker that came back with a new log would otherwise hand over its records at the
    old offsets, trained and then read again from the start (or, without ids,
    skipped). A topic gone from the metadata is unassigned until it is back, then
    checked the same way.

    Malformed events go to `dead_letters` (a `DeadLetterFile` or a `DeadLetterTopic`),
    once each, and are counted. librdkafka reconnects on its own: an outage is said
    once and counted in `reconnects` (`kafka_connection.BrokerWatch`); a refused login
    or right raises `KafkaAccessError`.

    Args:
        access: The brokers (`kafka_connection.resolve`).
        topic, group: The topic and the consumer group whose offsets `commit` sets.
        dead_letters: The dead-letter sink (``add(source_id, payload, error)``).
        claim: This model's claim of the group, checked before each commit and released
            at `close`; None: the group is shared.
        metadata_seconds: Seconds between reads of the topic's metadata.
    """

    def __init__(
        self,
        access: KafkaAccess,
        topic: str,
        group: str,
        dead_letters: Any,
        claim: KafkaClaim | None = None,
        metadata_seconds: float = 5.0,
    ) -> None:
        self.access, self.topic, self.group = access, topic, group
        self.dead_letter_sink, self.claim = dead_letters, claim
        self.metadata_seconds = metadata_seconds
        self.watch = kafka_connection.BrokerWatch(access)
        self.settings = access.settings(
            **{
                "group.id": group,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # An offset out of range is an error event here (counted), never reset.
                "auto.offset.reset": "error",
                # librdkafka stops fetching a partition whose local queue holds
                # queued.min.messages (100,000) for this long (default 1 s): a trainer
                # that reads faster waited a second for each 100,000 events or so.
                "fetch.queue.backoff.ms": 10,
                "error_cb": self.watch,
            }
        )
        self.dead_letters = 0
        self.lost_events = 0
        self.lost_events_exact = True
        self.exhausted = False  # a topic never ends
        self.topic_id: str | None = None
        self._next: dict[int, int] = {}  # partition -> the offset to read next
        # Partitions whose offset is checked against the log before it is read from (a
        # restore gave it, or the partition was unassigned after a broker error).
        self._unchecked: set[int] = set()
        self._assigned: set[int] = set()
        self._next_metadata = 0.0
        self._errors_checked = 0  # the broker errors met before the last metadata read
        self._missing_said = False
        self._consumer: Consumer | None = None
        self._admin: AdminClient | None = None

    @property
    def reconnects(self) -> int:
        """Outages met (each said once)."""
        return self.watch.outages

    def connect(self) -> None:
        """Opens the clients and checks that the brokers answer.

        Raises:
            KafkaAccessError: They cannot be reached, or refuse this program.
        """
        self._consumer = Consumer(self.settings)
        self._admin = AdminClient(self.settings)
        deadline = time.monotonic() + _REQUEST_SECONDS
        while True:
            try:
                self._consumer.list_topics(self.topic, timeout=1.0)
                break
            except KafkaException as error:
                problem = error.args[0]
            self._consumer.poll(0)  # serves the error callback
            if self.watch.refused or self.watch.down or time.monotonic() > deadline:
                raise KafkaAccessError(
                    self.access.explain(
                        self.watch.refused or self.watch.last or problem,
                        f"connecting for topic {self.topic!r}",
                    )
                )
        self.watch.answered()
        logging.info("reading topic %r of Kafka at %s", self.topic, self.access.servers)

    def restore(self, position: dict | None) -> None:
        """Resumes after `position` (None: from each partition's start)."""
        position = position or {}
        self.dead_letters = position.get("dead_letters", 0)
        self.lost_events = position.get("lost_events", 0)
        self.lost_events_exact = position.get("lost_events_exact", True)
        self.topic_id = position.get("topic_id")
        self._next = {int(p): offset for p, offset in position.get("offsets", {}).items()}
        self._unchecked = set(self._next)
        if self._assigned:
            self._consumer.unassign()
        self._assigned = set()
        self._next_metadata = 0.0

    def _position(self) -> dict:
        return {
            "topic_id": self.topic_id,
            "offsets": {str(p): offset for p, offset in sorted(self._next.items())},
            "dead_letters": self.dead_letters,
            "lost_events": self.lost_events,
            "lost_events_exact": self.lost_events_exact,
        }

    def read(self, max_events: int, timeout: float) -> EventChunk | None:
        self._raise_if_refused()
        errors = self.watch.errors
        if errors != self._errors_checked:
            self._unassign()  # what was fetched may come from a log that started again
        if errors != self._errors_checked or time.monotonic() >= self._next_metadata:
            if self._refresh():
                self._errors_checked = errors
        if not self._assigned:
            self._consumer.poll(0)  # serves the error callback (nothing is assigned)
            time.sleep(timeout)
            return None
        consumed = self._consumer.consume(max_events, timeout)
        messages = [message for message in consumed if message.error() is None]
        if len(messages) < len(consumed):  # rare: one pass over the errors apart
            for message in consumed:
                if message.error() is not None:
                    self._message_error(message)
        self._raise_if_refused()
        if not messages:
            return None
        try:
            return self._parse(messages)
        except KafkaException as error:  # a dead letter not written: read them again
            logging.warning(
                "cannot write a dead letter (%s); reading the chunk again",
                self.access.scrub(str(error)),
            )
            for partition in {message.partition() for message in messages}:
                offset = self._next.get(partition, OFFSET_BEGINNING)
                self._consumer.seek(TopicPartition(self.topic, partition, offset))
            return None

    def _raise_if_refused(self) -> None:
        if self.watch.refused is not None:
            raise KafkaAccessError(
                self.access.explain(self.watch.refused, f"reading topic {self.topic!r}")
                + "; training stopped, and the same command resumes from the last checkpoint"
            )

    def _parse(self, messages: list) -> EventChunk:
        """Converts messages and dead-letters the malformed ones; the source's state
        changes only once that is done."""
        # Each message's fields read once (a call each, a million a second).
        values = [message.value() for message in messages]
        partitions = [message.partition() for message in messages]
        offsets = [message.offset() for message in messages]
        ids = [f"{p}:{offset}" for p, offset in zip(partitions, offsets, strict=True)]
        events, good = message_events(values)
        dead = 0
        for index in np.flatnonzero(~good):
            try:
                events[index] = message_event(values[index])
            except ValueError as error:
                self.dead_letter_sink.add(ids[index], values[index] or b"", str(error))
                dead += 1
                continue
            good[index] = True
        self.dead_letters += dead
        # In offset order within each partition: the dictionary keeps each one's last.
        for partition, offset in dict(zip(partitions, offsets, strict=True)).items():
            self._next[partition] = offset + 1
        good_ids = ids if not dead else [ids[i] for i in np.flatnonzero(good)]
        events = events[good]
        return EventChunk(events[:, 0], events[:, 1], events[:, 2], good_ids, self._position())

    def _message_error(self, message) -> None:
        code = message.error().code()
        if code == KafkaError._AUTO_OFFSET_RESET and message.partition() is not None:
            self._out_of_range(message.partition())
        elif code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION):
            self._next_metadata = 0.0  # the topic is gone: see what is there
        elif code != KafkaError._PARTITION_EOF:
            logging.warning(
                "Kafka topic %r: %s", self.topic, self.access.scrub(message.error().str())
            )

    def _refresh(self) -> bool:
        """Reads the topic's metadata: its id (a new one: the topic was created again)
        and partitions (new ones are assigned; all of them unassigned while the topic
        is missing). Returns whether the brokers answered."""
        self._next_metadata = time.monotonic() + self.metadata_seconds
        try:
            # Short: while the brokers are down, each try holds the training loop.
            metadata = self._consumer.list_topics(self.topic, timeout=2.0)
        except KafkaException:
            return False  # the error callback says the outage
        self.watch.answered()
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None:
            if not self._missing_said:
                logging.warning("Kafka topic %r does not exist: waiting for it", self.topic)
            self._missing_said = True
            self._unassign()
            return True
        self._missing_said = False
        topic_id = self._topic_id()
        if topic_id and self.topic_id and topic_id != self.topic_id:
            self._recreated(self.topic_id, topic_id)
        self.topic_id = topic_id or self.topic_id
        added = sorted(set(topic.partitions) - self._assigned)
        if added:
            starts = [TopicPartition(self.topic, p, self._start(p, topic_id)) for p in added]
            self._consumer.incremental_assign(starts)
            self._assigned.update(added)
        return True

    def _unassign(self) -> None:
        """Drops every partition's assignment (and what was fetched for it); each one
        assigned again is checked against the broker's log first (`_start`)."""
        if self._assigned:
            self._consumer.unassign()
        self._assigned, self._unchecked = set(), set(self._next)

    def _topic_id(self) -> str | None:
        """The topic's id, or None where the broker keeps none (before Kafka 2.8)."""
        try:
            described = self._admin.describe_topics(TopicCollection([self.topic]))[self.topic]
            topic_id = described.result(_REQUEST_SECONDS).topic_id
        except KafkaException:
            return None
        return str(topic_id) if topic_id is not None else None

    def _recreated(self, old: str, new: str) -> None:
        """The topic was deleted and created again: every partition from its start."""
        self.lost_events_exact = False
        logging.warning(
            "Kafka topic %r was deleted and created again (id %s, now %s): its events after "
            "the offsets the trainer had read (%s) are lost and cannot be counted, so lost "
            "events leave them out; reading the new topic from its start",
            self.topic,
            old,
            new,
            ", ".join(f"partition {p} at {o:,}" for p, o in sorted(self._next.items())) or "none",
        )
        self._unassign()
        self._next, self._unchecked = {}, set()

    def _start(self, partition: int, topic_id: str | None) -> int:
        """Where to read `partition` from: its restored (or unassigned) offset unless
        retention deleted it (counted) or, without topic ids, it is past the end; else
        its start."""
        if partition not in self._next:
            return OFFSET_BEGINNING
        offset = self._next[partition]
        if partition not in self._unchecked:
            return offset
        low, high = self._watermarks(partition)
        if offset < low:
            self._count_deleted(partition, offset, low)
            return low
        if offset > high and topic_id is None:
            self._past_the_end(partition, offset, high)
            return low
        return offset

    def _watermarks(self, partition: int) -> tuple[int, int]:
        """`partition`'s first offset and the offset after its last, as the broker says."""
        return self._consumer.get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=_REQUEST_SECONDS, cached=False
        )

    def _out_of_range(self, partition: int) -> None:
        """The broker refused the offset to read (retention deleted it, or the partition
        was truncated): counted as `_start` does, and read on from its start."""
        offset = self._next.get(partition)
        low, high = self._watermarks(partition)
        if offset is not None and offset < low:
            self._count_deleted(partition, offset, low)
        elif offset is not None:
            self._past_the_end(partition, offset, high)
        self._consumer.seek(TopicPartition(self.topic, partition, low))

    def _count_deleted(self, partition: int, offset: int, low: int) -> None:
        self.lost_events += low - offset
        self._next[partition] = low  # checkpointed with the count: never counted twice
        logging.warning(
            "%s events of partition %d of Kafka topic %r (offsets %s to %s) were deleted "
            "before the trainer read them: they are not trained (%s lost events in all); %s",
            f"{low - offset:,}",
            partition,
            self.topic,
            f"{offset:,}",
            f"{low - 1:,}",
            f"{self.lost_events:,}",
            LOST_ADVICE,
        )

    def _past_the_end(self, partition: int, offset: int, high: int) -> None:
        self.lost_events_exact = False
        self._next.pop(partition, None)
        logging.warning(
            "partition %d of Kafka topic %r ends at offset %s, before %s, the next the "
            "trainer was to read: the topic was created again or truncated, and what it "
            "held after that offset cannot be counted (lost events leave it out); reading "
            "the partition from its start",
            partition,
            self.topic,
            f"{high:,}",
            f"{offset:,}",
        )

    def commit(self, position: dict | None) -> None:
        """Commits `position`'s offsets (the checkpointed ones) as the group's, for lag
        tools; nothing where the topic was created again since."""
        if not position or position.get("topic_id") != self.topic_id:
            return
        offsets = [
            TopicPartition(self.topic, int(p), offset)
            for p, offset in position.get("offsets", {}).items()
        ]
        try:
            if self.claim is not None:
                self.claim.check()  # another model's group now: commit nothing
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as error:
            # Only lag tools read them: the next commit sets them.
            logging.warning(
                "cannot commit the group's offsets (%s); the next commit sets them",
                self.access.scrub(str(error)),
            )

    def close(self) -> None:
        """Releases the claim and closes the clients."""
        if self.claim is not None:
            self.claim.release()
        if self._consumer is not None:
            self._consumer.close()
