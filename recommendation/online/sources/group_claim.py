"""One model per consumer group: the trainer of a model_dir claims its group.

A consumer group hands each entry to one of its readers (Redis), or keeps one set of
offsets that lag tools read as the group's (Kafka). Two trainers of different models
under one group (a deployment copied, a pasted command) would each train part of the
stream, or pass their offsets off as each other's, and both look healthy. So the
trainer claims the group with a holder record (`writer_lease`'s: program, host, pid,
since, renewed) and the model_dir, renewed every `renew_seconds`. `Claim` holds the
rules, the same for every broker; where the record lives is its subclass's: a Redis
key beside the stream, ``<stream>:claim:<group>`` (`GroupClaim`), or a claims topic
(`kafka_claim`).

- a trainer of another model_dir finds the claim held and stops with one line naming
  the holder and the fix (another ``--group`` for another model, the same model_dir
  to resume);
- a trainer of the same model_dir takes it at once: only one process can hold a
  model_dir (its writer lease), so the holder found is that model's earlier run
  (crashed, or stopped) or its cluster's chief before a restart;
- a claim whose holder is gone (its process on this host, a restart of its machine,
  or `expire_seconds` without a renewal elsewhere) or that its holder released when
  it stopped is taken over by another model_dir with a warning: the group's earlier
  entries trained the model named there, not this one;
- the holder checks the claim before every acknowledgement (`check`): if another
  trainer took it over meanwhile (this one went without renewing for longer than
  `expire_seconds`), it stops without acknowledging.

A group read by several processes of one model on purpose says so (``--share_group``)
and takes no claim. Check and write happen in one optimistic transaction (on Redis:
WATCH, GET, MULTI, SET, EXEC): two trainers starting together cannot both win.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from absl import logging

from official.core import writer_lease

RENEW_SECONDS = writer_lease.RENEW_SECONDS
EXPIRE_SECONDS = writer_lease.EXPIRE_SECONDS
# What a claim sends, as ACL rules name them (`redis_source.COMMANDS` adds them).
COMMANDS = ("get", "set", "watch", "unwatch")


class GroupClaimError(Exception):
    """The group is another model's; the message names its holder and the fix."""


def claim_key(stream: str, group: str) -> str:
    """The key beside `stream` that holds `group`'s claim."""
    return f"{stream}:claim:{group}"


class Claim:
    """The claim of `group` on `stream` for the trainer of `model_dir` (`acquire`,
    `check`, `release`), wherever a subclass keeps it (`_transact`, `_current`).

    Args:
        stream, group: The stream (or topic) and the consumer group claimed.
        model_dir: The model the group's entries train.
        key: What names the claim where it is kept (in messages).
        renew_seconds, expire_seconds: The module docstring's.
    """

    # What the stream is called, the flag that names the group, and the errors of the
    # store that a renewal retries.
    noun = "stream"
    group_flag = "--group"
    failures: tuple[type[Exception], ...] = ()

    def __init__(
        self,
        stream: str,
        group: str,
        model_dir: str,
        key: str,
        renew_seconds: float = RENEW_SECONDS,
        expire_seconds: float = EXPIRE_SECONDS,
    ) -> None:
        self.stream, self.group, self.key = stream, group, key
        self.model_dir = writer_lease.folder_key(model_dir)
        self.renew_seconds, self.expire_seconds = renew_seconds, expire_seconds
        self.record = writer_lease.holder_record("ncf-online", model_dir=self.model_dir)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._taken_by: dict | None = None

    def _transact(self, decide: Callable[[dict | None], bool]) -> None:
        """Writes this trainer's record if `decide(the claim found)` says so, as one
        transaction (`decide` may raise: nothing is written)."""
        raise NotImplementedError

    def _current(self) -> dict | None:
        """The claim as it is now (None: none)."""
        raise NotImplementedError

    def _ours(self, found: dict | None) -> bool:
        return found is not None and found["token"] == self.record["token"]

    def _what(self) -> str:
        return f"consumer group {self.group!r} of {self.noun} {self.stream!r}"

    def acquire(self) -> None:
        """Claims the group, or raises `GroupClaimError` naming the live holder of
        another model_dir."""

        def take(found: dict | None) -> bool:
            if found is None or found.get("model_dir") == self.model_dir:
                return True
            reason = (
                "it stopped and released it"
                if found.get("released")
                else writer_lease.stale_reason(found, self.expire_seconds, "claim")
            )
            if reason is None:
                raise GroupClaimError(self._refusal(found))
            logging.warning(
                "taking over %s from the model in %s (%s): %s; "
                "the group's entries before now trained that model, not this one",
                self._what(),
                found.get("model_dir"),
                writer_lease.describe_holder(found),
                reason,
            )
            return True

        self._transact(take)
        self._renewer = threading.Thread(
            target=writer_lease.renew_until,
            args=(self._stop, self.renew_seconds, self._renew, f"the claim {self.key}"),
            kwargs={"failures": self.failures},
            daemon=True,
            name="claim",
        )
        self._renewer.start()

    def _refusal(self, found: dict) -> str:
        silent = max(0.0, time.time() - float(found.get("renewed", 0)))
        return (
            f"{self._what()} is read by the model "
            f"in {found.get('model_dir')} ({writer_lease.describe_holder(found)}, claim "
            f"renewed {silent:.0f} s ago); a group hands each entry to one reader, so two "
            f"models would each train part of the {self.noun}: "
            f"give this model its own {self.group_flag} (it reads the {self.noun} from its "
            "start), "
            "or pass that --model_dir to resume that model "
            f"({writer_lease.expiry(found, self.expire_seconds)})"
        )

    def _renew(self) -> bool:
        """Renews the claim; False once another trainer has taken it over."""

        def still_ours(found: dict | None) -> bool:
            if found is not None and not self._ours(found):
                self._taken_by = found
                return False
            return True

        self.record["renewed"] = time.time()
        self._transact(still_ours)
        return self._taken_by is None

    def check(self) -> None:
        """Raises `GroupClaimError` if another trainer has taken the claim over."""
        if self._taken_by is None:
            found = self._current()
            if found is not None and not self._ours(found):
                self._taken_by = found
        if self._taken_by is not None:
            raise GroupClaimError(
                f"{self._what()} was taken over by "
                f"the model in {self._taken_by.get('model_dir')} "
                f"({writer_lease.describe_holder(self._taken_by)}) while this trainer held "
                f"it (it went without renewing its claim for longer than "
                f"{self.expire_seconds:.0f} s: paused or cut off); it stops without "
                "acknowledging: the group is the other model's now"
            )

    def release(self) -> None:
        """Stops renewing and marks the claim released if it is still this trainer's:
        a trainer of another model_dir may then take it over (with a warning)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._taken_by is not None:
            return
        self.record["released"] = time.time()
        try:
            self._transact(self._ours)
        except self.failures as error:
            logging.warning("cannot release the claim %s (%s)", self.key, error)


class GroupClaim(Claim):
    """`Claim` kept in a Redis key beside the stream, `claim_key(stream, group)`, written
    in optimistic transactions (WATCH, GET, MULTI, SET, EXEC).

    Args:
        client: A ``redis.Redis`` client.
        stream, group, model_dir, renew_seconds, expire_seconds: `Claim`'s.
    """

    failures = (redis.RedisError,)

    def __init__(
        self, client: redis.Redis, stream: str, group: str, model_dir: str, **options: Any
    ):
        super().__init__(stream, group, model_dir, claim_key(stream, group), **options)
        self.client = client

    def _parse(self, value: bytes | None) -> dict | None:
        try:
            found = json.loads(value) if value is not None else None
        except ValueError:
            found = None
        return found if isinstance(found, dict) and "token" in found else None

    def _current(self) -> dict | None:
        return self._parse(self.client.get(self.key))

    def _transact(self, decide: Callable[[dict | None], bool]) -> None:
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    if not decide(self._parse(pipe.get(self.key))):
                        return
                    pipe.multi()
                    pipe.set(self.key, json.dumps(self.record, sort_keys=True))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue
