"""What an online run reports beyond its metrics: how full its tables are and what they
refused (log line, TensorBoard, summary, a warning), and the exports it could not write
without losing any training."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re

import pytest
import tensorflow as tf
from absl import logging as absl_logging
from conftest import run_module_on_a_tmpfs
from tensorboard.compat.proto import event_pb2

from recommendation import online_main
from recommendation.online import online_ncf, prequential, run_summary
from recommendation.online.state import serving_export, versioned_export
from recommendation.online_main import OnlineConfig

MODEL = online_ncf.OnlineParams(
    mf_dim=4,
    layers=(8, 4),
    mlp_regularization=(0.0, 0.0),
    user_capacity=16,
    item_capacity=64,
)


def _write_events(folder, rows) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "a.csv"), "w") as out:
        out.write("".join(f"{user},{item},{stamp}\n" for stamp, (user, item) in enumerate(rows)))
    return str(folder)


def _config(tmp_path, events_dir: str, **overrides) -> OnlineConfig:
    values = dict(
        events_dir=events_dir,
        model_dir=str(tmp_path / "model"),
        model=MODEL,
        batch_size=64,
        sink_size=1,
        log_every_secs=3600.0,
        seed=1,
    )
    return OnlineConfig(**{**values, **overrides})


def _scalars(folder) -> dict[str, list[float]]:
    """Every scalar TensorBoard holds in `folder`, by tag, in step order."""
    found: dict[str, list[float]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
        for record in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(record.numpy())
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return found


def test_a_full_table_refusing_new_ids_is_counted_reported_and_warned_about(tmp_path, caplog):
    # Step 1: users 0-15 fill the 16 rows; steps 2 and 3: 64 new users each, every one
    # refused (64 + 64); items 0-7 take 8 of 64 rows.
    caplog.set_level(logging.INFO, logger="absl")
    rows = [(user % 16, user % 8) for user in range(64)]
    rows += [(16 + user, user % 8) for user in range(64)] * 2
    events = _write_events(tmp_path / "events", rows)
    model = dataclasses.replace(MODEL, user_eviction="none")
    summary = online_main.run(_config(tmp_path, events, max_events=192, model=model))
    assert summary["steps"] == 3
    assert summary["tables"] == {
        "user": {"ids": 16, "capacity": 16, "admitted": 16, "evicted": 0, "refused": 128},
        "item": {"ids": 8, "capacity": 64, "admitted": 8, "evicted": 0, "refused": 0},
    }
    line = run_summary.summary_line(summary)
    assert (
        ", users 16/16 (128 refused, 0 evicted), items 8/64 (0 refused, 0 evicted), stopped by"
        in line
    )
    # The protocol scored the events it chooses, whatever the batches: the refused
    # users (default rows) are cold.
    users, items = zip(*rows, strict=True)
    chosen = prequential.Prequential().plan(users, items, range(len(rows)))
    results = summary["prequential"]
    assert results["all"]["scored"] == chosen.size == 31
    assert results["cold"]["scored"] == int(chosen.cold.sum())
    assert f"prequential HR@10={results['all']['hr']:.4f} (cold " in line
    messages = [record.getMessage() for record in caplog.records]
    # Once, at the first refusal; the next comes minutes later at the earliest.
    assert [m for m in messages if "table is full" in m] == [
        "the user table is full: all 16 rows hold ids, and 64 admissions of new users were "
        "refused so far: those users read the shared default row and are not learnt; raise "
        "--user_capacity or set --user_evict_policy lru (or lfu, ttl:STEPS) so that new users "
        "take the rows of the least used"
    ]
    [report] = [m for m in messages if m.startswith("online: step=3 ")]
    assert "user_ids=16 user_admitted=16 user_evicted=0 user_refused=128 item_ids=8" in report
    tensorboard = _scalars(tmp_path / "model")
    assert tensorboard["user_refused"] == [128.0] and tensorboard["item_ids"] == [8.0]
    assert "events_per_second" in tensorboard and "loss" in tensorboard
    assert tensorboard["prequential_hr"] == [pytest.approx(results["all"]["hr"], rel=1e-6)]


def test_an_export_that_cannot_be_written_costs_no_training_and_is_retried(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    absl_logging.set_verbosity(absl_logging.INFO)  # what saving a SavedModel puts back
    rec_model = online_ncf.build_rec_model(MODEL)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the export folder's parent should be")
    export = serving_export.ExportCallback(str(blocker / "exports"), every_steps=1)
    export.set_rec_model(rec_model)
    export.on_train_begin()
    for _ in range(2):
        assert export.act()  # copied, then written on the export thread
        export.wait()
    assert export.failures.count == 2 and not export.exported
    [warning] = [
        r.getMessage() for r in caplog.records if "cannot write the export" in r.getMessage()
    ]
    assert re.fullmatch(
        rf"cannot write the export in {blocker / 'exports'}: .*; pass --export_dir with a "
        r"writable folder; training goes on without it \(1 failed so far\)",
        warning,
    )
    blocker.unlink()  # fixed: the next export on schedule is written
    rec_model.step.assign(5)
    export.act()
    export.wait()
    assert export.exported == [str(blocker / "exports" / "5")]
    assert versioned_export.versions(str(blocker / "exports")) == [5]
    assert export.failures.count == 2 and not export.failures.last_failed
    assert any(
        "the export in" in r.getMessage() and "written again after 2 failures" in r.getMessage()
        for r in caplog.records
    )


def _online_on_a_full_disk(tmp_path, events: int, *flags: str):
    """ncf-online on `events` events of 50 users and 9 items, its --export_dir a 16 KiB
    tmpfs (`run_module_on_a_tmpfs`: the result and what is left there), its model_dir
    on a disk with room, versions by steps only."""
    found = _write_events(tmp_path / "events", [(user % 50, user % 9) for user in range(events)])
    (tmp_path / "disk").mkdir()
    return run_module_on_a_tmpfs(
        tmp_path / "disk",
        "size=16k",
        "recommendation.online_main",
        f"--events_dir={found}",
        f"--model_dir={tmp_path / 'model'}",
        f"--export_dir={tmp_path / 'disk'}",
        "--num_factors=4",
        "--layers=8,4",
        "--user_capacity=64",
        "--item_capacity=16",
        "--batch_size=64",
        "--sink_size=1",
        "--export_every_secs=100000",
        f"--max_events={events}",
        "--seed=1",
        *flags,
    )


@pytest.mark.integration
def test_exports_to_a_full_disk_leave_training_and_checkpoints_whole(tmp_path):
    # --export_dir on a real full disk (a 16 KiB tmpfs in a private mount namespace),
    # checkpoints on a disk with room: every export fails, none is half there, the run
    # trains every event, checkpoints the last step and exits 0. (Versions are written
    # on a thread of their own: one due while another is written waits for the next
    # sink, so that there are 2 or 3 of them. A publication that cannot be written:
    # tests/test_publishing.py.)
    model, disk = tmp_path / "model", tmp_path / "disk"
    result, left = _online_on_a_full_disk(
        tmp_path, 640, "--export_every_steps=4", "--publish_every_secs=0"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [summary] = [line for line in result.stdout.splitlines() if line.startswith("online:")]
    assert re.fullmatch(
        r"online: 640 events in .* step 10, .*, [23] exports failed, stopped by callback", summary
    ), summary
    failures = [line for line in result.stderr.splitlines() if "cannot write the export" in line]
    assert len(failures) == 1 and failures[0].endswith(
        f"cannot write the export in {disk}: no space left on the device; free space there or "
        "pass --export_dir with a folder on a disk with room; training goes on without it "
        "(1 failed so far)"
    )
    assert left == []  # no version, no temporary
    assert tf.train.latest_checkpoint(str(model)) == str(model / "ckpt-10")


@pytest.mark.integration
def test_publications_to_a_full_disk_cost_no_training_and_leave_their_chain_without_a_gap(
    tmp_path,
):
    """Publications fill a 16 KiB --export_dir, then fail (every version fails: a
    SavedModel is larger; how many are tried while publications still fit is timing):
    every event is trained and checkpointed, one line says so, and what is left on the
    disk is whole publications numbered 1, 2, ... without a gap, a failed one being
    taken again under its number."""
    model, disk = tmp_path / "model", tmp_path / "disk"
    result, left = _online_on_a_full_disk(tmp_path, 3000, "--publish_every_secs=0.01")
    assert result.returncode == 0, result.stderr[-3000:]
    [summary] = [line for line in result.stdout.splitlines() if line.startswith("online:")]
    failed = re.fullmatch(
        r"online: 3,000 events in .* step 47, .*, \d+ exports failed, (\d+) publications failed, "
        "stopped by callback",
        summary,
    )
    assert failed and int(failed[1]) >= 1, summary
    failures = [line for line in result.stderr.splitlines() if "cannot write a publication" in line]
    assert len(failures) == 1 and failures[0].endswith(
        f"cannot write a publication in {disk}: no space left on the device; free space there "
        "or pass --export_dir with a folder on a disk with room; training goes on without it "
        "(1 failed so far)"
    )
    [run] = [path for path in left if path.count("/") == 1]
    files = [path for path in left if path.count("/") == 2]
    assert left == ["publications", run, *files] and files
    assert files == [f"{run}/{seq:010d}.npz" for seq in range(1, len(files) + 1)]
    assert tf.train.latest_checkpoint(str(model)) == str(model / "ckpt-47")
