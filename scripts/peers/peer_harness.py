"""What a peer harness needs besides its model: an event folder's events in the order
ncf-online reads them, test-then-train by the prequential protocol over them chunk by
chunk, and the result as JSON with the keys of ncf-online's summary.

A peer supplies a `Learner` (scores a user's candidate items with the model as it is;
learns a chunk's examples in order) and calls `main`, adding its own flags if it has
any. For each chunk of events the
protocol's `plan` is scored and recorded, then the learner learns each event as a
positive (label 1) followed by `num_neg` items drawn (seeded, with replacement) from
the distinct items seen so far, this chunk's included, as negatives (label 0; a draw
equal to the event's item is left out, as ncf-online leaves it out). What is scored,
and against which items, does not depend on the chunk size (`prequential`); the
model's state at each score does, as a batch size does.

Peers run in their own virtual environments (no TensorFlow, no project installed), so
the project's numpy-only modules are loaded by file path: the protocol
(recommendation/online/prequential.py), the event-file rules
(recommendation/online/sources/event_parsing.py) and the reading of a process's memory
(official/utils/misc/machine.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Protocol

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(path: str) -> ModuleType:
    """The project's module at `path` (from the checkout's root), without its package."""
    name = "peer_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


prequential = _load("recommendation/online/prequential.py")
event_parsing = _load("recommendation/online/sources/event_parsing.py")
machine = _load("official/utils/misc/machine.py")

# ncf-online's defaults: --batch_size (events a chunk here), --num_neg, and (the
# protocol's own defaults) --prequential_every, --prequential_negatives,
# --prequential_window_events and --top_k.
CHUNK_EVENTS = 4096
NUM_NEG = 4
PROTOCOL_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(prequential.Prequential).parameters.items()
}
# Steady events/s count from the first chunk that ends this long into the run, as the
# table benchmarks count ncf-online's from its first metric report (one a second).
WARMUP_SECONDS = 1.0
READ_BYTES = 1 << 20  # of an event file at a time


class HarnessError(Exception):
    """Bad input, said in one line (`main` prints it after ``error:``)."""


class Learner(Protocol):
    """A peer's model, as the harness drives it."""

    def score(self, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """`(n, c)` scores of `candidates` `(n, c)`, row i for `users[i]`, by the model
        as it is (higher: preferred)."""

    def learn(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> None:
        """Learns the `(m,)` examples (user, item, label 1 or 0) in this order."""

    def tables(self) -> dict[str, dict]:
        """``user`` and ``item``: ``ids`` held, ``capacity`` (None: unbounded),
        ``admitted``, ``evicted``, ``refused`` (ncf-online's `TableWatch.counts`), and
        whatever else the peer's library reports of its tables."""

    def describe(self) -> dict:
        """What the model is (library, version, settings), for the result."""

    # A learner may also define ``test_then_add(plan, items) -> scores``: the scores of
    # `plan`'s events, each knowing the chunk's events before it (`items`: the chunk's,
    # in order), the chunk then taken in (the ladder's popularity rungs); `score` is
    # then not called.


class EventFolder:
    """The events of a folder's ``*.csv`` / ``*.jsonl`` files as ncf-online's
    `DirectorySource` reads them: files in name order, complete (newline-terminated)
    lines only, split as it splits them, a CSV file's header line skipped, each line
    through `event_parsing.parse_line`. A plain reader rather than `DirectorySource`:
    that one tails files through TensorFlow's file system and keeps positions for
    restarts, none of which one pass over a folder needs, and a peer's environment has
    no TensorFlow. Lines it refuses are counted (`dead_letters`, where ncf-online
    dead-letters them) and the first is named on stderr.
    """

    def __init__(self, directory: str) -> None:
        if not os.path.isdir(directory):
            raise HarnessError(f"--events_dir {directory} is not a folder")
        self.directory = directory
        self.files = sorted(
            name
            for name in os.listdir(directory)
            if name.endswith(event_parsing.EVENT_FILE_SUFFIXES)
        )
        self.dead_letters = 0

    def chunks(self, chunk_events: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`(users, items, timestamps)`, int64 arrays of `chunk_events` events each
        (the last one the rest)."""
        pending: list[np.ndarray] = []
        count = 0
        for events in self._events():
            pending.append(events)
            count += len(events)
            while count >= chunk_events:
                events = np.concatenate(pending)
                yield _columns(events[:chunk_events])
                pending, count = [events[chunk_events:]], count - chunk_events
        if count:
            yield _columns(np.concatenate(pending))

    def _events(self) -> Iterator[np.ndarray]:
        """`(n, 3)` arrays of the folder's events in order: runs of plain CSV lines
        converted at once, as `DirectorySource` converts them, the other lines one at
        a time (so that reading costs each system what it costs ncf-online)."""
        for name in self.files:
            is_csv, rest, lines_before = name.endswith(".csv"), b"", 0
            with open(os.path.join(self.directory, name), "rb") as stream:
                while block := stream.read(READ_BYTES):
                    data = rest + block
                    end = data.rfind(b"\n") + 1  # a line still being written: not yet
                    lines, rest = data[:end], data[end:]
                    done = 0
                    runs = event_parsing.plain_csv_runs(lines) if is_csv else []
                    for start, stop in [*runs, (len(lines), len(lines))]:
                        where = (name, lines_before + lines.count(b"\n", 0, done))
                        yield self._one_at_a_time(lines[done:start], is_csv, where)
                        yield event_parsing.plain_csv_events(lines[start:stop], stop - start)[0]
                        done = stop
                    lines_before += lines.count(b"\n")

    def _one_at_a_time(self, lines: bytes, is_csv: bool, where: tuple[str, int]) -> np.ndarray:
        """The events of `lines` parsed one at a time; `where`: their file and the lines
        before them in it (none: the first piece may be a CSV header)."""
        name, number = where
        first, events = number == 0, []
        for line in lines.splitlines(keepends=True):  # a bare \r ends a line there too
            text, is_first, first = line.strip(), first, False
            if text and not (is_csv and is_first and event_parsing.is_header(text)):
                try:
                    events.append(event_parsing.parse_line(text, is_csv))
                except ValueError as error:
                    self._refuse(f"{name} line {number + 1}", error)
            number += line.endswith(b"\n")
        return np.array(events, np.int64).reshape(-1, 3)

    def _refuse(self, where: str, error: ValueError) -> None:
        if not self.dead_letters:
            print(f"warning: {where} skipped: {error}", file=sys.stderr, flush=True)
        self.dead_letters += 1


def _columns(events: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return events[:, 0], events[:, 1], events[:, 2]


class SeenItems:
    """The distinct items seen so far, in first-seen order, and seeded uniform draws
    from them (the training negatives)."""

    def __init__(self, seed: int | None) -> None:
        self._known = prequential.IdCounts(1)  # membership only
        self._items = np.zeros(1024, np.int64)
        self.size = 0
        self._random = np.random.default_rng(seed)

    def add(self, items: np.ndarray) -> None:
        new = items[self._known.count_and_add(items) == 0]  # each new item's first time
        if self.size + len(new) > len(self._items):
            grown = np.zeros(max(2 * len(self._items), self.size + len(new)), np.int64)
            grown[: self.size] = self._items[: self.size]
            self._items = grown
        self._items[self.size : self.size + len(new)] = new
        self.size += len(new)

    def draw(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._items[self._random.integers(0, self.size, shape)]


def training_examples(
    users: np.ndarray, items: np.ndarray, negatives: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each event's positive, then its `negatives` row (those not its own item), as
    `(users, items, labels)` in that order."""
    every_item = np.concatenate([items[:, None], negatives], axis=1)
    keep = np.concatenate([np.ones((len(items), 1), bool), negatives != items[:, None]], axis=1)
    labels = np.zeros(every_item.shape, np.int64)
    labels[:, 0] = 1
    every_user = np.broadcast_to(users[:, None], every_item.shape)
    return every_user[keep], every_item[keep], labels[keep]


def run(
    chunks: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]],
    learner: Learner,
    protocol,
    num_neg: int = NUM_NEG,
    seed: int | None = None,
    max_events: int | None = None,
    on_chunk: Callable[[int, float], None] | None = None,
    resident: int | None = None,
) -> dict:
    """Test, then train, chunk by chunk (module docstring) until the chunks end or
    `max_events` (whole chunks; the one that reaches it is the last); `on_chunk` is
    called with the events so far and the seconds since the start.

    Returns:
        ``events``, ``seconds``, ``events_per_second``, ``steady_events_per_second``
        (after `WARMUP_SECONDS`; None for a shorter run) and ``bytes_per_id``: how much
        this process's resident memory (VmRSS) grew from `resident` (default: before
        the first event; `main` reads it before the learner is made, so that tables
        allocated whole up front count) to after the last event, over the ids the
        learner holds then (its tables, and the protocol's and the negatives' few
        bytes an id, as in ncf-online's process).
    """
    seen = SeenItems(seed)
    if resident is None:
        resident = machine.resident_bytes(os.getpid())
    start = time.perf_counter()
    events, warm = 0, None
    for users, items, times in chunks:
        plan = protocol.plan(users, items, times)
        if hasattr(learner, "test_then_add"):  # follows the chunk event by event
            scores = learner.test_then_add(plan, items)
        else:
            scores = learner.score(plan.users, plan.candidates) if plan.size else None
        if plan.size:
            protocol.record(plan, scores)
        seen.add(items)
        learner.learn(*training_examples(users, items, seen.draw((len(items), num_neg))))
        events += len(users)
        seconds = time.perf_counter() - start
        if warm is None and seconds >= WARMUP_SECONDS:
            warm = (events, seconds)
        if on_chunk is not None:
            on_chunk(events, seconds)
        if max_events and events >= max_events:
            break
    seconds = time.perf_counter() - start
    grown = machine.resident_bytes(os.getpid()) - resident
    ids = sum(table["ids"] for table in learner.tables().values())
    steady = None
    if warm is not None and events > warm[0]:
        steady = (events - warm[0]) / (seconds - warm[1])
    return {
        "events": events,
        "seconds": seconds,
        "events_per_second": events / max(seconds, 1e-9),
        "steady_events_per_second": steady,
        "bytes_per_id": grown / ids if ids else None,
    }


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive(text: str) -> int:
    """An argparse type: a positive integer."""
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_rate(text: str) -> float:
    """An argparse type: a positive number (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag as one ``error:`` line (argparse prints its usage first)."""
        print(f"error: {message} (--help lists the flags)", file=sys.stderr)
        sys.exit(2)


def parse_flags(
    argv: list[str],
    description: str,
    add_flags: Callable[[Callable[..., argparse.Action]], None] | None = None,
) -> argparse.Namespace:
    """The harness's flags (ncf-online's names and defaults where it has the flag),
    and the peer's own, which `add_flags` adds with the ``add_argument`` it is given."""
    parser = _ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    flag = parser.add_argument
    flag("--events_dir", required=True, help="Folder of *.csv / *.jsonl event files.")
    flag("--summary_file", help="Write the result here (JSON).")
    flag(
        "--chunk_events",
        "--batch_size",
        type=positive,
        default=CHUNK_EVENTS,
        help="Events per chunk (ncf-online's --batch_size: a batched learner's step).",
    )
    flag("--num_neg", type=_non_negative, default=NUM_NEG, help="Negatives per event.")
    flag(
        "--prequential_every",
        type=_non_negative,
        default=PROTOCOL_DEFAULTS["every"],
        help="Score 1 event in this many (chosen by a hash of the event) before learning "
        "it (1: every event, 0: none).",
    )
    flag(
        "--prequential_negatives",
        type=positive,
        default=PROTOCOL_DEFAULTS["negatives"],
        help="Items drawn from those seen before each scored event to rank it against.",
    )
    flag(
        "--prequential_window_events",
        type=positive,
        default=PROTOCOL_DEFAULTS["window_events"],
        help="Events per window of the prequential curve.",
    )
    flag("--top_k", type=positive, default=PROTOCOL_DEFAULTS["top_k"], help="HR and NDCG cut-off.")
    flag("--max_events", type=positive, help="Stop after the chunk that reaches this many.")
    flag("--seed", type=_integer, help="Fixes the model's initial weights and the negatives.")
    flag("--log_every_secs", type=float, default=10.0, help="Progress cadence (stderr).")
    if add_flags is not None:
        add_flags(flag)
    return parser.parse_args(argv)


def main(
    argv: list[str],
    name: str,
    description: str,
    make_learner: Callable[[argparse.Namespace], Learner],
    add_flags: Callable[[Callable[..., argparse.Action]], None] | None = None,
) -> dict:
    """The command line: reads the flags (`parse_flags`), runs `make_learner(flags)`
    over the folder, prints one line (and writes the result JSON); bad input ends it
    with one ``error:`` line. Returns the result."""
    flags = parse_flags(argv, description, add_flags)
    try:
        return _main(flags, name, make_learner)
    except HarnessError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


def _main(
    flags: argparse.Namespace, name: str, make_learner: Callable[[argparse.Namespace], Learner]
) -> dict:
    folder = EventFolder(flags.events_dir)
    summary_folder = os.path.dirname(os.path.abspath(flags.summary_file or "."))
    if flags.summary_file and not os.path.isdir(summary_folder):
        raise HarnessError(f"--summary_file {flags.summary_file}: {summary_folder} is not a folder")
    if not folder.files:
        raise HarnessError(f"no *.csv or *.jsonl event files in {flags.events_dir}")
    protocol = prequential.Prequential(
        flags.prequential_every,
        flags.prequential_negatives,
        flags.top_k,
        window_events=flags.prequential_window_events,
    )
    resident = machine.resident_bytes(os.getpid())
    learner = make_learner(flags)
    last_report = 0.0

    def report(events: int, seconds: float) -> None:
        nonlocal last_report
        if seconds - last_report >= flags.log_every_secs:
            last_report = seconds
            print(f"{name}: {progress_text(events, seconds, protocol)}", file=sys.stderr)

    timing = run(
        folder.chunks(flags.chunk_events),
        learner,
        protocol,
        flags.num_neg,
        flags.seed,
        flags.max_events,
        report,
        resident,
    )
    if not timing["events"]:
        raise HarnessError(
            f"no events in {flags.events_dir} ({folder.dead_letters} lines refused): "
            "lines of user,item,timestamp (*.csv) or JSON objects (*.jsonl)"
        )
    result = {
        **timing,
        "peak_rss": machine.peak_rss_bytes(os.getpid()),
        "tables": learner.tables(),
        "dead_letters": folder.dead_letters,
        "prequential": protocol.results(),
        "peer": learner.describe(),
        "settings": {
            "chunk_events": flags.chunk_events,
            "num_neg": flags.num_neg,
            "seed": flags.seed,
            "max_events": flags.max_events,
        },
    }
    if flags.summary_file:
        write_json(flags.summary_file, result)
    print(f"{name}: {result_line(result)}")
    return result


def progress_text(events: int, seconds: float, protocol) -> str:
    """Events so far, their rate and the protocol's HR so far."""
    results = protocol.results()
    hr = results["all"]["hr"]
    return (
        f"{events:,} events in {seconds:.0f} s ({events / max(seconds, 1e-9):,.0f} events/s), "
        f"prequential HR@{results['top_k']} "
        f"{'n/a' if hr is None else f'{hr:.4f}'} ({results['all']['scored']:,} scored)"
    )


def result_line(result: dict) -> str:
    """The one line a user reads at the end."""

    def hr(cohort: str) -> str:
        value = result["prequential"][cohort]["hr"]
        return "n/a" if value is None else f"{value:.4f}"

    tables = result["tables"]
    return (
        f"{result['events']:,} events in {result['seconds']:.1f} s "
        f"({result['events_per_second']:,.0f} events/s), prequential "
        f"HR@{result['prequential']['top_k']}={hr('all')} (cold {hr('cold')}, warm "
        f"{hr('warm')}), users {tables['user']['ids']:,}, items {tables['item']['ids']:,}, "
        f"peak RSS {result['peak_rss'] / 2**20:,.0f} MB, dead letters {result['dead_letters']}"
    )


def write_json(path: str, value: dict) -> None:
    """`value` as JSON at `path`, whole or not at all (a temporary file renamed)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w") as stream:
            json.dump(value, stream, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise HarnessError(f"cannot write --summary_file {path}: {error}") from None
