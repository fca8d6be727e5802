"""Benchmarks our preprocessing against the TF Model Garden reference on one ratings file.

Usage::

    python scripts/benchmark_preprocessing.py --ratings /path/to/ml-1m/ratings.dat
    python scripts/benchmark_preprocessing.py --ratings /tmp/bench/ml-20m/ratings.csv

Each method runs in its own child process (this script re-run with ``--method``), so
its peak RSS is its own and not the parent's; times are taken inside the child around
the work only (imports and interpreter start are excluded). The reference child never
imports TensorFlow, so TensorFlow's import is charged to our methods only.

Methods:
  ours              `ratings_readers.read_ratings_file` + `data_preprocessing.preprocess`.
  ours_ml_perf      the same with ``ml_perf=True`` (the reference's tie order), used to
                    check that both methods produce the same split.
  cache_build       `preprocessing_cache.load_or_build` on an empty cache dir (builds it).
  cache_load        `load_or_build` again, in a fresh process: loads the cache.
  reference         a faithful re-implementation of the Model Garden NCF
                    ``data_preprocessing._filter_index_sort`` (TF Model Garden 2.15).

Printed: each method's seconds per stage and peak RSS, the cache load, the speed ratio
of the reference to ours, and whether the splits agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import pandas as pd

from official.utils.misc import machine  # no TensorFlow import

MIN_NUM_RATINGS = 20  # the reference's rconst.MIN_NUM_RATINGS
# The reference's rconst.USER_DTYPE / ITEM_DTYPE.
REFERENCE_USER_DTYPE = np.int32
REFERENCE_ITEM_DTYPE = np.uint16
# Column names the Model Garden's movielens.py gave the regularised ratings CSV.
USER_COLUMN = "user_id"
ITEM_COLUMN = "item_id"
RATING_COLUMN = "rating"
TIMESTAMP_COLUMN = "timestamp"
COLUMNS = [USER_COLUMN, ITEM_COLUMN, RATING_COLUMN, TIMESTAMP_COLUMN]

DATASET_BY_FILE = {"ratings.dat": "ml-1m", "ratings.csv": "ml-20m"}
OUR_METHODS = ("ours", "ours_ml_perf", "cache_build", "cache_load")
# Methods whose runs do not depend on each other, so --repeats can rerun them.
REPEATABLE_METHODS = ("ours", "ours_ml_perf")
LABELS = {
    "ours": "ours",
    "ours_ml_perf": "ours (ml_perf=True)",
    "cache_build": "ours, cache build",
    "cache_load": "ours, cache load",
    "reference": "reference (Model Garden)",
}
GIB = 1 << 30
_STARTUP_GRACE_SEC = 120


# ---------------------------------------------------------------------------
# Child side: one method, timed around the work only.


class Progress:
    """Appends timestamped events to a file, so a killed child still tells how far it got."""

    def __init__(self, path: str):
        self._path = path

    def event(self, **fields) -> None:
        with open(self._path, "a") as out:
            out.write(json.dumps(fields) + "\n")


def _is_dat(path: str) -> bool:
    return path.endswith(".dat")


def run_ours(ratings: str, ml_perf: bool, progress: Progress) -> dict:
    """Times our reader and `preprocess`; returns timings and the split to compare."""
    # Imported here, not at the top, so the reference's process never loads TensorFlow.
    from recommendation.data import data_preprocessing, movielens, ratings_readers

    file_format = movielens.DAT_FORMAT if _is_dat(ratings) else movielens.CSV_FORMAT
    progress.event(event="start", time=time.time())
    start = time.perf_counter()
    raw = ratings_readers.read_ratings_file(ratings, file_format)
    read_done = time.perf_counter()
    progress.event(event="read", read_s=read_done - start)
    data = data_preprocessing.preprocess(raw, ml_perf=ml_perf)
    end = time.perf_counter()
    return {
        "read_s": read_done - start,
        "process_s": end - read_done,
        "total_s": end - start,
        "num_rows": len(raw),
        "arrays": _our_arrays(data),
    }


def run_cache(dataset: str, work_dir: str, progress: Progress) -> dict:
    """Times one `load_or_build` call against the cache in `work_dir`."""
    from recommendation.data import data_preprocessing, preprocessing_cache

    config = data_preprocessing.DataConfig(
        dataset=dataset,
        data_dir=os.path.join(work_dir, "data"),
        cache_dir=os.path.join(work_dir, "cache"),
    )
    progress.event(event="start", time=time.time())
    start = time.perf_counter()
    result = preprocessing_cache.load_or_build(config)
    end = time.perf_counter()
    return {
        "total_s": end - start,
        "from_cache": result.from_cache,
        "reason": result.reason,
        "arrays": _our_arrays(result.data),
    }


def _our_arrays(data) -> dict[str, np.ndarray]:
    return {
        "user_ids": data.user_ids,
        "item_ids": data.item_ids,
        "train_counts": np.diff(data.train_offsets),
        "train_items": data.train_items.astype(np.int64),
        "eval_items": data.eval_items.astype(np.int64),
    }


def reference_read(ratings: str) -> pd.DataFrame:
    """Reads the file as the Model Garden did (its movielens.py, then pd.read_csv)."""
    if _is_dat(ratings):
        return pd.read_csv(ratings, sep="::", names=COLUMNS, engine="python")
    df = pd.read_csv(ratings)
    # movielens.py rewrote the ml-20m header (userId,movieId,...) to these names.
    df.columns = COLUMNS
    return df


def reference_process(df: pd.DataFrame, steps: dict[str, float]) -> dict[str, np.ndarray]:
    """The Model Garden's ``_filter_index_sort`` body, step for step.

    The one change: on pandas >= 3, ``groupby(...).apply`` no longer passes the group
    column to the function (``include_groups=True`` is an error), so the split groups
    by the user values as an array. The groups, their order and the rows each lambda
    sees, group column included, are then what pandas < 2.2 gave the reference.
    """
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps[name] = now - clock
        clock = now

    grouped = df.groupby(USER_COLUMN)
    df = grouped.filter(lambda x: len(x) >= MIN_NUM_RATINGS)
    lap("filter")

    original_users = df[USER_COLUMN].unique()
    original_items = df[ITEM_COLUMN].unique()
    user_map = {user: index for index, user in enumerate(original_users)}
    item_map = {item: index for index, item in enumerate(original_items)}
    df[USER_COLUMN] = df[USER_COLUMN].apply(lambda user: user_map[user])
    df[ITEM_COLUMN] = df[ITEM_COLUMN].apply(lambda item: item_map[item])
    num_users = len(original_users)
    num_items = len(original_items)
    assert num_users <= np.iinfo(REFERENCE_USER_DTYPE).max
    assert num_items <= np.iinfo(REFERENCE_ITEM_DTYPE).max
    assert df[USER_COLUMN].max() == num_users - 1
    assert df[ITEM_COLUMN].max() == num_items - 1
    lap("index")

    # The reference's comment: this order (quicksort on time, then a stable sort on
    # (user, time)) gave a better hit rate, matching the MLPerf reference.
    df.sort_values(by=TIMESTAMP_COLUMN, inplace=True)
    df.sort_values([USER_COLUMN, TIMESTAMP_COLUMN], inplace=True, kind="mergesort")
    lap("sort")

    df = df.reset_index()
    grouped = df.groupby(df[USER_COLUMN].to_numpy(), group_keys=False)
    eval_df, train_df = grouped.tail(1), grouped.apply(lambda x: x.iloc[:-1])
    train_users = train_df[USER_COLUMN].values.astype(REFERENCE_USER_DTYPE)
    train_items = train_df[ITEM_COLUMN].values.astype(REFERENCE_ITEM_DTYPE)
    eval_users = eval_df[USER_COLUMN].values.astype(REFERENCE_USER_DTYPE)
    eval_items = eval_df[ITEM_COLUMN].values.astype(REFERENCE_ITEM_DTYPE)
    lap("split")

    # Not timed: reshape the reference's output into our layout for the comparison.
    eval_by_user = np.full(num_users, -1, dtype=np.int64)
    eval_by_user[eval_users] = eval_items
    return {
        "user_ids": np.asarray(original_users, dtype=np.int64),
        "item_ids": np.asarray(original_items, dtype=np.int64),
        "train_users": train_users.astype(np.int64),
        "train_counts": np.bincount(train_users, minlength=num_users),
        "train_items": train_items.astype(np.int64),
        "eval_items": eval_by_user,
    }


def run_reference(ratings: str, progress: Progress) -> dict:
    """Times the reference's read and processing separately."""
    progress.event(event="start", time=time.time())
    start = time.perf_counter()
    df = reference_read(ratings)
    read_done = time.perf_counter()
    progress.event(event="read", read_s=read_done - start)
    steps: dict[str, float] = {}
    arrays = reference_process(df, steps)
    end = time.perf_counter()
    return {
        "read_s": read_done - start,
        "process_s": end - read_done,
        "total_s": end - start,
        "num_rows": len(df),
        "steps": steps,
        "arrays": arrays,
    }


def child_main(args: argparse.Namespace) -> None:
    """Runs one method and writes its timings, peak RSS and arrays to `result_path`."""
    progress = Progress(args.result_path + ".progress")
    if args.method == "reference":
        result = run_reference(args.ratings, progress)
    elif args.method in ("ours", "ours_ml_perf"):
        result = run_ours(args.ratings, args.method == "ours_ml_perf", progress)
    else:
        result = run_cache(args.dataset, args.work_dir, progress)
    # ru_maxrss is the process's high-water mark (VmHWM), in KiB on Linux.
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    arrays = result.pop("arrays")
    np.savez(args.result_path, summary=np.array(json.dumps(result)), **arrays)


# ---------------------------------------------------------------------------
# Parent side: run the children, compare, print.


@dataclasses.dataclass
class MethodResult:
    """One child's outcome; `timed_out_after_s` is set when it was killed."""

    method: str
    summary: dict
    arrays: dict[str, np.ndarray]
    timed_out_after_s: float | None = None
    read_s_before_kill: float | None = None
    peak_rss_before_kill: int | None = None


def run_child(
    args: argparse.Namespace, method: str, work_dir: str, timeout: float | None
) -> MethodResult:
    """Runs this script with ``--method``; kills it after `timeout` seconds of work."""
    result_path = os.path.join(work_dir, f"{method}.npz")
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--ratings={args.ratings}",
        f"--dataset={args.dataset}",
        f"--method={method}",
        f"--result_path={result_path}",
        f"--work_dir={work_dir}",
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    log_path = os.path.join(work_dir, f"{method}.log")
    print(f"running {LABELS[method]} ...", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not _wait_working(child, result_path + ".progress", timeout):
            peak = machine.peak_rss_bytes(child.pid)
            child.kill()
            child.wait()
            return _timed_out(method, result_path, peak)
    if child.returncode != 0:
        with open(log_path, "rb") as log:
            tail = log.read()[-4000:].decode("utf-8", errors="replace")
        sys.exit(f"{method} failed with exit code {child.returncode}:\n{tail}")
    with np.load(result_path, allow_pickle=False) as contents:
        summary = json.loads(str(contents["summary"]))
        arrays = {key: contents[key] for key in contents.files if key != "summary"}
    return MethodResult(method, summary, arrays)


def _wait_working(child: subprocess.Popen, progress_path: str, timeout: float | None) -> bool:
    """Waits for `child`; False once it has worked `timeout` s (imports not counted)."""
    if timeout is None:
        child.wait()
        return True
    # Until the child reports its start, allow a generous bound for imports.
    deadline = time.time() + timeout + _STARTUP_GRACE_SEC
    while child.poll() is None:
        start = _progress_events(progress_path).get("start")
        if start is not None:
            deadline = start["time"] + timeout
        if time.time() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _progress_events(progress_path: str) -> dict[str, dict]:
    """The latest event of each kind a child has written so far."""
    events = {}
    if os.path.exists(progress_path):
        with open(progress_path) as lines:
            for line in lines:
                if line.endswith("\n"):  # skip a line still being written
                    fields = json.loads(line)
                    events[fields["event"]] = fields
    return events


def _timed_out(method: str, result_path: str, peak: int | None) -> MethodResult:
    """Builds the result of a killed child from its progress file (time spent working)."""
    events = _progress_events(result_path + ".progress")
    worked = time.time() - events["start"]["time"] if "start" in events else 0.0
    read_s = events["read"]["read_s"] if "read" in events else None
    return MethodResult(method, {}, {}, worked, read_s, peak)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: list[MethodResult]) -> str:
    """The method | read s | process s | total s | peak RSS GiB table."""
    header = ("method", "read s", "process s", "total s", "peak RSS GiB")
    rows = []
    for result in results:
        summary = result.summary
        if result.timed_out_after_s is not None:
            read = result.read_s_before_kill
            peak = result.peak_rss_before_kill
            rows.append(
                (
                    LABELS[result.method],
                    _seconds(read) if read is not None else f">{result.timed_out_after_s:.1f}",
                    f">{result.timed_out_after_s - read:.1f}" if read is not None else "-",
                    f">{result.timed_out_after_s:.1f}",
                    f">={peak / GIB:.2f}" if peak else "?",
                )
            )
            continue
        rows.append(
            (
                LABELS[result.method],
                _seconds(summary.get("read_s")),
                _seconds(summary.get("process_s")),
                _seconds(summary["total_s"]),
                f"{summary['peak_rss_bytes'] / GIB:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row) -> str:
        numbers = zip(row[1:], widths[1:], strict=True)
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in numbers]
        return " | ".join(cells)

    return "\n".join(
        [line(header), "-+-".join("-" * w for w in widths), *(line(row) for row in rows)]
    )


def compare(ours: MethodResult, reference: MethodResult) -> tuple[bool, list[str]]:
    """Checks that two splits agree; returns (all identical, one line per check)."""
    a, b = ours.arrays, reference.arrays
    lines = []
    checks = [
        ("num_users", len(a["user_ids"]), len(b["user_ids"])),
        ("num_items", len(a["item_ids"]), len(b["item_ids"])),
        ("train rows", len(a["train_items"]), len(b["train_items"])),
    ]
    same = True
    for name, mine, theirs in checks:
        equal = mine == theirs
        same &= equal
        verdict = "equal" if equal else "DIFFER"
        lines.append(f"{name}: {verdict} (ours {mine:,}, reference {theirs:,})")
    for name, key in (("user index map", "user_ids"), ("item index map", "item_ids")):
        equal = np.array_equal(a[key], b[key])
        same &= equal
        lines.append(f"{name}: {'identical' if equal else 'DIFFERS'}")
    if len(a["eval_items"]) == len(b["eval_items"]):
        differ = int(np.count_nonzero(a["eval_items"] != b["eval_items"]))
        same &= differ == 0
        users = len(a["eval_items"])
        verdict = "identical" if differ == 0 else f"DIFFER for {differ:,} of"
        lines.append(f"eval item per user: {verdict} {users:,} users")
    train_same = np.array_equal(a["train_counts"], b["train_counts"]) and np.array_equal(
        a["train_items"], b["train_items"]
    )
    same &= train_same
    lines.append(f"train items per user, in order: {'identical' if train_same else 'DIFFER'}")
    return same, lines


def _ratio(reference: float, ours: float, lower_bound: bool) -> str:
    return f"{'>' if lower_bound else ''}{reference / ours:.1f}x"


def report(results: dict[str, MethodResult], ratings: str, dataset: str) -> None:
    """Prints the table, speed ratios and agreement."""
    ours = results["ours"]
    print(f"\nPreprocessing benchmark: {ratings}")
    print(machine.cpu_line())
    print(f"dataset {dataset}, {ours.summary['num_rows']:,} rows, min {MIN_NUM_RATINGS} ratings")
    print()
    print(format_table(list(results.values())))
    load = results["cache_load"].summary
    build = results["cache_build"].summary
    if not build["from_cache"] and load["from_cache"]:
        print(f"\ncache load: {load['total_s']:.3f} s (build: {build['total_s']:.2f} s)")
    else:
        print(f"\ncache load: NOT from cache (reason: {load['reason']!r})")
    cache_same = np.array_equal(
        results["cache_load"].arrays["eval_items"], ours.arrays["eval_items"]
    ) and np.array_equal(results["cache_load"].arrays["train_items"], ours.arrays["train_items"])
    print(f"cache contents equal to ours: {'yes' if cache_same else 'NO'}")

    reference = results.get("reference")
    if reference is not None:
        print()
        killed = reference.timed_out_after_s is not None
        for method in ("ours", "ours_ml_perf"):
            mine = results[method].summary
            if killed:
                total = reference.timed_out_after_s
                read = reference.read_s_before_kill
                process = None if read is None else total - read
            else:
                total = reference.summary["total_s"]
                process = reference.summary["process_s"]
            process_ratio = "-" if process is None else _ratio(process, mine["process_s"], killed)
            print(
                f"speed ratio reference/{LABELS[method]}: total "
                f"{_ratio(total, mine['total_s'], killed)}, processing only {process_ratio}"
            )
        if killed:
            print(f"(reference killed after {reference.timed_out_after_s:.0f} s: lower bounds)")
        else:
            steps = reference.summary["steps"]
            print(
                "reference processing steps: "
                + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in steps.items())
            )
            same, lines = compare(results["ours_ml_perf"], reference)
            print(f"\nagreement, ours (ml_perf=True) vs reference: {'AGREE' if same else 'DIFFER'}")
            print("\n".join(f"  {line}" for line in lines))
            same, lines = compare(ours, reference)
            print(f"agreement, ours (default order) vs reference: {'AGREE' if same else 'DIFFER'}")
            print("\n".join(f"  {line}" for line in lines))
            if not same:
                print("  (expected: by default same-time ratings keep file order, not quicksort's)")


def warm_page_cache(path: str) -> None:
    """Reads the file once so that no method pays for (or gains from) a cold page cache."""
    with open(path, "rb") as stream:
        while stream.read(1 << 24):
            pass


def prepare_work_dir(work_dir: str, ratings: str, dataset: str) -> None:
    """Links the file to where `load_or_build` looks: DATA_DIR/<dataset>/<ratings file>."""
    folder = os.path.join(work_dir, "data", dataset)
    os.makedirs(folder)
    os.symlink(os.path.abspath(ratings), os.path.join(folder, os.path.basename(ratings)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", required=True, help="ratings.dat (::) or ratings.csv")
    parser.add_argument(
        "--dataset",
        default="",
        help="dataset name for load_or_build (default: ml-1m for ratings.dat, "
        "ml-20m for ratings.csv)",
    )
    parser.add_argument(
        "--skip_reference", action="store_true", help="do not run the (slow) reference"
    )
    parser.add_argument(
        "--reference_timeout_sec",
        type=float,
        default=1800,
        help="kill the reference after this long and report lower bounds",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run ours and the reference this many times, alternating, and report each "
        "one's fastest run (single runs on a shared VM vary widely: docs/benchmarks.md, "
        "'Preprocessing')",
    )
    # Internal: set by the parent when it runs one method in a child process.
    parser.add_argument("--method", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result_path", default="", help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    name = os.path.basename(args.ratings)
    if not os.path.isfile(args.ratings):
        parser.error(f"--ratings {args.ratings} is not a file")
    if not name.endswith((".dat", ".csv")):
        parser.error(f"--ratings must be a '::' .dat or a .csv ratings file, got {name}")
    if not args.dataset:
        if name not in DATASET_BY_FILE:
            parser.error(f"cannot infer the dataset from {name}; pass --dataset")
        args.dataset = DATASET_BY_FILE[name]
    return args


def main() -> None:
    args = parse_args()
    if args.method:
        child_main(args)
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from recommendation.data import movielens  # only to check the registry; children time work

    info = movielens.dataset_info(args.dataset)
    wanted = movielens.DAT_FORMAT if _is_dat(args.ratings) else movielens.CSV_FORMAT
    if info.kind != "movielens" or info.file_format != wanted:
        sys.exit(
            f"--dataset {args.dataset} does not read {os.path.basename(args.ratings)}'s "
            f"format; pass a MovieLens dataset whose ratings file has that format"
        )
    if os.path.basename(args.ratings) != info.ratings_file:
        sys.exit(f"--dataset {args.dataset} expects a file named {info.ratings_file}")
    with tempfile.TemporaryDirectory(prefix="bench_preprocessing_") as work_dir:
        prepare_work_dir(work_dir, args.ratings, args.dataset)
        warm_page_cache(args.ratings)
        results = {method: run_child(args, method, work_dir, None) for method in OUR_METHODS}
        repeated = list(REPEATABLE_METHODS)
        if not args.skip_reference:
            results["reference"] = run_child(
                args, "reference", work_dir, args.reference_timeout_sec
            )
            repeated.append("reference")
        totals = {method: [results[method].summary["total_s"]] for method in repeated}
        for _ in range(args.repeats - 1):
            for method in repeated:
                timeout = args.reference_timeout_sec if method == "reference" else None
                again = run_child(args, method, work_dir, timeout)
                totals[method].append(again.summary["total_s"])
                if again.summary["total_s"] < results[method].summary["total_s"]:
                    results[method] = again
        report(results, args.ratings, args.dataset)
        if args.repeats > 1:
            print(f"\ntotal s of each of the {args.repeats} runs (the fastest is reported above):")
            for method in repeated:
                runs = ", ".join(f"{total:.2f}" for total in totals[method])
                print(f"  {LABELS[method]:<24} {runs}")


if __name__ == "__main__":
    main()
