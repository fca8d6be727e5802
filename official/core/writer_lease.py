"""One writer per folder: a lease that refuses a second writer of a model_dir or an
export folder.

Two trainers on one model_dir (a deployment restarted while the old one still runs, a
pasted command) take turns replacing each other's checkpoint list, and an online
trainer acknowledges to its source the events of checkpoints the other one then
overwrites: acknowledged, and in no model. Two on one export folder interleave their
versions, and a server that follows the highest one flips between two models. So the
process that writes such a folder holds its lease, a file naming the holder (program,
host, pid, since when), renewed every `renew_seconds` (a model_dir's is `LEASE_FILE`
in it, `hold`; an export folder's lies beside it, ``<export_dir>.writer_lease.json``,
`hold_export`, since its writers replace the folder whole); messages name the folder
by its flag:

- a second process finds the lease held and stops with one line naming the holder;
- a holder that died leaves the file behind, stale, which the next process takes
  over with a warning: at once when the holder ran on this host (its pid runs no
  more, or runs another process, or the machine restarted since), otherwise once it
  has gone `expire_seconds` without a renewal (a lost machine);
- the holder reads the lease again before every checkpoint or export (`check_held`,
  called by the runner, the checkpoint callback and the exporters): if another process
  took it over meanwhile (this one was paused or cut off for longer than
  `expire_seconds`), it stops without writing.

On a local disk the check and the write happen under an exclusive ``flock`` of the
folder holding the lease file, so two processes starting together cannot both win. On
``gs://`` there are no locks and no conditional writes through `tf.io.gfile`: the new
holder writes the lease, waits `settle_seconds` and reads it back, and goes on only if
it finds its own there. Only a process stalled for longer than that between reading the
lease and writing its own can pass beside another; the one whose lease was overwritten
then learns it at its first checkpoint or export and stops without writing.
Staleness across hosts compares the holder's clock with the reader's: hosts must agree
on the time to within seconds (NTP).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import tensorflow as tf
from absl import logging

from official.core.model_dir import ModelDirError
from official.utils.misc import atomic, errors

LEASE_FILE = "writer_lease.json"
# An export folder's lease lies beside it, under its name with this suffix.
_BESIDE = f".{LEASE_FILE}"
RENEW_SECONDS = 10.0
EXPIRE_SECONDS = 60.0
SETTLE_SECONDS = 2.0

# The leases this process holds, by lease file (`check_held` looks their folders up).
_held: dict[str, WriterLease] = {}
_held_lock = threading.Lock()


def _boot_id() -> str | None:
    """This boot of this machine (Linux): a holder of an earlier boot is gone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as stream:
            return stream.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux), or None: a pid
    that runs with another start time is another process."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            # Field 22; the command name (field 2) may hold spaces, so count from ")".
            return int(stream.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _running(pid: int, started: int | None) -> bool:
    """Whether process `pid` (which started at `started`) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return started is None or _start_time(pid) in (None, started)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def holder_record(program: str, **more) -> dict:
    """What names this process as the holder of something (a lease, a claim): program,
    host, boot, pid and its start, since and last renewed, a token of its own, `more`."""
    now = time.time()
    return {
        "program": program,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": os.getpid(),
        "pid_started": _start_time(os.getpid()),
        "since": now,
        "renewed": now,
        "token": uuid.uuid4().hex,
        **more,
    }


def stale_reason(found: dict, expire_seconds: float, what: str = "lease") -> str | None:
    """Why holder record `found` no longer holds, or None while its holder may run: on
    this host, its machine restarted or its process is gone; elsewhere, it has gone
    `expire_seconds` without a renewal."""
    if found.get("host") == socket.gethostname():
        if found.get("boot_id") and found.get("boot_id") != _boot_id():
            return "its machine has restarted since"
        if not _running(int(found.get("pid", 0)), found.get("pid_started")):
            return "its process is gone"
        return None
    silent = time.time() - float(found.get("renewed", 0))
    if silent > expire_seconds:
        return f"it has not renewed its {what} for {silent:.0f} s"
    return None


def describe_holder(found: dict) -> str:
    """A holder record as messages name it: program, pid, host and since when."""
    return (
        f"{found.get('program', 'a trainer')} (pid {found.get('pid')} on host "
        f"{found.get('host')}, since {_when(float(found.get('since', 0)))})"
    )


def renew_until(
    stop: threading.Event,
    seconds: float,
    renew: Callable[[], bool],
    what: str,
    failures: tuple[type[Exception], ...],
) -> None:
    """Calls `renew` every `seconds` until `stop` is set or it returns False (taken
    over); a failure (one of `failures`) is said once, retried, and its end said."""
    failing = False
    while not stop.wait(seconds):
        try:
            if not renew():
                return
            if failing:
                logging.info("%s is renewed again", what)
            failing = False
        except failures as error:
            if not failing:
                logging.warning("cannot renew %s (%s); retrying every %.0f s", what, error, seconds)
            failing = True


def expiry(found: dict, expire_seconds: float) -> str:
    """When the thing `found` holds is free again, for a refusal."""
    if found.get("host") == socket.gethostname():
        return "it is released as soon as that process ends"
    return (
        "if that process is gone with its machine, it is free "
        f"{expire_seconds:.0f} s after its last renewal"
    )


def folder_key(path: str) -> str:
    """`path` spelt one way (normalised where local), so that two spellings of one
    folder compare equal."""
    return os.path.normpath(path) if atomic.is_local(path) else path.rstrip("/")


def _read_lease(path: str) -> dict | None:
    """The lease in file `path` (None: none, or a file that is no lease)."""
    try:
        with tf.io.gfile.GFile(path, "r") as stream:
            found = json.load(stream)
    except tf.errors.NotFoundError:
        return None
    except ValueError:
        logging.warning("%s is not a lease (no JSON); it is replaced", path)
        return None
    return found if isinstance(found, dict) and "token" in found else None


class WriterLease:
    """The lease on `folder` for this process (`hold` acquires and releases it).

    Args:
        folder: The folder written (a model_dir created already).
        program: What holds it, for the message a second process shows.
        flag: The flag that names the folder, in the messages.
        beside: The lease file lies beside the folder (``<folder>.writer_lease.json``),
            not in it: for a folder its writers replace whole.
        renew_seconds, expire_seconds, settle_seconds: The module docstring's.
    """

    def __init__(
        self,
        folder: str,
        program: str,
        flag: str = "--model_dir",
        beside: bool = False,
        renew_seconds: float = RENEW_SECONDS,
        expire_seconds: float = EXPIRE_SECONDS,
        settle_seconds: float = SETTLE_SECONDS,
    ) -> None:
        self.folder, self.program, self.flag = folder, program, flag
        self.path = folder.rstrip("/") + _BESIDE if beside else os.path.join(folder, LEASE_FILE)
        self.renew_seconds, self.expire_seconds = renew_seconds, expire_seconds
        self.settle_seconds = settle_seconds
        self.record = holder_record(program)
        self.token = self.record["token"]
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._taken_by: dict | None = None  # the lease found in place of ours

    # -- what is in the file ---------------------------------------------------

    def _write(self) -> None:
        atomic.write_file(self.path, json.dumps(self.record, sort_keys=True))

    def _refusal(self, lease: dict) -> ModelDirError:
        silent = max(0.0, time.time() - float(lease.get("renewed", 0)))
        return ModelDirError(
            f"{self.flag} {self.folder} is in use by {describe_holder(lease)}, lease "
            f"renewed {silent:.0f} s ago: stop that process first or give this run "
            f"another {self.flag} ({expiry(lease, self.expire_seconds)})"
        )

    # -- holding it --------------------------------------------------------------

    def acquire(self) -> None:
        """Takes the lease, or raises `ModelDirError` naming the live holder (or saying
        why the lease file cannot be written)."""
        key = folder_key(self.path)
        with _held_lock:
            if key in _held:
                raise self._refusal(_held[key].record)
        where = os.path.dirname(self.path) or "."
        try:
            tf.io.gfile.makedirs(where)
            with self._exclusive():
                found = _read_lease(self.path)
                if found is not None:
                    reason = stale_reason(found, self.expire_seconds)
                    if reason is None:
                        raise self._refusal(found)
                    logging.warning(
                        "taking over %s %s from %s: %s",
                        self.flag,
                        self.folder,
                        describe_holder(found),
                        reason,
                    )
                self._write()
        except (tf.errors.OpError, OSError) as error:
            raise ModelDirError(
                errors.write_failure(error, "its writer lease", where, self.flag)
            ) from None
        if not atomic.is_local(self.path):
            time.sleep(self.settle_seconds)
            found = _read_lease(self.path)
            if found is None or found["token"] != self.token:
                raise self._refusal(found or self.record)
        with _held_lock:
            _held[key] = self
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True, name="lease")
        self._renewer.start()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Holds an exclusive flock of the (local) folder of the lease file; nothing on
        gs://."""
        if not atomic.is_local(self.path):
            yield
            return
        descriptor = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # releases the lock

    def _renew_loop(self) -> None:
        renew_until(
            self._stop,
            self.renew_seconds,
            self._renew,
            f"the lease {self.path}",
            (tf.errors.OpError, OSError),
        )

    def _renew(self) -> bool:
        with self._exclusive():
            found = _read_lease(self.path)
            if found is not None and found["token"] != self.token:
                self._taken_by = found
                return False
            self.record["renewed"] = time.time()
            self._write()
        return True

    def check(self) -> None:
        """Raises `ModelDirError` if another process has taken the lease over."""
        found = self._taken_by or _read_lease(self.path)
        if found is not None and found["token"] != self.token:
            self._taken_by = found
            raise ModelDirError(
                f"{self.flag} {self.folder} was taken over by {describe_holder(found)} while "
                "this run held it (this one went without renewing its lease for longer "
                f"than {self.expire_seconds:.0f} s: paused or cut off); it stops without "
                "writing there: that folder is the other run's now"
            )

    def release(self) -> None:
        """Stops renewing and removes the lease if it is still this process's."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with _held_lock:
            _held.pop(folder_key(self.path), None)
        try:
            with self._exclusive():
                found = _read_lease(self.path)
                if found is not None and found["token"] == self.token:
                    tf.io.gfile.remove(self.path)
        except (tf.errors.OpError, OSError) as error:
            logging.warning("could not remove the lease %s: %s", self.path, error)

    def clear_folder(self) -> None:
        """Deletes everything in the folder but its lease (``--clean``: only ever a
        folder it holds) and the live leases of export folders in it, with the folder
        of each that another process holds."""
        names = [name.rstrip("/") for name in tf.io.gfile.listdir(self.folder)]
        with _held_lock:
            ours = {lease.token for lease in _held.values()}
        kept = {LEASE_FILE}
        for name in [name for name in names if name.endswith(_BESIDE)]:
            holder = _read_lease(os.path.join(self.folder, name))
            if holder is None or stale_reason(holder, self.expire_seconds) is not None:
                continue
            kept.add(name)
            if holder["token"] not in ours:
                export = name[: -len(_BESIDE)]
                kept.add(export)
                logging.warning(
                    "--clean leaves %s alone: %s writes it",
                    os.path.join(self.folder, export),
                    describe_holder(holder),
                )
        for name in names:
            if name not in kept:
                path = os.path.join(self.folder, name)
                if tf.io.gfile.isdir(path):
                    tf.io.gfile.rmtree(path)
                else:
                    tf.io.gfile.remove(path)


@contextlib.contextmanager
def hold(folder: str, program: str, **options) -> Iterator[WriterLease]:
    """Holds the lease on `folder` while the block runs (`WriterLease` options).

    Raises:
        ModelDirError: Another live process holds it (the message names it).
    """
    lease = WriterLease(folder, program, **options)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()


def hold_export(export_dir: str | None, program: str) -> contextlib.AbstractContextManager:
    """`hold` for an export folder (``--export_dir``; None: nothing to hold), with its
    lease beside it: ncf-main and the export command replace the folder whole, which
    would take a lease in it along.

    Raises:
        ModelDirError: Another live process holds it (the message names it).
    """
    if not export_dir:
        return contextlib.nullcontext()
    return hold(export_dir, program, flag="--export_dir", beside=True)


def check_held(path: str) -> None:
    """Before writing `path`: raises `ModelDirError` if this process held the lease
    of a folder that is or holds `path` and another process has taken it over
    (nothing to check where this process holds no lease: a library user, a non-chief
    worker)."""
    key = folder_key(path)
    with _held_lock:
        folders = [(folder_key(lease.folder), lease) for lease in _held.values()]
    leases = [
        lease
        for folder, lease in folders
        if key == folder or key.startswith(folder.rstrip("/") + "/")
    ]
    for lease in leases:
        lease.check()
