"""The dataset registry, and getting the files: --download_if_missing against a local
HTTP server and file:// URLs, release archives already in DATA_DIR.

GroupLens publishes ``<archive>.md5`` beside each archive; the tests serve the same
layout from a temporary folder, including broken archives and checksums. Downloads and
unpacking run through `ratings_readers.read_movielens`, which gets a missing file
before reading it.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import zipfile

import pytest
import tensorflow as tf
from conftest import ROOT, TINY_ROWS

from recommendation.data import movielens, ratings_readers
from recommendation.data.movielens import DataError


def test_unknown_dataset_lists_choices():
    with pytest.raises(DataError, match="unknown dataset 'ml-2m'; choose one of ml-100k, ml-1m"):
        movielens.dataset_info("ml-2m")


def _zip_bytes(folder: str, files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, contents in files.items():
            archive.writestr(f"{folder}/{name}", contents)
    return buffer.getvalue()


RATINGS = "".join(f"{u}::{i}::4::{t}\n" for u, i, t in TINY_ROWS).encode()
ARCHIVE = _zip_bytes("ml-1m", {"ratings.dat": RATINGS, "movies.dat": b"1::Toy Story::x\n"})


def _publish(site, archive_bytes: bytes, md5: str | None = None) -> None:
    (site / "ml-1m.zip").write_bytes(archive_bytes)
    digest = md5 or hashlib.md5(archive_bytes).hexdigest()
    (site / "ml-1m.zip.md5").write_text(f"MD5 (ml-1m.zip) = {digest}\n")


class _TruncatingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files, but cuts ``.zip`` bodies off halfway as a dropped connection would."""

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        data = source.read()
        if self.path.endswith(".zip"):
            data = data[: len(data) // 2]
        outputfile.write(data)


@pytest.fixture
def site(tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    return folder


@pytest.fixture
def http_url(site):
    """Serves `site` on a free loopback port; yields its base URL."""
    return _serve(site, http.server.SimpleHTTPRequestHandler)


@pytest.fixture
def truncating_url(site):
    return _serve(site, _TruncatingHandler)


_servers = []


def _serve(folder, handler_class):
    class Handler(handler_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _servers.append(server)
    return f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.fixture(autouse=True)
def _stop_servers():
    yield
    while _servers:
        server = _servers.pop()
        server.shutdown()
        server.server_close()


def _leftovers(data_dir) -> list[str]:
    found = []
    for root, dirs, files in os.walk(data_dir):
        found += [os.path.relpath(os.path.join(root, name), data_dir) for name in dirs + files]
    return sorted(found)


def test_downloads_verifies_and_unpacks_over_http(site, http_url, tmp_path):
    _publish(site, ARCHIVE)
    data_dir = tmp_path / "data"
    raw = ratings_readers.read_movielens(str(data_dir), "ml-1m", True, http_url)
    assert len(raw) == len(TINY_ROWS)
    assert _leftovers(data_dir) == ["ml-1m", "ml-1m/movies.dat", "ml-1m/ratings.dat"]


def test_downloads_from_file_url(site, tmp_path):
    _publish(site, ARCHIVE)
    raw = ratings_readers.read_movielens(str(tmp_path / "data"), "ml-1m", True, site.as_uri())
    assert len(raw) == len(TINY_ROWS)


def test_checksum_mismatch_leaves_nothing(site, http_url, tmp_path):
    _publish(site, ARCHIVE, md5="0" * 32)
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match=r"checksum mismatch for http://.*ml-1m\.zip: GroupLens"):
        ratings_readers.read_movielens(str(data_dir), "ml-1m", True, http_url)
    assert _leftovers(data_dir) == []


def test_corrupt_archive_with_matching_checksum_leaves_nothing(site, http_url, tmp_path):
    corrupt = bytearray(ARCHIVE)
    corrupt[40:60] = b"\xff" * 20  # damage the first member's data
    _publish(site, bytes(corrupt))
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match="is a corrupt archive"):
        ratings_readers.read_movielens(str(data_dir), "ml-1m", True, http_url)
    assert _leftovers(data_dir) == []


def test_archive_without_ratings_file(site, http_url, tmp_path):
    _publish(site, _zip_bytes("ml-1m", {"movies.dat": b"x"}))
    with pytest.raises(DataError, match=r"has no ml-1m/ratings\.dat; it is not the ml-1m archive"):
        ratings_readers.read_movielens(str(tmp_path / "data"), "ml-1m", True, http_url)


def test_interrupted_download_leaves_nothing_that_looks_complete(site, truncating_url, tmp_path):
    _publish(site, ARCHIVE)
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match="could not download|checksum mismatch"):
        ratings_readers.read_movielens(str(data_dir), "ml-1m", True, truncating_url)
    assert _leftovers(data_dir) == []


def _unreachable_url() -> str:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def test_offline_names_url_reason_and_what_to_do(tmp_path):
    url = _unreachable_url()
    with pytest.raises(DataError) as error:
        ratings_readers.read_movielens(str(tmp_path / "data"), "ml-1m", True, url)
    message = str(error.value)
    assert f"could not download {url}ml-1m.zip.md5" in message
    assert "Connection refused" in message
    assert "put ml-1m/ratings.dat (from ml-1m.zip) into DATA_DIR, or use --dataset synthetic" in (
        message
    )
    assert "\n" not in message


def test_unwritable_data_dir_names_it_and_the_fix(tmp_path, http_url, site):
    _publish(site, ARCHIVE)
    (tmp_path / "file").write_text("")
    data_dir = tmp_path / "file" / "data"  # as root too, nothing can be made below a file
    with pytest.raises(DataError) as error:
        ratings_readers.read_movielens(str(data_dir), "ml-1m", True, http_url)
    assert str(error.value) == (
        f"cannot write the ml-1m files in {data_dir}: {tmp_path / 'file'} is not a directory; "
        "pass --data_dir with a writable folder"
    )


# ---------------------------------------------------------------------------
# A release archive already in DATA_DIR


@pytest.mark.parametrize("download_if_missing", [True, False])
@pytest.mark.parametrize("with_md5", [True, False])
def test_local_archive_is_unpacked_without_the_network(
    tmp_path, caplog, download_if_missing, with_md5
):
    # On absl's logger itself: tf.saved_model.save (earlier tests) leaves it at WARNING
    # when absl's flags are unparsed, as in pytest.
    caplog.set_level(logging.INFO, logger="absl")
    _publish(tmp_path, ARCHIVE)
    if not with_md5:
        (tmp_path / "ml-1m.zip.md5").unlink()
    raw = ratings_readers.read_movielens(
        str(tmp_path), "ml-1m", download_if_missing, _unreachable_url()
    )
    assert len(raw) == len(TINY_ROWS)
    assert f"Unpacking ml-1m from the local archive {tmp_path / 'ml-1m.zip'}" in caplog.text
    archives = ["ml-1m.zip", "ml-1m.zip.md5"] if with_md5 else ["ml-1m.zip"]
    unpacked = ["ml-1m", "ml-1m/movies.dat", "ml-1m/ratings.dat"]
    assert _leftovers(tmp_path) == sorted(unpacked + archives)


def test_local_archive_with_a_wrong_md5_unpacks_nothing(tmp_path):
    _publish(tmp_path, ARCHIVE, md5="0" * 32)
    path = tmp_path / "ml-1m.zip"
    with pytest.raises(DataError) as error:
        ratings_readers.read_movielens(str(tmp_path), "ml-1m", True, _unreachable_url())
    assert str(error.value) == (
        f"checksum mismatch for {path}: {path}.md5 says MD5 {'0' * 32}, the file has "
        f"{hashlib.md5(ARCHIVE).hexdigest()}; it is corrupt or was changed, delete it and "
        "download again"
    )
    assert _leftovers(tmp_path) == ["ml-1m.zip", "ml-1m.zip.md5"]


@pytest.mark.parametrize(
    "archive,reason",
    [
        # Stored (uncompressed) members: one changed byte of ratings.dat fails its CRC.
        (ARCHIVE.replace(b"10::500::4::100", b"10::500::4::101"), r"member ml-1m/ratings\.dat"),
        (ARCHIVE[: len(ARCHIVE) // 2], "File is not a zip file"),
    ],
    ids=["bad-crc", "truncated"],
)
def test_corrupt_local_archive_is_named_and_nothing_is_unpacked(tmp_path, archive, reason):
    (tmp_path / "ml-1m.zip").write_bytes(archive)
    message = rf"^{tmp_path / 'ml-1m.zip'} is a corrupt archive \({reason}.*\); delete it and "
    with pytest.raises(DataError, match=message):
        ratings_readers.read_movielens(str(tmp_path), "ml-1m", True, _unreachable_url())
    assert _leftovers(tmp_path) == ["ml-1m.zip"]


def test_local_archive_of_another_release(tmp_path):
    (tmp_path / "ml-1m.zip").write_bytes(_zip_bytes("ml-100k", {"u.data": b"1\t2\t3\t4\n"}))
    with pytest.raises(DataError, match=r"ml-1m\.zip has no ml-1m/ratings\.dat; it is not"):
        ratings_readers.read_movielens(str(tmp_path), "ml-1m", False)
    assert _leftovers(tmp_path) == ["ml-1m.zip"]


def test_full_disk_while_unpacking_leaves_only_the_archive(tmp_path, monkeypatch):
    (tmp_path / "ml-1m.zip").write_bytes(ARCHIVE)

    class FullDiskGFile(tf.io.gfile.GFile):  # a real full disk needs root to set up
        def write(self, data):
            super().write(data[:16])
            self.flush()
            raise tf.errors.ResourceExhaustedError(None, None, "x; No space left on device")

    monkeypatch.setattr(tf.io.gfile, "GFile", FullDiskGFile)
    with pytest.raises(DataError) as error:
        ratings_readers.read_movielens(str(tmp_path), "ml-1m", False)
    assert str(error.value) == (
        f"cannot write the ml-1m files in {tmp_path}: no space left on the device; free space "
        "there or pass --data_dir with a folder on a disk with room"
    )
    assert _leftovers(tmp_path) == ["ml-1m.zip"]


# Unpacks DATA_DIR/ml-1m.zip and is killed (SIGKILL) at its second rename: movies.dat
# is in place, ratings.dat is next.
_KILLED_UNPACK = """
import os, signal, sys
import tensorflow as tf
from recommendation.data import movielens

real_rename, renames = tf.io.gfile.rename, []

def rename(*args, **kwargs):
    renames.append(args)
    if len(renames) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(*args, **kwargs)

tf.io.gfile.rename = rename
data_dir = sys.argv[1]
movielens.unpack_local_archive(
    movielens.DATASETS["ml-1m"], data_dir, os.path.join(data_dir, "ml-1m.zip")
)
"""


@pytest.mark.integration
def test_an_unpack_killed_midway_shows_no_release_and_the_next_one_cleans_up(tmp_path):
    (tmp_path / "ml-1m.zip").write_bytes(ARCHIVE)
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED_UNPACK, str(tmp_path)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert killed.wait(timeout=120) == -signal.SIGKILL, killed.stderr.read()[-2000:]
    # Whole files only, and not the ratings file, which readers take for a release.
    assert sorted(os.listdir(tmp_path / "ml-1m")) == ["movies.dat"]
    assert (tmp_path / "ml-1m" / "movies.dat").read_bytes() == b"1::Toy Story::x\n"
    [leftover] = set(os.listdir(tmp_path)) - {"ml-1m", "ml-1m.zip"}
    assert re.fullmatch(rf"\.ml-1m\.tmp-{killed.pid}-[0-9a-f]+", leftover)  # the writer's
    raw = ratings_readers.read_movielens(str(tmp_path), "ml-1m", False)
    assert len(raw) == len(TINY_ROWS)
    assert _leftovers(tmp_path) == ["ml-1m", "ml-1m.zip", "ml-1m/movies.dat", "ml-1m/ratings.dat"]
