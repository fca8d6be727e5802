"""Kafka messages as events, and their dead letters.

A message's value is one event: a CSV line ``user,item,timestamp`` or a JSON object
(`event_parsing`'s rules, the event files' and Redis's). The common chunk, every value a
plain CSV line, converts at once in numpy (`message_events`); the rest one at a time.
`DeadLetterTopic` is the dead-letter sink on Kafka (`DeadLetterFile` is the other).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from absl import logging
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from recommendation.online.sources.dead_letters import payload_text
from recommendation.online.sources.event_parsing import (
    parse_event,
    parse_line,
    plain_csv_events,
    plain_csv_runs,
)

# Longest wait for the dead-letter topic to be read or a letter to land.
_WAIT_SECONDS = 15.0


def message_event(value: bytes | None) -> tuple[int, int, int]:
    """(user, item, timestamp) of one message's value (`parse_event`'s checks).

    Raises:
        ValueError: Saying what is wrong.
    """
    if value is None:
        raise ValueError("a message without a value (a tombstone)")
    if value.lstrip()[:1] == b"{":
        return parse_event(value)
    return parse_line(value, is_csv=True)


def message_events(values: list) -> tuple[np.ndarray, np.ndarray]:
    """`(events (n, 3) int64, plain (n,) bool)` of messages' values: where every value is
    a plain CSV line (`event_parsing.plain_csv_runs`), all at once; else none (rows of
    `events` undefined), left to `message_event` one by one."""
    count = len(values)
    events = np.zeros((count, 3), np.int64)
    try:
        text = b"\n".join(values) + b"\n"
    except TypeError:  # a tombstone (None)
        return events, np.zeros(count, bool)
    # A value holding a newline would be two lines: then the count is off.
    if plain_csv_runs(text) == [(0, len(text))] and text.count(b"\n") == count:
        return plain_csv_events(text, count)[0], np.ones(count, bool)
    return events, np.zeros(count, bool)


class DeadLetterTopic:
    """Writes malformed events to a Kafka topic, one JSON object each (``topic``, ``id``,
    ``error``, ``payload``, keyed by the id), once.

    Source ids are ``<partition>:<offset>``, increasing per partition in the order the
    source reads them, so an id at or before the last one the topic holds for its
    partition (of the same source topic) was recorded before a restart and is not
    written again: the topic is read once, at the first letter. Each letter is written
    and confirmed before training goes on (one round trip: malformed events are rare).

    Args:
        settings: librdkafka settings of its clients (`KafkaAccess.settings`).
        topic: The dead-letter topic.
        source_topic: The topic the letters come from.
    """

    def __init__(self, settings: dict, topic: str, source_topic: str) -> None:
        self.settings, self.topic, self.source_topic = settings, topic, source_topic
        self._last: dict[str, int] | None = None
        self._producer: Producer | None = None

    def _load(self) -> dict[str, int]:
        last: dict[str, int] = {}
        consumer = Consumer({**self.settings, "enable.auto.commit": False})
        try:
            metadata = consumer.list_topics(self.topic, timeout=_WAIT_SECONDS).topics[self.topic]
            for partition in metadata.partitions if metadata.error is None else ():
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(self.topic, partition), timeout=_WAIT_SECONDS, cached=False
                )
                consumer.assign([TopicPartition(self.topic, partition, low)])
                read_to = low
                while read_to < high:
                    # As many as are missing: consume waits for its count or its timeout.
                    missing = min(1000, high - read_to)
                    for message in consumer.consume(missing, _WAIT_SECONDS) or [None]:
                        if message is None:
                            raise KafkaException(
                                KafkaError(KafkaError._TIMED_OUT, f"{self.topic} not read")
                            )
                        read_to = message.offset() + 1
                        self._note(last, message.value())
        finally:
            consumer.close()
        return last

    def _note(self, last: dict[str, int], value: bytes | None) -> None:
        try:
            letter = json.loads(value)
            partition, _, offset = letter["id"].rpartition(":")
            if letter.get("topic") == self.source_topic:
                last[partition] = max(int(offset), last.get(partition, -1))
        except (TypeError, ValueError, KeyError, AttributeError):
            pass  # not one of ours

    def add(self, source_id: str, payload: Any, error: str) -> bool:
        """Records one malformed event unless it is already there; returns whether it
        was written now."""
        if self._last is None:
            self._last = self._load()
            self._producer = Producer({**self.settings, "linger.ms": 0, "acks": "all"})
        partition, _, offset = source_id.rpartition(":")
        if int(offset) <= self._last.get(partition, -1):
            return False
        letter = {
            "topic": self.source_topic,
            "id": source_id,
            "error": error,
            "payload": payload_text(payload),
        }
        failed: list = []
        self._producer.produce(
            self.topic,
            json.dumps(letter).encode(),
            key=source_id.encode(),
            on_delivery=lambda problem, _: failed.append(problem),
        )
        self._producer.flush(_WAIT_SECONDS)
        if failed[:1] != [None]:
            raise KafkaException(
                failed[0] if failed else KafkaError(KafkaError._TIMED_OUT, "dead letter")
            )
        self._last[partition] = int(offset)
        logging.log_every_n(logging.WARNING, "dead letter %s: %s", 100, source_id, error)
        return True
