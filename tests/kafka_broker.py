"""A real Kafka-protocol broker for the tests: tansu (``scripts/tansu_broker.py``, which
the online benchmark starts too) on a free local port with memory storage (a restart
empties it, as a broker whose disks were lost would be). Where the wheel or the client
is missing, the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import functools
import time

import pytest
from conftest import load_script

tansu_broker = load_script("tansu_broker")


class KafkaBroker(tansu_broker.TansuBroker):
    """`tansu_broker.TansuBroker` with what the tests do to it: topics created and
    deleted, messages written to chosen partitions."""

    def start(self, wait_seconds: float = 20.0) -> None:
        """Starts it; skips the test where there is no broker for this machine."""
        try:
            super().start(wait_seconds)
        except tansu_broker.BrokerMissing as missing:
            pytest.skip(str(missing))

    def create_topic(self, topic: str, partitions: int) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self.settings())
        admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(20)

    def delete_topic(self, topic: str) -> None:
        from confluent_kafka.admin import AdminClient

        AdminClient(self.settings()).delete_topics([topic])[topic].result(20)

    def produce(self, topic: str, values: list[tuple[int, bytes]]) -> list[str]:
        """Writes `(partition, value)` messages in order; returns their source ids
        (``partition:offset``)."""
        from confluent_kafka import Producer

        producer = Producer(self.settings(**{"linger.ms": 5}))
        ids: list[str | None] = [None] * len(values)

        def landed(index: int, error, message) -> None:
            assert error is None, error
            ids[index] = f"{message.partition()}:{message.offset()}"

        for index, (partition, value) in enumerate(values):
            on_delivery = functools.partial(landed, index)
            producer.produce(topic, value, partition=partition, on_delivery=on_delivery)
            producer.poll(0)
        producer.flush(30)
        assert None not in ids
        return ids

    def messages(self, topic: str, count: int) -> dict[int, list[tuple[bytes, bytes]]]:
        """Every message of `topic` as `(key, value)` by partition, in offset order,
        read until half a second passes without one after `count`; fails unless there
        are exactly `count`."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(self.settings(**{"group.id": "reader"}))
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, partition, 0) for partition in partitions])
        found: dict[int, list[tuple[bytes, bytes]]] = {partition: [] for partition in partitions}
        read, deadline = 0, time.monotonic() + 30
        while time.monotonic() < deadline:
            messages = [m for m in consumer.consume(1000, 0.5) if m.error() is None]
            for message in messages:
                found[message.partition()].append((message.key(), message.value()))
            read += len(messages)
            if read >= count and not messages:  # a quiet half second after the last
                break
        consumer.close()
        assert read == count, (read, count)
        return found
