"""Serving export: raw-id signatures, a fresh process, ONNX parity, the export command,
and the SavedModel written whole or not at all."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime
import pytest
import tensorflow as tf
from conftest import (
    ROOT,
    run_module_on_a_tmpfs,
    the_error_line,
    tiny_runner,
    tiny_train_input_fn,
    truncate_half,
)

from official.core.model_dir import ModelDirError
from recommendation.data import constants
from recommendation.serving import export_files, neumf_export, onnx_model

# Loads an export in a new interpreter; prints serving_default and recommend outputs.
_SERVE_SCRIPT = """
import json, sys, tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
request = json.loads(sys.argv[2])
scored = loaded.signatures["serving_default"](
    user_id=tf.constant(request["users"], tf.int64),
    item_id=tf.constant(request["items"], tf.int64),
)
out = {key: value.numpy().tolist() for key, value in scored.items()}
for exclude in (True, False):
    top = loaded.signatures["recommend"](
        user_id=tf.constant(request["all_users"], tf.int64),
        k=tf.constant(10),
        exclude_seen=tf.constant(exclude),
    )
    out[f"recommend_{exclude}"] = {key: value.numpy().tolist() for key, value in top.items()}
print(json.dumps(out).replace("NaN", "null"))
"""


def _in_memory_scores(model, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Probabilities from the trained Keras model, on dense indexes."""
    features = {
        constants.USER_COLUMN: tf.constant(users, tf.int32),
        constants.ITEM_COLUMN: tf.constant(items, tf.int32),
    }
    return tf.sigmoid(model(features)[:, 0]).numpy()


def _all_scores(trained) -> np.ndarray:
    """`(num_users, num_items)` in-memory probabilities of every pair."""
    data = trained.data
    users = np.repeat(np.arange(data.num_users), data.num_items)
    items = np.tile(np.arange(data.num_items), data.num_users)
    return _in_memory_scores(trained.model, users, items).reshape(data.num_users, -1)


def _sample(data, size: int = 200):
    rng = np.random.default_rng(7)
    return rng.integers(0, data.num_users, size), rng.integers(0, data.num_items, size)


@pytest.mark.integration
def test_a_fresh_process_serves_the_in_memory_scores(trained_export, tmp_path):
    data = trained_export.data
    moved = str(tmp_path / "moved")
    shutil.copytree(trained_export.export_dir, moved)  # self-contained: it works anywhere
    users, items = _sample(data)
    unknown_user, unknown_item = int(data.user_ids.max()) + 1, int(data.item_ids.max()) + 1
    request = {
        "users": [*data.user_ids[users].tolist(), unknown_user, int(data.user_ids[0])],
        "items": [*data.item_ids[items].tolist(), int(data.item_ids[0]), unknown_item],
        "all_users": data.user_ids.tolist(),
    }
    result = subprocess.run(
        [sys.executable, "-c", _SERVE_SCRIPT, moved, json.dumps(request)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout)
    np.testing.assert_allclose(
        served["scores"][:-2], _in_memory_scores(trained_export.model, users, items), atol=1e-6
    )
    # Unknown ids: flagged and NaN, never another row's score.
    assert served["known"] == [True] * len(users) + [False, False]
    assert served["scores"][-2:] == [None, None] and served["logits"][-2:] == [None, None]

    expected = _all_scores(trained_export)
    raw_to_item = {raw: index for index, raw in enumerate(data.item_ids.tolist())}
    for exclude in (True, False):
        top = served[f"recommend_{exclude}"]
        assert all(top["known"])
        for user in range(data.num_users):
            seen = data.train_items[data.train_offsets[user] : data.train_offsets[user + 1]]
            candidates = np.delete(expected[user], seen) if exclude else expected[user]
            items_returned = [raw_to_item[raw] for raw in top["item_ids"][user]]
            if exclude:
                assert not set(items_returned) & set(seen.tolist()), f"user {user}"
            # The k best candidates' scores, best first (robust to the order of ties).
            np.testing.assert_allclose(
                top["scores"][user], np.sort(candidates)[::-1][:10], atol=1e-6
            )
            np.testing.assert_allclose(
                top["scores"][user], expected[user, items_returned], atol=1e-6
            )


def test_recommend_pads_when_fewer_items_than_k_are_left(trained_export):
    data = trained_export.data
    recommend = tf.saved_model.load(trained_export.export_dir).signatures["recommend"]
    top = recommend(
        user_id=tf.constant(data.user_ids[:5], tf.int64),
        k=tf.constant(10 * data.num_items),
        exclude_seen=tf.constant(True),
    )
    assert top["item_ids"].shape == (5, data.num_items)  # k is cut to the number of items
    for user in range(5):
        left = data.num_items - (data.train_offsets[user + 1] - data.train_offsets[user])
        item_ids, scores = top["item_ids"][user].numpy(), top["scores"][user].numpy()
        assert (item_ids[:left] >= 0).all() and (item_ids[left:] == -1).all()
        assert not np.isnan(scores[:left]).any() and np.isnan(scores[left:]).all()
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be at least 1"):
        recommend(
            user_id=tf.constant(data.user_ids[:1], tf.int64),
            k=tf.constant(0),
            exclude_seen=tf.constant(True),
        )


def test_id_maps_are_saved_as_assets(trained_export):
    data = trained_export.data
    for name, ids in (
        (export_files.USER_IDS_FILE, data.user_ids),
        (export_files.ITEM_IDS_FILE, data.item_ids),
    ):
        with open(os.path.join(trained_export.export_dir, "assets", name)) as stream:
            assert [int(line) for line in stream] == ids.tolist()


def test_onnx_scores_equal_the_saved_model_and_the_model(trained_export):
    data = trained_export.data
    assert trained_export.onnx_max_difference <= onnx_model.ONNX_TOLERANCE
    session = onnxruntime.InferenceSession(
        os.path.join(trained_export.export_dir, export_files.ONNX_FILE),
        providers=["CPUExecutionProvider"],
    )
    users, items = _sample(data)
    raw_users = np.append(data.user_ids[users], data.user_ids.max() + 1).astype(np.int64)
    raw_items = np.append(data.item_ids[items], data.item_ids[0]).astype(np.int64)
    known, scores = session.run(["known", "scores"], {"user_id": raw_users, "item_id": raw_items})
    expected = _in_memory_scores(trained_export.model, users, items)
    assert np.abs(scores[:-1] - expected).max() <= onnx_model.ONNX_TOLERANCE
    assert known.tolist() == [True] * len(users) + [False] and np.isnan(scores[-1])
    serving = tf.saved_model.load(trained_export.export_dir).signatures["serving_default"]
    served = serving(user_id=tf.constant(raw_users), item_id=tf.constant(raw_items))["scores"]
    np.testing.assert_allclose(scores, served.numpy(), atol=onnx_model.ONNX_TOLERANCE)


def test_export_from_a_checkpoint(trained_export, tmp_path):
    config = dataclasses.replace(
        trained_export.config, export_dir=str(tmp_path / "again"), export_onnx=False
    )
    assert neumf_export.export_from_checkpoint(config) is None
    serving = tf.saved_model.load(config.export_dir).signatures["serving_default"]
    data = trained_export.data
    users, items = _sample(data, 20)
    scores = serving(
        user_id=tf.constant(data.user_ids[users]), item_id=tf.constant(data.item_ids[items])
    )["scores"]
    np.testing.assert_allclose(
        scores.numpy(), _in_memory_scores(trained_export.model, users, items), atol=1e-6
    )


@pytest.mark.parametrize(
    "change,error,message",
    [
        pytest.param(
            lambda config, tmp: dict(model_dir=str(tmp / "empty")),
            export_files.ExportError,
            "no checkpoint in --model_dir",
            id="no_checkpoint",
        ),
        pytest.param(
            lambda config, tmp: dict(model=dataclasses.replace(config.model, layers=(32, 8))),
            ModelDirError,
            "was made with other model flags or other data .*--clean or another --model_dir",
            id="other_layers",
        ),
        pytest.param(
            lambda config, tmp: dict(export_dir=None),
            export_files.ExportError,
            "--export_dir is required",
            id="no_dir",
        ),
        pytest.param(
            lambda config, tmp: dict(export_dir=_a_file(tmp)),
            ValueError,
            r"^export_dir .*a_file is a file; choose a new or empty folder$",
            id="a_file",
        ),
        pytest.param(
            lambda config, tmp: dict(export_dir=os.path.join(_a_file(tmp), "export")),
            export_files.ExportError,
            r"^cannot write the export in .*a_file/export: .*a_file is not a directory; "
            "pass --export_dir with a writable folder$",
            id="below_a_file",
        ),
    ],
)
def test_export_from_a_checkpoint_explains_what_is_wrong(
    trained_export, tmp_path, change, error, message
):
    config = dataclasses.replace(trained_export.config, export_dir=str(tmp_path / "export"))
    with pytest.raises(error, match=message):
        neumf_export.export_from_checkpoint(dataclasses.replace(config, **change(config, tmp_path)))
    assert not os.path.exists(tmp_path / "export")


def _a_file(folder) -> str:
    (folder / "a_file").write_text("")
    return str(folder / "a_file")


@pytest.mark.integration
def test_the_export_command_on_a_full_disk_ends_with_one_error_line(trained_export, tmp_path):
    config = trained_export.config
    shutil.copytree(config.data.data_dir, tmp_path / "data")
    shutil.copytree(config.model_dir, tmp_path / "model")
    disk = tmp_path / "disk"
    disk.mkdir()
    result, left = run_module_on_a_tmpfs(
        disk,
        "size=64k",  # the SavedModel needs about 200 KB
        "recommendation.export",
        "--dataset=synthetic",
        f"--synthetic_num_users={config.data.synthetic.num_users}",
        f"--synthetic_num_items={config.data.synthetic.num_items}",
        f"--synthetic_num_ratings={config.data.synthetic.num_ratings}",
        f"--data_dir={tmp_path / 'data'}",
        f"--model_dir={tmp_path / 'model'}",
        f"--num_factors={config.model.mf_dim}",
        f"--layers={','.join(map(str, config.model.layers))}",
        "--mlp_regularization=0,0",
        f"--export_dir={disk / 'export'}",
    )
    assert the_error_line(result) == (
        f"error: cannot write the export in {disk / 'export'}: no space left on the device; "
        "free space there or pass --export_dir with a folder on a disk with room"
    )
    assert left == []  # no temporary folder either


_DATA = "variables/variables.data-00000-of-00001"


def _flip_bytes(path) -> None:
    with open(path, "r+b") as stream:
        contents = bytearray(stream.read())
        middle = len(contents) // 2
        contents[middle : middle + 8] = bytes(255 - byte for byte in contents[middle : middle + 8])
        stream.seek(0)
        stream.write(contents)


# Each way an export can be damaged, and the file `load_export` names for it.
_DAMAGES = {
    "data_truncated": (lambda d: truncate_half(d / _DATA), f"{_DATA} is truncated or corrupt"),
    "data_flipped": (lambda d: _flip_bytes(d / _DATA), f"{_DATA} is truncated or corrupt"),
    "data_missing": (
        lambda d: os.remove(d / _DATA),
        "variables/variables.data-* is missing",
    ),
    "no_variables": (lambda d: shutil.rmtree(d / "variables"), "variables/ is missing"),
    "index_missing": (
        lambda d: os.remove(d / "variables" / "variables.index"),
        "variables/variables.index is missing",
    ),
    "index_garbage": (
        lambda d: (d / "variables" / "variables.index").write_bytes(b"not an index\n" * 9),
        "variables/variables.index is corrupt",
    ),
    "index_flipped": (
        lambda d: _flip_bytes(d / "variables" / "variables.index"),
        "variables/variables.index is corrupt",
    ),
    "pb_truncated": (lambda d: truncate_half(d / "saved_model.pb"), "saved_model.pb is corrupt"),
    "pb_empty": (lambda d: (d / "saved_model.pb").write_bytes(b""), "saved_model.pb is corrupt"),
    "id_map_missing": (
        lambda d: os.remove(d / "assets" / export_files.USER_IDS_FILE),
        "assets/user_ids.txt is missing",
    ),
    "id_map_truncated": (
        lambda d: truncate_half(d / "assets" / export_files.USER_IDS_FILE),
        "assets/user_ids.txt or assets/item_ids.txt is corrupt (an id listed twice)",
    ),
}


@pytest.mark.parametrize("damage,damaged", _DAMAGES.values(), ids=_DAMAGES.keys())
def test_a_damaged_export_is_named_with_its_file_and_the_fix(
    trained_export, tmp_path, damage, damaged
):
    damaged_export = tmp_path / "export"
    shutil.copytree(trained_export.export_dir, damaged_export)
    damage(damaged_export)
    with pytest.raises(export_files.ExportError) as raised:
        export_files.load_export(str(damaged_export))
    assert str(raised.value) == (
        f"the export in {damaged_export} is damaged or incomplete: {damaged}; export it "
        f"again with ncf-main --export_dir {damaged_export} or python -m "
        f"recommendation.export --model_dir MODEL_DIR --export_dir {damaged_export} (and the "
        "training run's flags)"
    )


def test_the_onnx_parity_check_names_a_damaged_saved_model(trained_export, tmp_path):
    damaged_export = tmp_path / "export"
    shutil.copytree(trained_export.export_dir, damaged_export)
    truncate_half(damaged_export / _DATA)
    sample = (trained_export.data.user_ids[:5], trained_export.data.item_ids[:5])
    onnx_path = str(damaged_export / export_files.ONNX_FILE)
    with pytest.raises(
        export_files.ExportError, match=f"{_DATA} is truncated or corrupt; export it"
    ):
        onnx_model.check_onnx_parity(str(damaged_export), onnx_path, sample)


# ---------------------------------------------------------------------------
# Writing the SavedModel: whole or not at all (`export_files.write_saved_model`)


def _exports(folder) -> list[str]:
    """The export and any temporary or moved-aside siblings of it in `folder`."""
    return sorted(name for name in os.listdir(folder) if name.startswith("export"))


SPECS = [
    tf.TensorSpec([None], tf.int32, constants.USER_COLUMN),
    tf.TensorSpec([None], tf.int32, constants.ITEM_COLUMN),
]


def _serving(runner) -> tuple[tf.Module, dict]:
    """The smallest serving module: `runner`'s PREDICT outputs for dense ids."""
    module = tf.Module()
    module.model = runner.state.model
    module.serve = tf.function(
        lambda user_id, item_id: runner.predict(
            {constants.USER_COLUMN: user_id, constants.ITEM_COLUMN: item_id}
        ),
        input_signature=SPECS,
    )
    return module, {"serving_default": module.serve}


def _export(runner, export_dir: str, finalize=None) -> None:
    export_files.write_saved_model(export_dir, *_serving(runner), finalize)


@pytest.mark.integration
def test_export_reloads_in_a_fresh_process_with_the_same_scores(tmp_path):
    runner = tiny_runner(str(tmp_path / "model"))
    runner.train(tiny_train_input_fn, 3)
    export_dir = str(tmp_path / "export")
    _export(runner, export_dir)
    assert _exports(tmp_path) == ["export"]  # no temporary folder left behind
    users, items = [0, 7, 49], [39, 3, 0]
    expected = runner.state.model(
        {constants.USER_COLUMN: tf.constant(users), constants.ITEM_COLUMN: tf.constant(items)}
    )[:, 0]
    script = (
        "import sys, tensorflow as tf\n"
        "fn = tf.saved_model.load(sys.argv[1]).signatures['serving_default']\n"
        f"out = fn(user_id=tf.constant({users}), item_id=tf.constant({items}))\n"
        "print(' '.join(repr(float(v)) for v in out['logits'].numpy()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, export_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    scores = [float(value) for value in result.stdout.split()]
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-6)


def _fail(_):
    raise RuntimeError("injected failure after the SavedModel was written")


def test_failed_export_leaves_nothing_behind(tmp_path):
    runner = tiny_runner(str(tmp_path / "model"))
    export_dir = str(tmp_path / "export")
    with pytest.raises(RuntimeError, match="injected"):
        _export(runner, export_dir, finalize=_fail)
    assert _exports(tmp_path) == []  # neither the export nor its temporary folder


def test_failed_export_keeps_the_earlier_one(tmp_path):
    runner = tiny_runner(str(tmp_path / "model"))
    export_dir = str(tmp_path / "export")
    _export(runner, export_dir)
    before = sorted(os.listdir(export_dir))
    runner.train(tiny_train_input_fn, 2)
    with pytest.raises(RuntimeError, match="injected"):
        _export(runner, export_dir, finalize=_fail)
    assert _exports(tmp_path) == ["export"]
    assert sorted(os.listdir(export_dir)) == before
    assert "serving_default" in tf.saved_model.load(export_dir).signatures


def test_export_never_replaces_a_folder_that_is_not_a_saved_model(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a SavedModel"):
        _export(tiny_runner(str(tmp_path / "model")), str(tmp_path / "export"))
    assert os.listdir(tmp_path / "export") == ["notes.txt"]


# An export killed (SIGKILL) after writing its temporary folder, before the rename.
_KILLED_EXPORT = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import conftest, test_export
runner = conftest.tiny_runner(os.path.join(sys.argv[1], "model"))
test_export._export(
    runner,
    os.path.join(sys.argv[1], "export"),
    finalize=lambda _: os.kill(os.getpid(), signal.SIGKILL),
)
"""


@pytest.mark.integration
def test_killed_export_leaves_no_export_and_its_leftovers_are_removed(tmp_path):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(tmp_path), tests_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == -9, result.stderr[-2000:]
    leftovers = _exports(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].startswith("export.tmp-")  # never `export`
    _export(tiny_runner(str(tmp_path / "model")), str(tmp_path / "export"))
    assert _exports(tmp_path) == ["export"]


@pytest.mark.integration
def test_an_export_moved_aside_by_a_killed_export_is_put_back(tmp_path):
    runner = tiny_runner(str(tmp_path / "model"))
    _export(runner, str(tmp_path / "export"))
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait()  # its pid now belongs to no process
    # As a swap killed between its renames leaves it: aside, under the dead writer's pid.
    os.rename(tmp_path / "export", tmp_path / f"export.old-{finished.pid}-0badcafe")
    with pytest.raises(RuntimeError, match="injected"):
        _export(runner, str(tmp_path / "export"), finalize=_fail)
    assert _exports(tmp_path) == ["export"]
    assert tf.saved_model.contains_saved_model(str(tmp_path / "export"))
