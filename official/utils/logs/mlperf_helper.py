"""MLPerf compliance logging: one small interface, two formats.

Benchmark code calls `MlperfLogger.event(key, value, **metadata)` where the MLPerf
reference logged; the logger writes one of

- ``mllog`` (default): ``:::MLLOG {json}`` lines through `mlperf_logging.mllog`, the
  format the maintained compliance checker reads;
- ``v0.5``: ``:::MLPv0.5.0 ncf <seconds> (file:line) tag: json`` lines with the tag
  set of the old ``mlperf_compliance`` package (MLPerf v0.5 NCF results).

Keys are mllog's (`mllog.constants` where it has one, the v0.5 tag where only v0.5
had one). v0.5 had a tag set per benchmark, which the benchmark passes in (a
`V05TagSet`; NCF's is `recommendation.mlperf.mlperf_tags`): the v0.5 writer renames the keys
its set names differently, turns ``epoch_num`` metadata into ``{"epoch", "value"}``
values, writes only the tags of the set and ends the log with ``run_final``.

A helper process (the data producer) logs through its own `MlperfLogger` into
`MlperfLogger.part_file`; when the run ends, `session` merges the part into the
main log in time order and replaces the log atomically, so nobody ever reads a
half-merged file. Each line is written and flushed at once, and a partial last line
(a process killed mid-write) is dropped by the merge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import logging as py_logging
import os
import re
import time
from collections.abc import Iterator, Mapping

import tensorflow as tf
from absl import logging
from mlperf_logging.mllog import constants as mllog_constants
from mlperf_logging.mllog import mllog

from official.utils.misc import atomic

MLLOG, V05 = "mllog", "v0.5"
FORMATS = (MLLOG, V05)
DEFAULT_LOG_FILE = "mlperf_compliance.log"
PART_SUFFIX = ".part"  # a helper process's lines, until merged into the log
DROP_CACHES_PATH = "/proc/sys/vm/drop_caches"
SUCCESS, ABORTED = mllog_constants.SUCCESS, mllog_constants.ABORTED

# Call sites are reported relative to the folder holding `official/`.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
_MLLOG_PREFIX = ":::MLLOG "
_V05_PREFIX = ":::MLPv0.5.0"
_V05_LINE = re.compile(
    r"^:::MLPv0\.5\.0 (?P<benchmark>\w+) (?P<time>\d+\.\d+) \((?P<callsite>[^)]*)\) "
    r"(?P<tag>\w+)(?:: (?P<value>.*))?$"
)


@dataclasses.dataclass(frozen=True)
class V05TagSet:
    """A benchmark's v0.5 tag set (the old ``mlperf_compliance`` package had one per
    benchmark): the v0.5 writer logs these tags only.

    Attributes:
        tags: The tags its log holds; events under other names are not written.
        renamed: mllog key -> the v0.5 tag of the same event, where the two differ.
    """

    tags: frozenset[str]
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MlperfOptions:
    """Where and how one run's compliance log is written, and who submits it.

    Attributes:
        log_file: The log (replaced at the start of each run).
        log_format: ``mllog`` or ``v0.5``.
        benchmark: ``submission_benchmark`` and the v0.5 line prefix (``ncf``).
        org, platform, division, status: The ``submission_*`` metadata.
        clear_caches: Drop the OS page cache first, as MLPerf requires (off on shared
            machines, where it slows everyone; the log then says it was not done).
    """

    log_file: str
    log_format: str = MLLOG
    benchmark: str = mllog_constants.NCF
    org: str = "reference_implementation"
    platform: str = "reference_implementation"
    division: str = mllog_constants.CLOSED
    status: str = mllog_constants.ONPREM
    clear_caches: bool = True


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One parsed compliance line (either format)."""

    time_s: float
    key: str
    value: object
    metadata: dict


class MlperfLogger:
    """Writes compliance events to one file; every call is a no-op when `path` is None.

    Args:
        path: The file, created afresh (None: log nothing).
        log_format: ``mllog`` or ``v0.5``.
        benchmark: Benchmark name of v0.5 lines.
        v05_tags: The benchmark's v0.5 tag set (needed for ``v0.5``).
    """

    def __init__(
        self,
        path: str | None,
        log_format: str = MLLOG,
        benchmark: str = "ncf",
        v05_tags: V05TagSet | None = None,
    ) -> None:
        if log_format not in FORMATS:
            raise ValueError(f"MLPerf log format must be one of {FORMATS}, not {log_format!r}")
        if path is not None and log_format == V05 and v05_tags is None:
            raise ValueError("a v0.5 MLPerf log needs the benchmark's v0.5 tag set")
        self.path = path
        self.log_format = log_format
        self.benchmark = benchmark
        self.v05_tags = v05_tags
        self.run_stopped = False
        self._stream = None
        if path is None:
            return
        tf.io.gfile.makedirs(os.path.dirname(path) or ".")
        self._stream = tf.io.gfile.GFile(path, "w")
        # A logger of our own (not mllog's shared one), so logs never share handlers.
        writer = py_logging.Logger(f"mlperf:{path}")
        writer.addHandler(_LineHandler(self._write_line))
        self._mllog = mllog.MLLogger(logger=writer, root_dir=_ROOT)

    @property
    def enabled(self) -> bool:
        return self._stream is not None

    @property
    def part_file(self) -> str:
        """Where a helper process writes its lines until `session` merges them
        ("" when disabled)."""
        return f"{self.path}{PART_SUFFIX}" if self.path else ""

    def event(self, key: str, value: object = None, **metadata) -> None:
        """Logs `key` (an mllog key) now, with the caller's file and line."""
        if self._stream is None:
            return
        if key == mllog_constants.RUN_STOP:
            self.run_stopped = True
        if self.log_format == MLLOG:
            log = (
                self._mllog.start
                if key.endswith("_start")
                else self._mllog.end
                if key.endswith("_stop")
                else self._mllog.event
            )
            # mllog walks the stack itself: past its own frames and this one.
            log(key=key, value=value, metadata=metadata, stack_offset=2)
            return
        tag = self.v05_tags.renamed.get(key, key)
        if tag in self.v05_tags.tags:
            callsite = mllog.get_caller(2, root_dir=_ROOT)
            self._write_line(self.v05_line(tag, _v05_value(key, value, metadata), callsite))

    def v05_line(self, tag: str, value: object = None, callsite: dict | None = None) -> str:
        """One ``:::MLPv0.5.0`` line stamped now."""
        where = callsite or mllog.get_caller(2, root_dir=_ROOT)
        line = f"{_V05_PREFIX} {self.benchmark} {time.time():.3f} "
        line += f"({where['file']}:{where['lineno']}) {tag}"
        return line if value is None else f"{line}: {json.dumps(value, default=_jsonable)}"

    def _write_line(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()  # whole lines only, visible at once

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class _LineHandler(py_logging.Handler):
    """Hands each formatted mllog line to a writer."""

    def __init__(self, write) -> None:
        super().__init__(py_logging.INFO)
        self._write = write

    def emit(self, record: py_logging.LogRecord) -> None:
        self._write(record.getMessage().lstrip("\n"))


def _v05_value(key: str, value: object, metadata: dict) -> object:
    if key == mllog_constants.RUN_STOP:
        return {"success": metadata.get("status") == SUCCESS}
    if "epoch_num" in metadata:
        epoch = metadata["epoch_num"]
        return epoch if value is None else {"epoch": epoch, "value": value}
    return value


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {value!r}")


def drop_page_cache(path: str = DROP_CACHES_PATH) -> tuple[bool, str]:
    """Flushes dirty pages and drops the OS page cache, so data is read cold (MLPerf
    requires it before each run); returns (done, why not)."""
    if os.geteuid() != 0:
        return False, "not running as root"
    os.sync()
    try:
        with open(path, "w") as control:
            control.write("3\n")
    except OSError as error:
        return False, f"cannot write {path}: {error.strerror or error}"
    return True, ""


@contextlib.contextmanager
def session(
    options: MlperfOptions | None, v05_tags: V05TagSet | None = None
) -> Iterator[MlperfLogger]:
    """One run's compliance log, from cache clearing to the merged final file.

    Logs, in order: ``cache_clear`` (after dropping the page cache, or with the
    reason it could not be dropped), ``init_start`` and the ``submission_*`` lines.
    On the way out it logs ``run_stop`` with status ``aborted`` if the run did not
    log its own (an exception, SIGTERM or Ctrl-C), merges the helper's part file in
    time order and, for v0.5, ends the log with ``run_final``.

    Args:
        options: What to write; None (e.g. on non-chief workers) logs nothing.
        v05_tags: The benchmark's v0.5 tag set (needed for the ``v0.5`` format).
    """
    if options is None:
        yield MlperfLogger(None)
        return
    logger = MlperfLogger(options.log_file, options.log_format, options.benchmark, v05_tags)
    if tf.io.gfile.exists(logger.part_file):
        tf.io.gfile.remove(logger.part_file)  # a previous run's leftover
    cleared, reason = (
        drop_page_cache() if options.clear_caches else (False, "disabled (--nomlperf_clear_caches)")
    )
    if cleared:
        logger.event(mllog_constants.CACHE_CLEAR, True)
    else:
        logging.warning("MLPerf: could not drop the page cache (%s)", reason)
        logger.event(mllog_constants.CACHE_CLEAR, False, reason=reason)
    logger.event(mllog_constants.INIT_START)
    for key, value in (
        (mllog_constants.SUBMISSION_BENCHMARK, options.benchmark),
        (mllog_constants.SUBMISSION_ORG, options.org),
        (mllog_constants.SUBMISSION_DIVISION, options.division),
        (mllog_constants.SUBMISSION_STATUS, options.status),
        (mllog_constants.SUBMISSION_PLATFORM, options.platform),
    ):
        logger.event(key, value)
    try:
        yield logger
    finally:
        if not logger.run_stopped:
            logger.event(mllog_constants.RUN_STOP, status=ABORTED)
        logger.close()
        final = [logger.v05_line("run_final")] if options.log_format == V05 else []
        merge_logs(options.log_file, logger.part_file, final)
        logging.info("MLPerf compliance log: %s", options.log_file)


def merge_logs(path: str, part_path: str, final_lines: list[str]) -> None:
    """Merges `part_path` into `path` by time, appends `final_lines`, then swaps the
    result in atomically and removes the part."""
    merged = heapq.merge(
        _timed_lines(path), _timed_lines(part_path), key=lambda timed: timed[0]
    )  # stable: at equal times the main log's line comes first
    lines = [line for _, line in merged] + final_lines
    atomic.write_file(path, "".join(line + "\n" for line in lines))
    if tf.io.gfile.exists(part_path):
        tf.io.gfile.remove(part_path)


def _timed_lines(path: str) -> list[tuple[float, str]]:
    """Complete lines of `path` with their times (a line without one keeps the time
    of the line before it, so it stays in place)."""
    timed, last = [], 0.0
    for line in read_complete_lines(path):
        record = parse_line(line)
        last = record.time_s if record is not None else last
        timed.append((last, line))
    return timed


def read_complete_lines(path: str) -> list[str]:
    """The lines of `path` that end in a newline (a partial last line is dropped)."""
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as stream:
        return stream.read().split("\n")[:-1]


def parse_line(line: str) -> LogRecord | None:
    """A compliance line of either format, or None if the line is not one."""
    if line.startswith(_MLLOG_PREFIX):
        try:
            entry = json.loads(line[len(_MLLOG_PREFIX) :])
        except json.JSONDecodeError:
            return None
        return LogRecord(
            entry["time_ms"] / 1e3, entry["key"], entry.get("value"), entry.get("metadata") or {}
        )
    match = _V05_LINE.match(line)
    if match is None:
        return None
    value = match.group("value")
    return LogRecord(
        float(match.group("time")),
        match.group("tag"),
        json.loads(value) if value is not None else None,
        {"callsite": match.group("callsite")},
    )


def read_log(path: str) -> list[LogRecord]:
    """Every compliance record of `path`, in file order."""
    return [record for record in map(parse_line, read_complete_lines(path)) if record]
