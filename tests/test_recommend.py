"""The recommend command: one user with titles, batch CSV, and bad input."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess

import numpy as np
import pytest
from absl import flags
from conftest import (
    run_module,
    run_module_on_a_tmpfs,
    the_error_line,
    truncate_half,
    write_movies,
)

from recommendation import recommend
from recommendation.data.movielens import DataError
from recommendation.online import online_ncf
from recommendation.online.state import serving_export
from recommendation.serving import export_files


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_module("recommendation.recommend", *args)


def _training_items(data, raw_user: int) -> set[int]:
    """Raw ids of the items `raw_user` rated in training."""
    user = data.user_ids.tolist().index(raw_user)
    seen = data.train_items[data.train_offsets[user] : data.train_offsets[user + 1]]
    return set(data.item_ids[seen].tolist())


@pytest.fixture
def movies(trained_export, tmp_path) -> str:
    titles = {int(raw): f"Film n°{raw} (1995)" for raw in trained_export.data.item_ids}
    return write_movies(str(tmp_path / "movies.dat"), titles, "movies.dat")


@pytest.mark.integration
def test_one_user_with_titles(trained_export, movies):
    user = int(trained_export.data.user_ids[3])
    export_dir = trained_export.export_dir
    result = _run(f"--export_dir={export_dir}", f"--user_id={user}", "--k=5", f"--movies={movies}")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"top 5 for user {user}:" and len(lines) == 2 + 5
    items = [int(line.split()[1]) for line in lines[2:]]
    assert [line.split()[0] for line in lines[2:]] == ["1", "2", "3", "4", "5"]
    assert all(f"Film n°{item} (1995)" in line for item, line in zip(items, lines[2:], strict=True))
    assert not set(items) & _training_items(trained_export.data, user)


@pytest.mark.integration
def test_batch_mode_writes_csv(trained_export, movies, tmp_path):
    users = trained_export.data.user_ids[[0, 5, 9]].tolist()
    (tmp_path / "users.txt").write_text("\n".join(map(str, users)) + "\n\n")
    output = tmp_path / "recommendations.csv"
    result = _run(
        f"--export_dir={trained_export.export_dir}",
        f"--users_file={tmp_path / 'users.txt'}",
        f"--output={output}",
        "--k=4",
        f"--movies={movies}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"wrote 12 recommendations for 3 users to {output}"
    with open(output, encoding="utf-8") as stream:
        rows = list(csv.DictReader(stream))
    assert [int(row["user_id"]) for row in rows] == np.repeat(users, 4).tolist()
    assert [int(row["rank"]) for row in rows] == [1, 2, 3, 4] * 3
    for row in rows:
        assert int(row["item_id"]) not in _training_items(trained_export.data, int(row["user_id"]))
        assert row["title"] == f"Film n°{row['item_id']} (1995)"


@pytest.mark.integration
def test_unknown_user_fails_and_writes_nothing(trained_export, tmp_path):
    unknown = int(trained_export.data.user_ids.max()) + 1
    (tmp_path / "users.txt").write_text(f"{trained_export.data.user_ids[0]}\n{unknown}\n")
    output = tmp_path / "out.csv"
    result = _run(
        f"--export_dir={trained_export.export_dir}",
        f"--users_file={tmp_path / 'users.txt'}",
        f"--output={output}",
    )
    assert result.returncode == 1
    assert f"error: user id(s) {unknown} not in the training data" in result.stderr
    assert not output.exists() and os.listdir(tmp_path) == ["users.txt"]


def _parse(*args: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    recommend.define_flags(flag_values)
    flag_values(["recommend", *args])
    return flag_values


def test_malformed_movies_file_is_named(trained_export, tmp_path):
    (tmp_path / "movies.dat").write_text("1::Toy Story (1995)::Animation\nnot a movie line\n")
    parsed = _parse(
        f"--export_dir={trained_export.export_dir}",
        f"--user_id={trained_export.data.user_ids[0]}",
        f"--movies={tmp_path / 'movies.dat'}",
    )
    with pytest.raises(DataError, match="movies.dat:2: expected 3 fields.*is it a movies file"):
        recommend.run(parsed)


def test_missing_export_dir_says_how_to_make_one(tmp_path):
    parsed = _parse(f"--export_dir={tmp_path / 'nothing'}", "--user_id=1")
    with pytest.raises(
        export_files.ExportError, match="no SavedModel in .*; export one with ncf-main"
    ):
        recommend.run(parsed)


@pytest.mark.integration
@pytest.mark.parametrize(
    "damage,damaged",
    [
        (
            lambda export: truncate_half(export / "variables" / "variables.data-00000-of-00001"),
            "variables/variables.data-00000-of-00001 is truncated or corrupt",
        ),
    ],
    ids=["variables_data_truncated"],  # the other damages: test_export's, in-process
)
def test_a_damaged_export_ends_with_one_error_line_and_writes_nothing(
    trained_export, tmp_path, damage, damaged
):
    damaged_export = tmp_path / "export"
    shutil.copytree(trained_export.export_dir, damaged_export)
    damage(damaged_export)
    (tmp_path / "users.txt").write_text(f"{trained_export.data.user_ids[0]}\n")
    result = _run(
        f"--export_dir={damaged_export}",
        f"--users_file={tmp_path / 'users.txt'}",
        f"--output={tmp_path / 'recommendations.csv'}",
    )
    assert the_error_line(result) == (
        f"error: the export in {damaged_export} is damaged or incomplete: {damaged}; export "
        f"it again with ncf-main --export_dir {damaged_export} or python -m "
        f"recommendation.export --model_dir MODEL_DIR --export_dir {damaged_export} (and the "
        "training run's flags)"
    )
    assert sorted(os.listdir(tmp_path)) == ["export", "users.txt"]


def test_an_online_export_recommends_from_its_newest_version(tmp_path):
    """A folder of ncf-online versions recommends from its newest complete one; an online
    version has no history (nothing is left out) and names a user it holds no row for."""
    params = online_ncf.OnlineParams(
        mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0), user_capacity=64, item_capacity=32
    )
    rec_model = online_ncf.build_rec_model(params)
    batch = {
        "user_id": np.array([[1, 2, 3]], np.int64),
        "item_id": np.array([[10, 11, 12]], np.int64),
        "timestamp": np.zeros([1, 3], np.int64),
    }
    rec_model.train(1, [batch], dataset_sink_mode=False)
    export = serving_export.ExportCallback(str(tmp_path), every_steps=1)
    export.set_rec_model(rec_model)
    export.on_train_begin()
    export.act()
    export.wait()
    (tmp_path / "7").mkdir()  # a version being written: not complete, not read
    recommender = recommend.Recommender(str(tmp_path))
    assert recommender.export_dir == export.exported[-1] and recommender.online
    item_ids, scores = recommender(np.array([2], np.int64), k=5)  # k cut to the 3 items
    assert sorted(item_ids[0].tolist()) == [10, 11, 12] and np.all(np.diff(scores[0]) <= 0)
    with pytest.raises(DataError) as raised:
        recommender(np.array([2, 99], np.int64), k=5)
    assert str(raised.value) == (
        f"user id(s) 99 hold no row in the model of {export.exported[-1]}: an online model "
        "holds the users it has trained on (and evicted none of)"
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    "mount_options,problem",
    [
        (
            "size=64k",
            "no space left on the device; free space there or pass --output with a "
            "folder on a disk with room",
        ),
    ],
    ids=["full_disk"],  # a read-only folder: errors.write_failure's other case
)
def test_an_output_that_cannot_be_written_ends_with_one_error_line(
    trained_export, tmp_path, mount_options, problem
):
    users = trained_export.data.user_ids
    (tmp_path / "users.txt").write_text("".join(f"{user}\n" for user in users))
    disk = tmp_path / "disk"
    disk.mkdir()
    result, left = run_module_on_a_tmpfs(
        disk,
        mount_options,
        "recommendation.recommend",
        f"--export_dir={trained_export.export_dir}",
        f"--users_file={tmp_path / 'users.txt'}",
        f"--output={disk / 'recommendations.csv'}",
        "--k=50",  # rows of every user: more than 64 KiB
    )
    assert the_error_line(result) == f"error: cannot write recommendations.csv in {disk}: {problem}"
    assert left == []  # no temporary file either


def test_an_output_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(DataError) as raised:
        recommend.check_output(str(tmp_path))
    assert str(raised.value) == (
        f"--output {tmp_path} is a folder; give the path of the CSV file to write"
    )


def test_an_output_in_a_folder_that_does_not_exist_is_refused_before_any_work(tmp_path):
    output = tmp_path / "mistyped" / "recommendations.csv"
    # No export is read: the folder is checked first.
    parsed = _parse(f"--export_dir={tmp_path / 'none'}", "--users_file=u.txt", f"--output={output}")
    with pytest.raises(DataError) as refused:
        recommend.run(parsed)
    assert str(refused.value) == (
        f"--output {output}: its folder {tmp_path / 'mistyped'} does not exist; "
        "create it, or give --output in an existing folder"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--user_id=1", "--users_file=u.txt", "--output=o.csv"], "exactly one of --user_id"),
        (["--users_file=u.txt"], "--users_file and --output go together"),
        (["--user_id=1", "--k=0"], "--k=0: 0 is not a positive integer"),
        (
            ["--user_id=9223372036854775808"],
            "9223372036854775808 is not an integer in the range "
            r"\[-9223372036854775808, 9223372036854775807\]",
        ),
    ],
)
def test_invalid_flags_are_rejected(args, message):
    with pytest.raises(flags.IllegalFlagValueError, match=message):
        _parse("--export_dir=/e", *args)


@pytest.mark.parametrize(
    "contents,message",
    [
        ("1\n2\nbob\n", r"users.txt:3: 'bob' is not a user id"),
        ("\n\n", "holds no user ids"),
        (
            "1\n9223372036854775808\n",
            "users.txt:2: 9223372036854775808 is not a user id: raw ids are 64-bit integers, "
            "from -9223372036854775808 to 9223372036854775807",
        ),
        ("\n-9223372036854775809\n", "users.txt:2: -9223372036854775809 is not a user id"),
    ],
)
def test_bad_users_file(tmp_path, contents, message):
    (tmp_path / "users.txt").write_text(contents)
    with pytest.raises(DataError, match=message):
        recommend.read_user_ids(str(tmp_path / "users.txt"))
