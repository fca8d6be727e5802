"""A dependency-free progress bar for long downloads, data generation and epochs.

On a terminal it redraws one line; in logs (not a tty) it prints a line every 10% so
CI output stays short but a stalled job is still visible.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Reports progress of `total` units of work to a stream (stderr by default).

    Args:
        total: Units expected (bytes, batches, ...); 0 or None if unknown.
        description: Short label printed before the bar.
        unit: Unit name used in the rate, e.g. ``"B"`` or ``"batch"``.
        stream: Where to write; defaults to ``sys.stderr``.
    """

    def __init__(
        self,
        total: int | None,
        description: str,
        unit: str = "",
        stream: TextIO | None = None,
    ) -> None:
        self.total = total or 0
        self.description = description
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._start = time.monotonic()
        self._is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self._last_draw = 0.0

    def update(self, amount: int) -> None:
        """Adds `amount` finished units and redraws when useful."""
        self.done += amount
        now = time.monotonic()
        if self._is_tty:
            if now - self._last_draw >= 0.1 or self.done >= self.total > 0:
                self._last_draw = now
                self.stream.write("\r" + self._line(now))
                self.stream.flush()
        elif self.total > 0:
            decile = min(10, self.done * 10 // self.total)
            if decile > self._last_decile:
                self._last_decile = decile
                self.stream.write(self._line(now) + "\n")
                self.stream.flush()

    def close(self) -> None:
        """Finishes the bar line on a terminal."""
        if self._is_tty:
            self.stream.write("\r" + self._line(time.monotonic()) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = f"{_human(self.done / elapsed)}{self.unit}/s"
        if self.total > 0:
            fraction = min(1.0, self.done / self.total)
            filled = int(fraction * 30)
            bar = "#" * filled + "." * (30 - filled)
            return (
                f"{self.description} [{bar}] {fraction:6.1%} "
                f"{_human(self.done)}/{_human(self.total)}{self.unit} {rate}"
            )
        return f"{self.description} {_human(self.done)}{self.unit} {rate}"


def _human(value: float) -> str:
    for suffix in ("", "k", "M", "G"):
        if abs(value) < 1000:
            return f"{value:.0f}{suffix}" if suffix == "" else f"{value:.1f}{suffix}"
        value /= 1000
    return f"{value:.1f}T"
