"""What ncf-serve answers with: the newest version of an online model's export, kept up
to date in place by the publications after it (`publications`).

`LiveModel` loads the newest complete version of the export base (`versioned_export`)
and then applies each publication of the version's run in order, as each appears. A
publication is read and checked whole before anything of it is applied, and applied
while no request reads the model (`_ReadWriteLock`): a request sees all of a
publication or none of it. The state a server holds is a function of the version it
loaded and the publications it applied, so servers following one channel answer alike,
and one started later answers, once caught up, exactly as one that never stopped.

A new full version is loaded (beside the one served, which answers until the new one
is ready) when it comes from another trainer run, said once, in particular a run that
restarted from an older checkpoint: the server never goes back in time without saying
so; and when the publication it needs next is damaged or gone (pruned while it lagged,
deleted): named once, the server keeps serving its last whole state until a version
holds what it lacks. A version of its own run is not loaded again: the server already
holds that state.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from absl import logging

from recommendation.online.state import versioned_export
from recommendation.online.tables import id_index
from recommendation.serving import publication_channels
from recommendation.serving.online_version import OnlineVersion
from recommendation.serving.publications import TABLES, Publication, PublicationError


def _free_memory_to_the_system() -> None:
    """Gives the memory freed since back to the system (glibc's ``malloc_trim``; a
    no-op elsewhere): a table that grows as ids arrive frees its smaller copies, and
    glibc would keep most of them, 1.6 times the rows' bytes at 3 million ids where
    1.4 is needed."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None
if _LIBC is not None and not hasattr(_LIBC, "malloc_trim"):
    _LIBC = None


class _ReadWriteLock:
    """Many readers at once, or one writer; a waiting writer goes before new readers
    (publications are not held back by a steady stream of requests)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._writing and not self._waiting_writers)
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                if not self._readers:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._condition:
            self._waiting_writers += 1
            self._condition.wait_for(lambda: not self._writing and not self._readers)
            self._waiting_writers -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._condition:
                self._writing = False
                self._condition.notify_all()


@dataclasses.dataclass
class Served:
    """A model as served and where it stands.

    Attributes:
        module: The model.
        version: The full version it started from.
        run: The trainer run whose publications it applies (None: a version written
            without publications).
        seq: The last publication applied (the version's own: none after it).
        step, position: The trainer's step and stream position it holds.
        published_at: When the trainer took what it holds (its version's export time
            until a publication is applied).
        applied_at: When that reached this server.
    """

    module: OnlineVersion
    version: int
    run: str | None
    seq: int
    step: int
    position: Any
    published_at: float
    applied_at: float
    # Removals from each table's index since its rebuild, and its buckets then.
    wear: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class VersionError(Exception):
    """A version that cannot be loaded; the message says why."""


class LiveModel:
    """The model of `base_path` as served (module docstring).

    Args:
        base_path: The export base (versions, and their publications in
            ``publications/``).
        version_poll_seconds: How often to look for a new version.
        publication_poll_seconds: How often to look for the next publication.
        channel: Where the publications are (`publication_channels`; None: the
            folder's ``publications/``).
    """

    def __init__(
        self,
        base_path: str,
        version_poll_seconds: float = 1.0,
        publication_poll_seconds: float = 0.05,
        channel: publication_channels.Channel | None = None,
    ) -> None:
        self.base_path = base_path
        self.channel = channel or publication_channels.Folder(base_path)
        self.version_poll_seconds = version_poll_seconds
        self.publication_poll_seconds = publication_poll_seconds
        self.served: Served | None = None
        self._lock = _ReadWriteLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._versions_checked = -float("inf")
        self._said: set[str] = set()  # what was logged once
        self._unloadable: set[int] = set()  # versions that could not be loaded
        self._stuck = False  # the next publication is damaged or gone

    # -- answering -------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self) -> Iterator[Served | None]:
        """The served model, unchanged while the block runs (None before any)."""
        with self._lock.reading():
            yield self.served

    def status(self) -> dict | None:
        """Where the served model stands (None before any)."""
        served = self.served
        if served is None:
            return None
        return {
            "version": served.version,
            "run": served.run,
            "publication": served.seq,
            "step": served.step,
            "position": served.position,
            "published_at": served.published_at,
            "applied_at": served.applied_at,
            "lag_seconds": served.applied_at - served.published_at,
            "users": int(served.module.users.size.numpy()),
            "items": int(served.module.items.size.numpy()),
        }

    # -- following -------------------------------------------------------------

    def start(self) -> None:
        """Follows the export on a thread of its own until `stop`."""
        self._thread = threading.Thread(target=self._follow, name="ncf-serve-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001 (storage or a broker unreachable:
                # said once, tried again; the model served stays, nothing stops following)
                where = " and ".join(sorted({self.base_path, self.channel.where}))
                self._say_once(
                    f"poll:{type(error).__name__}", f"cannot read {where}: {error}; trying again"
                )
            self._stop.wait(self.publication_poll_seconds)

    def poll(self) -> None:
        """One look at the export: a new version if one is due, then every publication
        there is to apply."""
        now = time.monotonic()
        if (
            self.served is None
            or self._stuck
            or now - self._versions_checked >= self.version_poll_seconds
        ):
            self._versions_checked = now
            self._check_versions()
        served = self.served
        if served is None or served.run is None or self._stuck:
            return
        while not self._stop.is_set():
            publication = self._next_publication(served)
            if publication is None:
                return
            self._apply(served, publication)

    def _check_versions(self) -> None:
        found = [v for v in versioned_export.versions(self.base_path) if v not in self._unloadable]
        if not found:
            if self.served is None:
                self._say_once(
                    "waiting",
                    f"no version in {self.base_path} yet: waiting for one (ncf-online "
                    f"--export_dir {self.base_path} writes them)",
                )
            return
        newest = found[-1]
        served = self.served
        if served is not None and newest <= served.version:
            return
        path = os.path.join(self.base_path, str(newest))
        info = versioned_export.read_info(path)
        if served is not None and info.get("run") is not None and info.get("run") == served.run:
            # A state this server held, or will reach by the publications it can read.
            if info["publication"] <= served.seq:
                served.version = newest
                return
            if not self._stuck and self.channel.exists(served.run, served.seq + 1):
                return
        self._load(newest, path, info)

    def _load(self, version: int, path: str, info: dict) -> None:
        """Loads version `version` beside the one served, catches it up with the
        publications after it, then serves it."""
        start = time.monotonic()
        try:
            module = OnlineVersion(info["model"])
            status = tf.train.Checkpoint(root=module).read(
                os.path.join(path, "variables", "variables")
            )
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, KeyError, TypeError, tf.errors.OpError) as error:
            self._unloadable.add(version)
            logging.error(
                "version %d in %s cannot be loaded (%s); serving %s until a newer one",
                version,
                self.base_path,
                str(error).splitlines()[0],
                "nothing" if self.served is None else f"version {self.served.version}",
            )
            return
        wear = {name: [0, int(getattr(module, name).reindex())] for name in TABLES}
        module.warm_up()  # traced before any request waits for it
        run = info.get("run")
        now = time.time()
        fresh = Served(
            module,
            version,
            run,
            int(info.get("publication", 0)),
            int(info["step"]),
            info.get("position"),
            float(info.get("exported_at", now)),
            now,
            wear,
        )
        old = self.served
        self._stuck = False
        self.channel.seek(float(info.get("copied_at", fresh.published_at)))
        while run is not None and (publication := self._next_publication(fresh)) is not None:
            self._apply(fresh, publication, swap=False)
        with self._lock.writing():
            self.served = fresh
        self._say_load(old, fresh, time.monotonic() - start)
        del old
        _free_memory_to_the_system()

    def _say_load(self, old: Served | None, new: Served, seconds: float) -> None:
        users, items = (int(getattr(new.module, name).size.numpy()) for name in TABLES)
        held = f"step {new.step}, {users:,} users, {items:,} items; loaded in {seconds:.1f} s"
        if old is None:
            logging.info("serving version %d of %s (%s)", new.version, self.base_path, held)
        elif old.run != new.run:
            logging.warning(
                "the trainer started a new run: serving its version %d (%s) where step %d of "
                "the run before was served%s",
                new.version,
                held,
                old.step,
                ": it restarted from an earlier checkpoint" if new.step < old.step else "",
            )
        else:
            logging.info("serving version %d (%s): it holds what was missing", new.version, held)

    def _next_publication(self, served: Served) -> Publication | None:
        """The publication after `served`'s, once it is there; None while it is not
        (or is damaged or gone: said once, and the server waits for a version)."""
        seq = served.seq + 1
        try:
            publication = self.channel.read(served.run, seq)
        except PublicationError as error:
            self._stall(served, f"publication {seq} of run {served.run}: {error}")
            return None
        if publication is None and self.channel.exists(served.run, seq + 1):
            self._stall(
                served,
                f"publication {seq} of run {served.run} is missing from {self.channel.where} "
                "(the one after it is there)",
            )
        return publication

    def _stall(self, served: Served, problem: str) -> None:
        """Stops at `problem` (said once) until a version holds what it lacks."""
        self._stuck = True
        self._say_once(
            problem, f"{problem}; serving step {served.step} until a version holds what it lacks"
        )

    def _apply(self, served: Served, publication: Publication, swap: bool = True) -> None:
        prepared = served.module.prepare(publication.tables, publication.dense)
        with self._lock.writing() if swap else contextlib.nullcontext():
            left = served.module.apply_prepared(prepared)
            served.seq, served.step = publication.seq, publication.step
            served.position = publication.position
            served.published_at, served.applied_at = publication.published_at, time.time()
            # Removals wear an index's buckets (`id_index`): rebuilt once worn.
            for name in TABLES:
                wear = served.wear[name]
                wear[0] += left[name]
                if id_index.worn(wear[0], wear[1]):
                    served.wear[name] = [0, int(getattr(served.module, name).reindex())]
        _free_memory_to_the_system()

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logging.warning("%s", message)
