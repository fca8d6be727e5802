"""`ExportCallback`: what ncf-online gives serving while it trains, versions of the
model (`versioned_export`) and, between them, publications of what changed
(`publishing`), each written on a thread of its own so that training goes on."""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid

from absl import logging

from official.utils.misc.write_failures import WriteFailures
from recommendation.online.callback_base import Callback, Schedule
from recommendation.online.state import publishing, versioned_export
from recommendation.serving import publication_channels
from recommendation.serving.online_version import OnlineVersion
from recommendation.serving.publications import TABLES, Publication

# A version is due once the publications since the last add up to this many times its
# bytes: what a server that starts late applies is bounded, and while new ids flood in
# (every publication new rows) versions stay rare. Trained as fast as it goes with 10^6
# new users, a trainer kept 0.90x its rate without publications at 1, 0.93x at 4 (no
# versions at all: 0.94x).
CHAIN_PER_VERSION = 2
# ... but no sooner than this after the last: a small model's every few publications
# add up to it, and a version a second is a SavedModel written a second, and servers
# that fell a publication behind loading one.
VERSION_MIN_SECONDS = 30.0

# Longest wait of a version for the publications before it (a broker that does not
# take them: the version waits for the next, training goes on).
FLUSH_SECONDS = 10.0


class ExportCallback(Callback):
    """Exports a serving SavedModel (`OnlineVersion`) every N steps or seconds and at the
    end, as the next version of `export_base` (the step, or above the newest version
    already there: `versioned_export.Exporter`), atomically, keeping the last `keep`;
    with `publish_every_seconds`, publishes what changed between versions that often
    (`publishing.Publisher`), and a version once the publications since the last add
    up to `CHAIN_PER_VERSION` times its size, so that a server starting late applies at
    most that much.

    A version is written on a thread of its own, one at a time (a version that comes
    due while one is written waits), so that training goes on while it is written.
    Without publications each version is copied from the model between sinks; with
    them, only the run's first (exported as training starts: the state its
    publications build on): the export thread applies each publication's rows to it
    once written (the index is rebuilt at the write), and a later version is that
    state once the publications up to the model as it is now are written, so that the
    training thread copies no table for it. An export that
    cannot be written (a full disk, no permission) costs no training: it is logged and
    counted (`failures`), nothing of it is listed or served, and the next one is tried
    on schedule; a publication likewise (`Publisher`).

    Args:
        export_base: Folder of versions.
        every_steps: Version cadence in steps (None: by time only).
        every_seconds: Version cadence in seconds (None: by steps only).
        keep: Versions kept.
        publish_every_seconds: Publication cadence (None: no publications).
        channel: Where publications go (`publication_channels`; None: the folder's
            ``publications/``).
    """

    def __init__(
        self,
        export_base: str,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: int = 3,
        publish_every_seconds: float | None = None,
        channel: publication_channels.Channel | None = None,
    ) -> None:
        super().__init__()
        self.channel = channel
        self.schedule = Schedule(every_steps, every_seconds)
        self.publishing = Schedule(None, publish_every_seconds) if publish_every_seconds else None
        self.export_base, self.keep = export_base, keep
        self.run = uuid.uuid4().hex[:12]
        self.publisher: publishing.Publisher | None = None
        self.exported: list[str] = []
        self.seconds: list[float] = []  # of each export, from its copy to its last file
        self.copy_seconds: list[float] = []  # of each export's copy (training waits)
        self.failures = WriteFailures("the export", export_base, "--export_dir")
        self._version: OnlineVersion | None = None
        self._exporter: versioned_export.Exporter | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "ncf-export")
        self._writing: concurrent.futures.Future | None = None
        # The publisher's bytes when the last version was copied, and that version's.
        self._chain_start, self._version_bytes = 0, None
        self._follow_error: Exception | None = None

    def on_train_begin(self, logs=None) -> None:
        step = int(self.rec_model.step.numpy())
        self.schedule.mark(step)
        if self.publishing:
            self.publishing.mark(step)
        config = json.loads(json.dumps(self.rec_model.network.get_config()))
        self._version = OnlineVersion(config)
        self._exporter = versioned_export.Exporter(
            self.export_base, self._version, self._version.signatures(), self.keep, self.channel
        )
        if self.publishing:
            self.act()  # the state this run's publications build on

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._on_schedule(batch)

    def on_idle(self, logs=None) -> None:
        self._on_schedule(int(self.rec_model.step.numpy()))

    def on_train_end(self, logs=None) -> None:
        try:
            self.wait()
            if int(self.rec_model.step.numpy()) > self.schedule.last_step:
                self.act()
            self.wait()
        finally:
            if self.publisher is not None:
                self.publisher.close()
            self._writer.shutdown()

    def _on_schedule(self, step: int) -> None:
        writing = self._writing is not None and not self._writing.done()
        if not writing:
            self.wait()  # its errors (a lease taken over) stop training
        if not writing and (self.schedule.due(step) or self._chain_outgrew_version()):
            self.act()
        elif self.publisher is not None and self.publishing.due(step):
            self.rec_model.finish_steps()
            self.publisher.publish(step, self.rec_model.position)
            self.publishing.mark(step)

    def _chain_outgrew_version(self) -> bool:
        if self.publisher is None or self._version_bytes is None:
            return False
        if time.monotonic() - self.schedule.last_time < VERSION_MIN_SECONDS:
            return False
        written = self.publisher.bytes_written - self._chain_start
        return written >= CHAIN_PER_VERSION * self._version_bytes

    def act(self) -> bool:
        """Starts writing the next version: the model copied into it, or with
        publications, once those up to the model as it is now are written, the state
        they built; returns whether it did."""
        self.wait()  # one version at a time: the module is copied into, then written
        rec_model = self.rec_model
        step = int(rec_model.step.numpy())
        self.schedule.mark(step)
        rec_model.finish_steps()
        if self.publisher is not None and not self.publisher.flush(
            step, rec_model.position, FLUSH_SECONDS
        ):
            return False  # the next version tries again: its chain must be whole
        start, copied_at = time.perf_counter(), time.time()
        version = self._version
        if self.publisher is None:
            version.copy_from(rec_model.network)
            self.copy_seconds.append(time.perf_counter() - start)
        if self.publishing and self.publisher is None:
            keys = {name: getattr(version, name).keys.numpy() for name in TABLES}
            self.publisher = publishing.Publisher(
                self.export_base,
                self.run,
                rec_model.network,
                keys,
                self.channel,
                on_written=lambda publication: self._writer.submit(self._follow, publication),
            )
        info = {
            "step": step,
            "position": rec_model.position,
            "model": version.config,
            "copied_at": copied_at,  # before any publication after it was taken
        }
        if self.publisher is not None:
            info.update(run=self.run, publication=self.publisher.durable_seq)
            self._chain_start = self.publisher.bytes_written
        self._writing = self._writer.submit(self._write_version, step, info, start)
        return True

    def _follow(self, publication: Publication) -> None:
        """On the export thread: applies a written publication to the version, which
        thus holds the state of the chain's last one at the next version's write (a
        failure is raised by that write: no version misses a publication)."""
        try:
            self._version.follow(publication.tables, publication.dense)
        except Exception as error:
            self._follow_error = error
            raise

    def _write_version(self, step: int, info: dict, start: float) -> None:
        """On the export thread: the version's indexes, then its files."""
        if self._follow_error is not None:
            raise self._follow_error
        version = self._version
        self._version_bytes = sum(
            (int(getattr(version, name).size.numpy()) + 1)
            * (8 + 4 * int(getattr(version, name).rows.shape[1]))
            for name in TABLES
        )
        with self.failures.guard():
            version.trim()
            version.reindex()
            path = self._exporter.export(step, info)
            self.exported.append(path)
            self.seconds.append(time.perf_counter() - start)
            logging.info("exported %s", path)

    def wait(self) -> None:
        """Waits for the version being written; raises what stopped it (a lease taken
        over), not a failed write (`failures`)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()
