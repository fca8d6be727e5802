"""The trainer's side of publications (`serving.publications`): what the model changed
since its last publication, taken between sinks and written on a thread of its own.

Taking one costs what changed: the rows written since (found by the tables' write
stamps, `table_changes.written_since`) are gathered on the training thread, with the
dense weights (kilobytes); what follows (which ids left the tables, the archive, the
write) runs on the publisher's thread, so that training goes on meanwhile. One
publication is in flight at a time: while it is being written, the changes of the
next ones gather in the tables and go out together in the next.

A publication goes to one channel (`publication_channels`): files beside the
versions, or a Kafka topic or Redis stream. One that cannot be written to a folder (a
full disk) is counted and logged (`WriteFailures`), and the next one is taken from
where the failed one started, under its number: the chain a server follows never has
a gap. A broker's channel sends it again as it is until it is taken. `flush` makes the
chain durable up to the model as it is now, which a full version needs before it says
it holds the state of the chain's last publication.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from official.core import writer_lease
from official.utils.misc.write_failures import WriteFailures
from recommendation.online.online_ncf import OnlineNeuMF
from recommendation.serving import publication_channels, publications
from recommendation.serving.online_version import dense_weights
from recommendation.serving.publications import TABLES, Publication


def _tables(network: OnlineNeuMF) -> dict:
    return dict(zip(TABLES, (network.user_embedding, network.item_embedding), strict=True))


@dataclasses.dataclass
class _InFlight:
    """A publication handed to the publisher's thread, and where it started."""

    future: concurrent.futures.Future
    seq: int
    since: dict[str, int]


class Publisher:
    """Publishes the changes of `network` into `export_base` as publications of `run`.

    Args:
        export_base: The folder of versions.
        run: This trainer run's token.
        network: The model whose changes are published.
        keys: Each table's ids by row (``0..size``) in the state the chain starts from
            (the run's first full version), to tell which ids later leave the tables.
        channel: Where they go (`publication_channels`; None: ``publications/`` in
            `export_base`).
        on_written: Called on the publisher's thread with each publication once it is
            written, in order (the exporter keeps its version up to date with them).
    """

    def __init__(
        self,
        export_base: str,
        run: str,
        network: OnlineNeuMF,
        keys: dict[str, np.ndarray],
        channel: publication_channels.Channel | None = None,
        on_written: Callable[[Publication], None] | None = None,
    ) -> None:
        self.export_base, self.run, self.network = export_base, run, network
        self.on_written = on_written
        self.channel = channel or publication_channels.Folder(export_base)
        self.seq = 0  # of the last publication taken
        self.durable_seq = 0  # of the last one written
        self.bytes_written = 0  # of every publication written
        self.rows: list[int] = []  # of each publication written
        self.seconds: list[float] = []  # from its take to its write, of each
        self.failures = WriteFailures(
            "a publication",
            self.channel.where,
            "--export_dir" if self.channel.takes_again else "--publication_channel",
        )
        self._since = {name: int(table.step.numpy()) for name, table in _tables(network).items()}
        self._keys = {name: np.array(keys[name], np.int64) for name in TABLES}
        self._held = {name: len(self._keys[name]) - 1 for name in TABLES}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "ncf-publisher")
        self._in_flight: _InFlight | None = None

    @property
    def busy(self) -> bool:
        """Whether a publication is being written."""
        return self._in_flight is not None and not self._in_flight.future.done()

    @property
    def pending(self) -> bool:
        """Whether the model trained since the last publication taken."""
        tables = _tables(self.network)
        return any(int(tables[name].step.numpy()) != self._since[name] for name in TABLES)

    def publish(self, step: int, position: Any) -> bool:
        """Takes what changed since the last publication and hands it to the publisher's
        thread, unless one is still being written or nothing changed; returns whether it
        did. Call between steps (on a cluster, once the steps in flight are done)."""
        if self.busy:
            return False
        self._settle()
        if not self.pending:
            return False
        since = dict(self._since)
        publication = self._take(step, position)
        future = self._executor.submit(self._write, publication, time.perf_counter())
        self._in_flight = _InFlight(future, publication.seq, since)
        return True

    def flush(self, step: int, position: Any, timeout: float | None = None) -> bool:
        """Publishes what is pending and waits (at most `timeout` s each time) until the
        chain is written up to the model as it is now (one retry of a failed write);
        returns whether it is."""
        for _ in range(2):
            if not self.wait(timeout):
                return False  # a broker that does not take it: the next version waits
            self._settle()
            if not self.pending:
                return True
            self.publish(step, position)
        done = self.wait(timeout)
        if done:
            self._settle()
        return done and not self.pending

    def wait(self, timeout: float | None = None) -> bool:
        """Waits (at most `timeout` s) for the publication in flight; returns whether
        none is in flight."""
        if self._in_flight is not None:
            concurrent.futures.wait([self._in_flight.future], timeout)
        return not self.busy

    def close(self) -> None:
        """Waits for the publication in flight (one a broker does not take is given up)
        and stops the publisher's thread and channel."""
        self.channel.closing = True
        self.wait()
        self._settle()
        self._executor.shutdown()
        self.channel.close()

    def _settle(self) -> None:
        """Takes note of the finished publication: on failure, the next one starts where
        it started, under its number."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        if in_flight.future.result():
            self.durable_seq = in_flight.seq
        else:
            self._since, self.seq = in_flight.since, in_flight.seq - 1

    def _take(self, step: int, position: Any) -> Publication:
        tables = {}
        for name, table in _tables(self.network).items():
            slots, keys, rows = table.written_since(self._since[name])
            tables[name] = {
                "slots": slots.numpy(),
                "keys": keys.numpy(),
                "rows": rows.numpy(),
                "size": int(table.size.numpy()),
            }
            self._since[name] = int(table.step.numpy())
        self.seq += 1
        dense = [np.asarray(weight.numpy()) for weight in dense_weights(self.network)]
        return Publication(self.run, self.seq, step, position, time.time(), tables, dense)

    def _write(self, publication: Publication, taken: float) -> bool:
        """On the publisher's thread: the ids that left each table, then the write;
        the ids by row move on only once it is written."""
        for name in TABLES:
            changes = publication.tables[name]
            changes["deleted"] = self._left(name, changes)
        data = publications.encode(publication)
        written = False
        with self.failures.guard():
            # A trainer whose export folder another took over writes nothing more there.
            writer_lease.check_held(self.export_base)
            self.channel.write(publication, data)
            written = True
        if not written:
            return False
        self.bytes_written += len(data)
        for name in TABLES:
            self._move(name, publication.tables[name])
        self.rows.append(publication.rows)
        self.seconds.append(time.perf_counter() - taken)
        if self.on_written is not None:
            self.on_written(publication)
        return True

    def _left(self, name: str, changes: dict) -> np.ndarray:
        """The ids that left table `name` with `changes`: their rows now hold other ids,
        or lie past its size, and they hold no other row (costs the rows changed)."""
        keys, held = self._keys[name], self._held[name]
        size, slots = changes["size"], changes["slots"]
        rewritten = slots <= held
        before = keys[slots[rewritten]]
        gone = np.concatenate(
            [before[before != changes["keys"][rewritten]], keys[size + 1 : held + 1]]
        )
        # (Ids leave a table only when it evicts: mostly none, and nothing to sort.)
        return np.setdiff1d(gone, changes["keys"]) if len(gone) else gone

    def _move(self, name: str, changes: dict) -> None:
        """Once `changes` are written: table `name`'s ids by row as they left it, in
        place (grown by an eighth at a time; rows past the size are never read)."""
        keys, size = self._keys[name], changes["size"]
        if size + 1 > len(keys):
            grown = np.zeros(size + 1 + size // 8, np.int64)
            grown[: len(keys)] = keys
            keys = self._keys[name] = grown
        keys[changes["slots"]] = changes["keys"]
        self._held[name] = size
