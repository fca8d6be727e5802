"""One model per consumer group (`group_claim`), on a real Redis: who may take a claim,
who is refused and what each is told."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest
from absl import logging

from official.core import writer_lease
from recommendation.online.sources.group_claim import GroupClaim, GroupClaimError, claim_key

HOST = socket.gethostname()


def _exited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _their_claim(client, model_dir: str = "/models/a", **fields) -> dict:
    """The claim of group ``trainer`` of stream ``events`` as another trainer (pid 1,
    which runs) would have left it."""
    claim = {
        **writer_lease.holder_record("ncf-online", model_dir=model_dir),
        "pid": 1,
        "pid_started": writer_lease._start_time(1),
        "token": "theirs",
        **fields,
    }
    client.set(claim_key("events", "trainer"), json.dumps(claim))
    return claim


def _held(client) -> dict:
    return json.loads(client.get(claim_key("events", "trainer")))


def _claim(client, model_dir: str, **options) -> GroupClaim:
    return GroupClaim(client, "events", "trainer", model_dir, **options)


@pytest.mark.integration
def test_a_live_trainer_of_another_model_keeps_its_group(redis_server):
    client = redis_server.client()
    _their_claim(client)
    with pytest.raises(GroupClaimError) as refused:
        _claim(client, "/models/b").acquire()
    assert re.fullmatch(
        rf"consumer group 'trainer' of stream 'events' is read by the model in /models/a "
        rf"\(ncf-online \(pid 1 on host {HOST}, since [-0-9 :]+ UTC\), claim renewed 0 s ago\); "
        r"a group hands each entry to one reader, so two models would each train part of "
        r"the stream: give this model its own --group \(it reads the stream from its "
        r"start\), or pass that --model_dir to resume that model \(it is released as soon "
        r"as that process ends\)",
        str(refused.value),
    )
    assert _held(client)["token"] == "theirs"


@pytest.mark.integration
@pytest.mark.parametrize(
    "model_dir, fields, warned",
    [
        ("/models/a/", {}, None),  # the same model (its path spelt otherwise): at once
        ("/models/b", {"pid": "exited"}, "its process is gone"),
        ("/models/b", {"host": "elsewhere", "renewed": 0.0}, "it has not renewed its claim"),
        ("/models/b", {"released": 1.0}, "it stopped and released it"),
    ],
)
def test_a_claim_passes_to_its_own_model_at_once_and_to_another_once_free(
    redis_server, model_dir, fields, warned, monkeypatch
):
    client = redis_server.client()
    if fields.get("pid") == "exited":
        fields = {"pid": _exited_pid(), "pid_started": None}
    _their_claim(client, **fields)
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda text, *args: warnings.append(text % args))
    claim = _claim(client, model_dir)
    claim.acquire()
    assert _held(client)["token"] == claim.record["token"]
    if warned is None:
        assert warnings == []
    else:
        (warning,) = warnings
        assert warning.startswith(
            "taking over consumer group 'trainer' of stream 'events' from the model in "
            f"/models/a (ncf-online (pid {fields.get('pid', 1)} on host "
            f"{fields.get('host', HOST)}, since "
        )
        assert f"): {warned}" in warning and warning.endswith(
            "; the group's entries before now trained that model, not this one"
        )
    claim.release()
    released = _held(client)
    assert released["token"] == claim.record["token"] and released["released"] > 0


@pytest.mark.integration
def test_a_holder_renews_its_claim_and_stops_acknowledging_once_it_is_taken(redis_server):
    client = redis_server.client()
    claim = _claim(client, "/models/a", renew_seconds=0.05)
    claim.acquire()
    first = _held(client)["renewed"]
    deadline = time.monotonic() + 30
    while _held(client)["renewed"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _held(client)["renewed"] > first  # renewed
    claim.check()  # still its own
    _their_claim(client, "/models/b")  # taken over (this one was paused too long)
    with pytest.raises(GroupClaimError, match=r"was taken over by the model in /models/b \("):
        claim.check()
    claim.release()
    assert _held(client)["token"] == "theirs"  # not this one's to release
