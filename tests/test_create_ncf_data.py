"""The data command end to end, as a user runs it (separate processes)."""

from __future__ import annotations

import os
import subprocess
import zipfile

import pytest
from conftest import TINY_ROWS, run_module, write_movielens


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_module("recommendation.create_ncf_data", *args)


@pytest.mark.integration
def test_synthetic_offline_prints_statistics(tmp_path):
    result = _run(
        "--dataset=synthetic",
        f"--data_dir={tmp_path}",
        "--synthetic_num_users=300",
        "--synthetic_num_items=200",
        "--synthetic_num_ratings=12000",
        "--seed=5",
    )
    assert result.returncode == 0, result.stderr
    assert "users:               300\n" in result.stdout
    assert "training positives:  11,700\n" in result.stdout
    assert "evaluation users:    300\n" in result.stdout


@pytest.mark.integration
def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path):
    path = write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), TINY_ROWS, "dat")
    with open(path, "a") as out:
        out.write("40::oops::4::1\n")
    result = _run("--dataset=ml-1m", f"--data_dir={tmp_path}")
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == [
        f"error: {path}:10: item id 'oops' is not an integer: '40::oops::4::1'; "
        "fix or delete that line"
    ]
    assert os.listdir(tmp_path / "ml-1m") == ["ratings.dat"]


@pytest.mark.integration
def test_unknown_dataset_is_rejected_at_start_up():
    result = _run("--dataset=ml-2m")
    assert result.returncode != 0
    assert "flag --dataset=ml-2m: value should be one of" in result.stderr


@pytest.mark.integration
def test_unwritable_cache_dir_gives_one_line_naming_it_and_the_fix(tmp_path):
    write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), TINY_ROWS, "dat")
    (tmp_path / "file").write_text("")
    cache_dir = tmp_path / "file" / "cache"  # as root too, nothing can be made below a file
    result = _run(
        "--dataset=ml-1m",
        f"--data_dir={tmp_path}",
        f"--cache_dir={cache_dir}",
        "--min_num_ratings=3",
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == [
        f"error: cannot write the preprocessing cache in {cache_dir}: {tmp_path / 'file'} is not "
        "a directory; pass --cache_dir with a writable folder"
    ]


@pytest.mark.integration
def test_release_archive_in_data_dir_is_used_offline(tmp_path):
    ratings = "".join(f"{user}::{item}::4::{time}\n" for user, item, time in TINY_ROWS)
    with zipfile.ZipFile(tmp_path / "ml-1m.zip", "w") as archive:
        archive.writestr("ml-1m/ratings.dat", ratings)
    result = _run(
        "--dataset=ml-1m",
        f"--data_dir={tmp_path}",
        "--min_num_ratings=3",
        "--movielens_url=http://127.0.0.1:9/",  # the discard port: nothing answers
    )
    assert result.returncode == 0, result.stderr
    assert "training positives:  5\n" in result.stdout
    assert sorted(os.listdir(tmp_path / "ml-1m")) == [
        "ncf_cache.json",
        "ncf_cache.npz",
        "ratings.dat",
    ]
