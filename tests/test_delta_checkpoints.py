"""Incremental checkpoints: a full checkpoint and its deltas restore exactly what the
trained model held, a half-written or damaged delta is never applied, and a delta
holds only what changed."""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
from conftest import CHECKPOINT_DAMAGES, bytes_read, damage_checkpoint

from official.core.model_dir import ModelDirError
from official.utils.misc import atomic
from recommendation.data import constants
from recommendation.online import callbacks, online_ncf
from recommendation.online.sources.stream_batches import StreamBatch
from recommendation.online.state import delta_checkpoints
from recommendation.online.tables import id_index

# Small tables under churn: users arrive all the time (lru evicts, rows move into the
# holes), items are admitted on their second sighting (pending sightings change).
MODEL = online_ncf.OnlineParams(
    mf_dim=4,
    layers=(8, 4),
    mlp_regularization=(0.0, 0.0),
    user_capacity=40,
    item_capacity=48,
    permit_filter_value=2,
)


def _stream(num_batches: int, seed: int = 0) -> list[StreamBatch]:
    """Ids 2^20 apart, which share a bucket of the tables' indexes: their probe
    sequences pass the tombstones of the ids removed."""
    rng = np.random.default_rng(seed)
    batches = []
    for index in range(num_batches):
        users = (rng.integers(0, 30, 16) + 3 * index) << 20  # new users keep arriving
        items = (rng.zipf(1.5, 16) % 80) << 20
        data = {
            constants.USER_COLUMN: users.astype(np.int64),
            constants.ITEM_COLUMN: items.astype(np.int64),
            constants.TIME_COLUMN: np.full(16, index, np.int64),
        }
        batches.append(StreamBatch(data, {"offset": index + 1}, 16))
    return batches


def _model():
    tf.keras.utils.set_random_seed(1)
    return online_ncf.build_rec_model(MODEL)


def _train(rec_model, batches, *chosen) -> dict:
    return rec_model.online_train(batches, list(chosen), sink_size=1)


def _checkpoints(directory, full_every: int = 4, every_steps: int = 3):
    return callbacks.CheckpointCallback(
        str(directory), every_steps=every_steps, full_every=full_every
    )


def _state(rec_model) -> dict[str, np.ndarray]:
    """Everything the model's checkpoint holds, the tables by their live rows and
    pending sightings (not by bucket layout), and what each id's lookup gives."""
    checkpoint = rec_model.checkpoint
    tables, small = delta_checkpoints.tables_and_state(rec_model)
    # Not the index's own bookkeeping (its removals and buckets since its last rebuild:
    # a restore rebuilds it); what each id looks up is compared instead.
    state = {
        path: np.asarray(variable.numpy())
        for path, variable in small.items()
        if not path.endswith((".removals", ".buckets"))
    }
    state["position"] = checkpoint.position.numpy()
    for path, table in tables.items():
        end = int(table.size.numpy()) + 1
        for name, variable in table.row_variables().items():
            if name != "written_at":  # not checkpointed: a publisher's bookkeeping
                state[f"{path}.{name}"] = variable.numpy()[:end]
        keys = table.slot_keys.numpy()[1:end]
        state[f"{path}.lookup"] = table.lookup_slots(tf.constant(keys)).numpy()
        pending_keys, pending_values = (t.numpy() for t in id_index.live_entries(table._pending, 2))
        order = np.argsort(pending_keys)
        state[f"{path}.pending"] = np.concatenate(
            [pending_keys[order, None], pending_values[order]], 1
        )
    return state


def _assert_same(state: dict, other: dict) -> None:
    assert sorted(state) == sorted(other)
    for key in state:
        np.testing.assert_array_equal(state[key], other[key], err_msg=key)


def _restored(directory, full_every: int = 4):
    rec_model = _model()
    checkpoint = _checkpoints(directory, full_every)
    checkpoint.set_rec_model(rec_model)
    checkpoint.on_train_begin()
    return rec_model, checkpoint


def test_a_full_checkpoint_and_its_deltas_restore_exactly_what_the_model_held(tmp_path):
    straight = _model()
    saver = _checkpoints(tmp_path)
    _train(straight, _stream(20), saver)
    # 20 steps, a checkpoint every 3 and at the end: full, 3 deltas, full, 2 deltas.
    assert len(saver.seconds["full"]) == 2 and len(saver.seconds["delta"]) == 5
    manifest = json.load(open(tmp_path / delta_checkpoints.MANIFEST))
    assert manifest["full"] == "ckpt-15" and manifest["deltas"] == ["delta-18", "delta-20"]
    assert not list(tmp_path.glob("delta-6.*"))  # the deltas of the full before: deleted
    counts = straight.network.user_embedding.counts()
    assert counts["evicted"] > 20 and counts["ids"] == 40

    resumed, checkpoint = _restored(tmp_path)
    assert checkpoint.restored_from == str(tmp_path / "delta-20")
    _assert_same(_state(resumed), _state(straight))
    # From there on both train alike: the same losses and the same rows evicted.
    more = _stream(30)[20:]
    losses = [_train(model, more)["logs"]["loss"] for model in (straight, resumed)]
    assert losses[0] == losses[1]
    _assert_same(_state(resumed), _state(straight))


def test_a_delta_holds_the_changed_rows_only(tmp_path):
    rec_model = _model()
    saver = _checkpoints(tmp_path, full_every=100, every_steps=10)
    _train(rec_model, _stream(10), saver)  # a full checkpoint at step 10
    users = rec_model.network.user_embedding
    quiet = StreamBatch(
        {
            constants.USER_COLUMN: np.array([users.slot_keys.numpy()[1]] * 4, np.int64),
            constants.ITEM_COLUMN: np.array([1, 1, 1, 1], np.int64),
            constants.TIME_COLUMN: np.zeros(4, np.int64),
        },
        {"offset": 11},
        4,
    )
    _train(rec_model, [quiet], saver)  # one user seen: a delta at the end
    reader = tf.train.load_checkpoint(str(tmp_path / "delta-11"))
    shapes = reader.get_variable_to_shape_map()
    user_rows = {
        key: shape
        for key, shape in shapes.items()
        if key.startswith(
            (
                "tables/network..user_embedding/changes/rows",
                "tables/network..user_embedding/changes/slots",
            )
        )
    }
    # That user's row alone: its id, values, accumulator (row-wise Adagrad's) and
    # eviction state.
    assert len(user_rows) == 6 and all(shape[:1] == [1] for shape in user_rows.values())
    assert saver.bytes["delta"][0] < saver.bytes["full"][0] / 2


def _snapshot_then_crash_in(monkeypatch, tmp_path, step_failing: str):
    """Trains with checkpoints, then makes the next delta fail at `step_failing` as a
    process killed there would (nothing after it runs); returns the state of the last
    checkpoint before it."""
    rec_model = _model()
    saver = _checkpoints(tmp_path, full_every=10)
    _train(rec_model, _stream(9), saver)  # full at 3, deltas at 6 and 9
    expected = _state(_restored(tmp_path, 10)[0])

    class Killed(BaseException):
        pass

    def killed(*args, **kwargs):
        raise Killed

    _train(rec_model, _stream(11)[9:])
    if step_failing == "manifest":
        monkeypatch.setattr(atomic, "write_file", killed)
    else:  # between the data file and its index
        monkeypatch.setattr(delta_checkpoints.model_dir, "flush_to_disk", killed)
    with pytest.raises(Killed):
        saver.act()
    monkeypatch.undo()
    assert list(tmp_path.glob("delta-11.*"))  # its files are there, not listed
    return expected


@pytest.mark.parametrize("step_failing", ["files", "manifest"])
def test_a_delta_killed_while_written_is_never_restored(monkeypatch, tmp_path, step_failing):
    expected = _snapshot_then_crash_in(monkeypatch, tmp_path, step_failing)
    resumed, checkpoint = _restored(tmp_path, 10)
    assert checkpoint.restored_from == str(tmp_path / "delta-9")
    _assert_same(_state(resumed), expected)
    assert not list(tmp_path.glob("delta-11.*"))  # the leftover is gone


@pytest.fixture(scope="module")
def two_deltas(tmp_path_factory) -> tuple[str, dict]:
    """A folder of a full checkpoint at step 3 and deltas at 6 and 9 (trained once for
    every kind of damage), and the state a restore of the first two gives."""
    folder = tmp_path_factory.mktemp("two_deltas")
    rec_model = _model()
    saver = _checkpoints(folder, full_every=10)
    _train(rec_model, _stream(6), saver)  # full at 3, delta at 6
    expected = _state(_restored(folder, 10)[0])
    _train(rec_model, _stream(9)[6:], saver)  # delta at 9
    return str(folder), expected


@pytest.mark.parametrize("how", CHECKPOINT_DAMAGES)
def test_a_damaged_delta_ends_the_restore_before_it_and_the_next_checkpoint_is_full(
    tmp_path, caplog, how, two_deltas
):
    folder, expected = two_deltas
    tmp_path = tmp_path / "model"
    shutil.copytree(folder, tmp_path)
    damaged = str(tmp_path / "delta-9")
    problem = damage_checkpoint(damaged, how)
    resumed, checkpoint = _restored(tmp_path, 10)
    assert checkpoint.restored_from == str(tmp_path / "delta-6")
    _assert_same(_state(resumed), expected)
    assert checkpoint.deltas.next_is_full()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert re.match(
        rf"{re.escape(damaged)} is damaged \({problem}\): restored up to "
        rf"{re.escape(str(tmp_path / 'delta-6'))}; ",
        warning,
    ), warning


# Rows wide enough that a restart reads megabytes, far more than anything else it reads.
# Lazy Adam's two moments a row: the most bytes a row holds, beside which the reader's
# buffers (1 MiB around small tensors) stay small.
WIDE = dataclasses.replace(
    MODEL,
    mf_dim=64,
    layers=(128, 64),
    user_capacity=8192,
    permit_filter_value=1,
    row_optimizer="adam",
)


def test_a_restart_reads_the_full_checkpoint_and_its_delta_once(tmp_path):
    """Reading a checkpoint is what verifies it: a restart reads every byte of the full
    checkpoint and of the delta after it once, never first to check them, then again."""
    users = np.arange(1, 4097, dtype=np.int64) << 20
    batches = [
        StreamBatch(
            {
                constants.USER_COLUMN: users[start : start + 1024],
                constants.ITEM_COLUMN: np.arange(1024, dtype=np.int64) % 40,
                constants.TIME_COLUMN: np.full(1024, index, np.int64),
            },
            {"offset": index + 1},
            1024,
        )
        for index, start in enumerate([0, 1024, 2048, 3072] * 2)
    ]
    rec_model = online_ncf.build_rec_model(WIDE)
    _train(rec_model, batches, _checkpoints(tmp_path, full_every=10, every_steps=4))
    assert sorted(path.name for path in tmp_path.glob("*.index")) == [
        "ckpt-4.index",
        "delta-8.index",  # every user's row changed
    ]
    on_disk = sum(path.stat().st_size for path in tmp_path.glob("*-*.*"))

    def restart() -> callbacks.CheckpointCallback:
        checkpoint = _checkpoints(tmp_path, full_every=10, every_steps=4)
        checkpoint.set_rec_model(online_ncf.build_rec_model(WIDE))
        checkpoint.on_train_begin()
        return checkpoint

    restart()  # (warm)
    before = bytes_read()
    assert restart().restored_from == str(tmp_path / "delta-8")
    read = bytes_read() - before
    # (TensorFlow's reader fills a buffer of 1 MiB around the small tensors it reads)
    assert on_disk <= read < 1.5 * on_disk, (read, on_disk)


def test_one_full_every_checkpoint_writes_no_delta(tmp_path):
    rec_model = _model()
    saver = _checkpoints(tmp_path, full_every=1)
    _train(rec_model, _stream(7), saver)
    assert len(saver.seconds["full"]) == 3 and not saver.seconds["delta"]
    assert not list(tmp_path.glob("delta-*"))


def test_a_manifest_that_does_not_parse_restores_the_full_checkpoint_alone(tmp_path):
    rec_model = _model()
    saver = _checkpoints(tmp_path, full_every=10)
    _train(rec_model, _stream(3), saver)  # full at 3
    expected = _state(_restored(tmp_path, 10)[0])
    _train(rec_model, _stream(6)[3:], saver)  # delta at 6
    (tmp_path / delta_checkpoints.MANIFEST).write_text("{oops")
    resumed, checkpoint = _restored(tmp_path, 10)
    assert checkpoint.restored_from == str(tmp_path / "ckpt-3")
    _assert_same(_state(resumed), expected)
    assert list(tmp_path.glob("delta-6.*"))  # left for a person to look at


def test_a_delta_that_cannot_be_written_is_one_error_and_leaves_no_file(monkeypatch, tmp_path):
    rec_model = _model()
    saver = _checkpoints(tmp_path, full_every=10)
    _train(rec_model, _stream(6), saver)  # full at 3, delta at 6
    manifest = (tmp_path / delta_checkpoints.MANIFEST).read_text()
    _train(rec_model, _stream(8)[6:])

    def full_disk(prefix):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(delta_checkpoints.model_dir, "flush_to_disk", full_disk)
    with pytest.raises(ModelDirError) as raised:
        saver.act()
    assert str(raised.value) == (
        f"cannot write delta 8 in {tmp_path}: no space left on the device; free space "
        "there or pass --model_dir with a folder on a disk with room; the last complete "
        "checkpoint stands"
    )
    assert not list(tmp_path.glob("delta-8*"))
    assert (tmp_path / delta_checkpoints.MANIFEST).read_text() == manifest
    assert saver.deltas.next_is_full()


def test_a_restore_rebuilds_an_index_saved_with_an_id_held_twice(tmp_path):
    """An index saved by a table that wrote a held id past a tombstone with a plain
    insert (`test_id_index`) holds the id twice, the entry further on with the id's
    old row, which answers once the id is removed. Restored, with or without a
    manifest, the table holds each id once, at its row."""
    rec_model = _model()
    saver = _checkpoints(tmp_path, full_every=1)
    _train(rec_model, _stream(8), saver)
    table = rec_model.network.user_embedding
    keys, slots = (tf.constant(t.numpy()) for t in table.contents())
    index = table._table
    for first in range(len(keys)):  # until an id lies past the tombstone of another
        id_index.rebuild(index, keys, slots[:, None] + 1000, 1)  # old rows, no tombstone
        index.remove(keys[first : first + 1])
        # The plain insert (`put` would hold each id once), the last ids first.
        index.insert(tf.reverse(keys, [0]), tf.reverse(slots, [0]))
        if int(index.size()) > len(keys):
            break
    assert int(index.size()) == len(keys) + 1
    assert index.lookup(keys).numpy().tolist() == slots.numpy().tolist()
    saver.act()
    saver.finish()
    (tmp_path / delta_checkpoints.MANIFEST).unlink()  # (with one, deltas were applied)
    resumed, _ = _restored(tmp_path, full_every=1)
    restored = resumed.network.user_embedding
    assert int(restored._table.size()) == len(keys)
    assert restored.lookup_slots(keys).numpy().tolist() == slots.numpy().tolist()
