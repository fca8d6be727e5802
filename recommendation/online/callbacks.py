"""Ready-made callbacks for `RecModel.online_train`: checkpoint (with the stream
offsets, then commit), metric logging (log line, history, TensorBoard), the hash tables
watched, stopping, an audit log of the trained events and a report of the restored
state. (Exports for serving: `state.serving_export`; test-then-train evaluation:
`evaluation`.)"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from official.core import model_dir, writer_lease
from official.utils.logs.summaries import ScalarSummaries
from recommendation.online.callback_base import Callback, Schedule
from recommendation.online.online_ncf import OnlineNeuMF
from recommendation.online.state import delta_checkpoints


class _Periodic(Callback):
    """Runs `act` on a schedule (checked after every sink and while the stream is
    quiet) and once more at the end if training advanced since."""

    def __init__(self, every_steps: int | None, every_seconds: float | None) -> None:
        super().__init__()
        self.schedule = Schedule(every_steps, every_seconds)

    def act(self) -> str:
        raise NotImplementedError

    def on_train_begin(self, logs=None) -> None:
        self.schedule.mark(int(self.rec_model.step.numpy()))

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self.schedule.due(batch):
            self.act()

    def on_idle(self, logs=None) -> None:
        if self.schedule.due(int(self.rec_model.step.numpy())):
            self.act()

    def on_train_end(self, logs=None) -> None:
        if int(self.rec_model.step.numpy()) > self.schedule.last_step:
            self.act()


class CheckpointCallback(_Periodic):
    """Restores the newest intact checkpoint (and the deltas after it) at the start;
    saves every N steps or seconds and at the end (unless another process has taken
    over the folder's lease), full or, between full ones, a delta of what changed
    (`delta_checkpoints`); after each save is durable, commits the stream position it
    holds. A full checkpoint is written while training goes on: its position is
    committed once it is on disk, and a checkpoint due before then waits for it (the
    disk is slower than the cadence: training waits too).

    Args:
        directory: Checkpoint folder.
        every_steps, every_seconds: Save cadence.
        keep: Full checkpoints kept.
        full_every: Every how many checkpoints one is full (1: all).
    """

    def __init__(
        self,
        directory: str,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: int = 3,
        full_every: int = 1,
    ) -> None:
        super().__init__(every_steps, every_seconds)
        self.directory, self.keep, self.full_every = directory, keep, full_every
        self.manager: tf.train.CheckpointManager | None = None
        self.deltas: delta_checkpoints.DeltaCheckpoints | None = None
        self.restored_from: str | None = None
        # Of each durable checkpoint, by kind ("full", "delta"): seconds and bytes, and
        # how long training waited for it (a delta's write; a full one's copy).
        self.seconds: dict[str, list[float]] = {"full": [], "delta": []}
        self.bytes: dict[str, list[int]] = {"full": [], "delta": []}
        self.waits: dict[str, list[float]] = {"full": [], "delta": []}
        # The full checkpoint being written: its position and when it started.
        self._writing: tuple[object, float] | None = None

    def on_train_begin(self, logs=None) -> None:
        rec_model = self.rec_model
        self.manager = tf.train.CheckpointManager(
            rec_model.checkpoint, self.directory, max_to_keep=self.keep
        )
        newest = tf.train.latest_checkpoint(self.directory)
        if newest is not None:  # before restoring: a restore of another layout says less
            delta_checkpoints.check_row_layout(rec_model, newest)
        latest = model_dir.restore_latest(
            rec_model.new_checkpoint,
            self.directory,
            self.manager,
            fallback_means="the events trained after it are trained again where their "
            "source can deliver them again",
        )
        self.deltas = delta_checkpoints.DeltaCheckpoints(rec_model, self.manager, self.full_every)
        latest = self.deltas.restore(latest) or latest
        if latest is not None:
            rec_model.after_restore()
            self.restored_from = latest
            logging.info("restored %s: step %d", latest, int(rec_model.step.numpy()))
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._finish(wait=False)
        super().on_train_batch_end(batch, logs)

    def on_idle(self, logs=None) -> None:
        self._finish(wait=False)
        super().on_idle(logs)

    def on_train_end(self, logs=None) -> None:
        super().on_train_end(logs)  # a last checkpoint (`act` first waits for the one before)
        self.finish()

    def finish(self) -> None:
        """Waits for the full checkpoint being written, if any, and commits it."""
        self._finish(wait=True)

    def act(self) -> str:
        """Checkpoints now (once the full checkpoint before it, if one is being written,
        is on disk), then, once it is durable, commits the stream position it holds (a
        commit made before the checkpoint is on disk could outlive what it vouches
        for); returns its path."""
        self.finish()
        rec_model = self.rec_model
        step = int(rec_model.step.numpy())
        # Another trainer that took this folder over must not lose its checkpoints to
        # this one, nor this one acknowledge events to a model that is overwritten.
        writer_lease.check_held(self.directory)
        start = time.perf_counter()
        path, kind, size = self.deltas.save(step)
        self.schedule.mark(step)
        self.waits[kind].append(time.perf_counter() - start)
        if size is None:  # a full one, on disk later
            self._writing = (rec_model.position, start)
            return path
        self.seconds[kind].append(time.perf_counter() - start)
        self.bytes[kind].append(size)
        rec_model.commit()
        logging.info("checkpoint %s", path)
        return path

    def _finish(self, wait: bool) -> bool:
        """Commits the position of the full checkpoint being written once it is on disk
        (`wait`: waits for it); returns whether it did."""
        if self._writing is None:
            return False
        written = self.deltas.finish(wait)
        if written is None:
            return False
        (path, size), (position, start) = written, self._writing
        self._writing = None
        self.seconds["full"].append(time.perf_counter() - start)
        self.bytes["full"].append(size)
        self.rec_model.commit(position)
        logging.info("checkpoint %s", path)
        return True


# The steady rate leaves out this much of a run's start (start-up, the first sink's
# tracing), as the peer harnesses leave out theirs.
WARM_UP_SECONDS = 1.0


class MetricLogger(Callback):
    """Logs step, events, events/s, the step logs and `gauges` every N steps or
    seconds, keeps them in `history` (one dict per report) and writes them to
    TensorBoard; and the steady rate at the grain of sinks, whatever the cadence
    (`steady_events_per_second`).

    Args:
        every_steps, every_seconds: Reporting cadence.
        keys: Log entries to show (default: all).
        gauges: Called at each report for more values to report (``{name: number}``).
        summaries: Where the reports go for TensorBoard (None: nowhere).
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keys: tuple[str, ...] | None = None,
        gauges: Callable[[], dict[str, float]] | None = None,
        summaries: ScalarSummaries | None = None,
    ) -> None:
        super().__init__()
        self.schedule = Schedule(every_steps, every_seconds)
        self.keys = keys
        self.gauges = gauges
        self.summaries = summaries or ScalarSummaries(None)
        self.history: list[dict] = []
        self._start = self._last_time = time.monotonic()
        self._last_events = 0
        self._sums: dict[str, float] = {}
        self._count = 0
        # (seconds, events) at the end of the first sink past the warm-up and the last.
        self._warm: tuple[float, int] | None = None
        self._latest: tuple[float, int] | None = None

    def on_train_begin(self, logs=None) -> None:
        self._start = self._last_time = time.monotonic()
        self._warm = self._latest = None
        self.schedule.mark(int(self.rec_model.step.numpy()))

    @property
    def steady_events_per_second(self) -> float | None:
        """Events/s from the end of the first sink at least `WARM_UP_SECONDS` into the
        run to the end of the last (the wait for events after it left out); None until
        two sinks are past the warm-up."""
        if self._warm is None or self._latest[0] <= self._warm[0]:
            return None
        return (self._latest[1] - self._warm[1]) / (self._latest[0] - self._warm[0])

    def on_train_batch_end(self, batch, logs=None) -> None:
        mark = (time.monotonic() - self._start, (logs or {}).get("events", 0))
        if self._warm is None and mark[0] >= WARM_UP_SECONDS:
            self._warm = mark
        self._latest = mark
        for key, value in (logs or {}).items():
            if key not in ("events", "step"):
                self._sums[key] = self._sums.get(key, 0.0) + value
        self._count += 1
        if self.schedule.due(batch):
            self._report(logs)

    def on_train_end(self, logs=None) -> None:
        if self._count:
            self._report(logs)

    def _report(self, logs: dict) -> None:
        now = time.monotonic()
        events = logs.get("events", 0)
        record = {
            "step": logs.get("step", 0),
            "events": events,
            "seconds": now - self._start,
            "events_per_second": (events - self._last_events) / max(now - self._last_time, 1e-9),
            **{key: total / self._count for key, total in self._sums.items()},
            **(self.gauges() if self.gauges else {}),
        }
        self.history.append(record)
        self.summaries.write(record["step"], {k: v for k, v in record.items() if k != "step"})
        shown = {k: v for k, v in record.items() if self.keys is None or k in self.keys}
        logging.info(
            "online: %s",
            " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
            ),
        )
        self._sums, self._count = {}, 0
        self._last_events, self._last_time = events, now
        self.schedule.mark(record["step"])


class StopAfter(Callback):
    """Stops online training after a number of steps, events or seconds, or after the
    stream has been quiet for `idle_seconds`.

    Args:
        steps, events, seconds, idle_seconds: Limits; None for none.
    """

    def __init__(
        self,
        steps: int | None = None,
        events: int | None = None,
        seconds: float | None = None,
        idle_seconds: float | None = None,
    ) -> None:
        super().__init__()
        self.steps, self.events, self.seconds = steps, events, seconds
        self.idle_seconds = idle_seconds
        self._start = self._last_data = time.monotonic()

    def on_train_begin(self, logs=None) -> None:
        self._start = self._last_data = time.monotonic()

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._last_data = time.monotonic()
        logs = logs or {}
        if (self.steps is not None and logs.get("step", 0) >= self.steps) or (
            self.events is not None and logs.get("events", 0) >= self.events
        ):
            self.rec_model.stop_training = True
        self._check_time()

    def on_idle(self, logs=None) -> None:
        if self.idle_seconds is not None and time.monotonic() - self._last_data > self.idle_seconds:
            self.rec_model.stop_training = True
        self._check_time()

    def _check_time(self) -> None:
        if self.seconds is not None and time.monotonic() - self._start > self.seconds:
            self.rec_model.stop_training = True


class TableWatch(Callback):
    """Watches the user and item hash tables of an `OnlineNeuMF`: their counts for the
    metric reports and the summary (`counts`), and a warning when a full table refuses
    new ids (they read the shared default row, never learnt), naming the flag to
    change: the first refusal at once, then at most every `warn_every_seconds`.

    Args:
        capacity_flags: The flag that sizes each table, by ``"user"`` and ``"item"``.
        policy_flags: The flag that sets each table's eviction policy.
        warn_every_seconds: Shortest interval between two warnings about one table.
    """

    TABLES = ("user", "item")

    def __init__(
        self,
        capacity_flags: dict[str, str] | None = None,
        policy_flags: dict[str, str] | None = None,
        warn_every_seconds: float = 300.0,
    ) -> None:
        super().__init__()
        self.capacity_flags = capacity_flags or {t: f"--{t}_capacity" for t in self.TABLES}
        self.policy_flags = policy_flags or {t: f"--{t}_evict_policy" for t in self.TABLES}
        self.warn_every_seconds = warn_every_seconds
        self._warned: dict[str, tuple[float, int]] = {}  # table -> (when, refused then)

    def _table(self, name: str):
        return getattr(self.rec_model.network, f"{name}_embedding")

    def counts(self) -> dict[str, dict[str, int]]:
        """Each table's `HashEmbedding.counts`, by ``"user"`` and ``"item"``."""
        return {name: self._table(name).counts() for name in self.TABLES}

    def gauges(self) -> dict[str, int]:
        """`counts` flattened for a metric report: ``user_ids``, ``user_refused``, ..."""
        return {
            f"{name}_{key}": value
            for name, counts in self.counts().items()
            for key, value in counts.items()
            if key != "capacity"
        }

    def on_train_batch_end(self, batch, logs=None) -> None:
        for name in self.TABLES:
            table = self._table(name)
            refused = int(table.num_rejected.numpy())  # one scalar read a sink
            when, then = self._warned.get(name, (None, 0))
            if refused == then:
                continue
            now = time.monotonic()
            if when is not None and now - when < self.warn_every_seconds:
                continue
            self._warned[name] = (now, refused)
            if table.policy.evicts:
                free = f": all were in use by the steps that refused them ({table.policy})"
            else:
                free = (
                    f" or set {self.policy_flags[name]} lru (or lfu, ttl:STEPS) so that new "
                    f"{name}s take the rows of the least used"
                )
            since = f" ({refused - then:,} since the last warning)" if then else ""
            logging.warning(
                "the %s table is full: all %s rows hold ids, and %s admissions of new %ss "
                "were refused so far%s: those %ss read the shared default row and are not "
                "learnt; raise %s%s",
                name,
                f"{table.capacity:,}",
                f"{refused:,}",
                name,
                since,
                name,
                self.capacity_flags[name],
                free,
            )


def table_digest(network: OnlineNeuMF) -> str:
    """A short hash of both hash tables' (id, row) pairs: equal digests, equal tables."""
    digest = hashlib.sha256()
    for embedding in (network.user_embedding, network.item_embedding):
        keys, slots = embedding.contents()
        digest.update(np.asarray(keys).tobytes() + b"|" + np.asarray(slots).tobytes() + b"/")
    return digest.hexdigest()[:16]


class TrainedEventsLog(Callback):
    """Appends the source ids of each trained sink's events to a file (flushed), so
    that tests and audits can count how often every event was trained (place it before
    the checkpoint callback: an event is logged before a checkpoint vouches for it).

    Args:
        path: File appended to (any `tf.io.gfile` path).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._file = None

    def on_train_begin(self, logs=None) -> None:
        self._file = tf.io.gfile.GFile(self.path, "a")

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._file.write("".join(f"{i}\n" for i in self.rec_model.trained_ids))
        self._file.flush()

    def on_train_end(self, logs=None) -> None:
        self._file.close()


class ReportRestore(Callback):
    """Prints one line with the checkpoint restored, its step, the tables' sizes and
    `table_digest`, so that a restart shows what it resumed from (place it after
    `checkpoint`, which restores in its `on_train_begin`).

    Args:
        checkpoint: The run's checkpoint callback.
    """

    def __init__(self, checkpoint: CheckpointCallback) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def on_train_begin(self, logs=None) -> None:
        if self.checkpoint.restored_from:
            network, step = self.rec_model.network, int(self.rec_model.step.numpy())
            print(
                f"restored {self.checkpoint.restored_from}: step={step} "
                f"users={int(network.user_embedding.size.numpy())} "
                f"items={int(network.item_embedding.size.numpy())} tables={table_digest(network)}",
                flush=True,
            )
