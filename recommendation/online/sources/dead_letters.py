"""Dead letters: the events that cannot become training examples, each recorded once
with its reason, so that no event stops training.

`DeadLetterFile` appends them to a JSON-lines file (a `RedisSource` writes them to a
stream instead); `payload_text` is what both keep of an event.
"""

from __future__ import annotations

import json
import os
from typing import Any

import tensorflow as tf
from absl import logging

from recommendation.online.sources.event_parsing import shorten

# Dead letters keep this much of the payload.
MAX_PAYLOAD_CHARS = 1000


def payload_text(payload: Any) -> str:
    """A dead letter's payload as text, cut to `MAX_PAYLOAD_CHARS`."""
    if isinstance(payload, bytes):
        text = payload.decode("utf-8", "replace")
    elif isinstance(payload, str):
        text = payload
    else:
        text = json.dumps(_printable(payload), default=repr)
    return shorten(text, MAX_PAYLOAD_CHARS)


def _printable(payload: Any) -> Any:
    if isinstance(payload, bytes):
        return payload.decode("utf-8", "replace")
    if isinstance(payload, dict):
        return {str(_printable(k)): _printable(v) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        return [_printable(v) for v in payload]
    return payload


def _ordered_id(source_id: str) -> tuple[str, int]:
    """``"<key>:<n>"`` or ``"<n>"`` -> (key, n)."""
    key, _, number = source_id.rpartition(":")
    return key, int(number)


class DeadLetterFile:
    """Appends malformed events to a JSON-lines file, one object per event, once.

    Source ids are ``<file>:<offset>`` or ``<ordinal>``, increasing per file in the
    order a source reads them, so an id at or before the last one the file holds for
    its file was recorded before a restart and is not written again. The file is read
    once, at the first write; a last line torn by a crash is ignored (that event is
    recorded again when it is read again) and left on a line of its own.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._last: dict[str, int] | None = None  # highest recorded offset per file
        self._torn = False

    def _load(self) -> dict[str, int]:
        last: dict[str, int] = {}
        if not tf.io.gfile.exists(self.path):
            tf.io.gfile.makedirs(os.path.dirname(self.path) or ".")
            return last
        line = ""
        with tf.io.gfile.GFile(self.path, "r") as stream:
            for line in stream:
                try:
                    key, number = _ordered_id(json.loads(line)["id"])
                except (ValueError, KeyError, TypeError):
                    continue  # torn by a crash
                last[key] = max(number, last.get(key, -1))
        self._torn = bool(line) and not line.endswith("\n")
        return last

    def add(self, source_id: str, payload: Any, error: str) -> bool:
        """Records one malformed event unless it is already there; returns whether it
        was written now."""
        if self._last is None:
            self._last = self._load()
        key, number = _ordered_id(source_id)
        if number <= self._last.get(key, -1):
            return False
        record = {"id": source_id, "error": error, "payload": payload_text(payload)}
        with tf.io.gfile.GFile(self.path, "a") as out:
            out.write(("\n" if self._torn else "") + json.dumps(record) + "\n")
        self._torn = False
        self._last[key] = number
        logging.log_every_n(logging.WARNING, "dead letter %s: %s", 100, source_id, error)
        return True
