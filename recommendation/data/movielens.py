"""Raw data: the dataset registry, where each dataset's files live, and getting them.

The registry (`DATASETS`) names every supported source and how its files are laid out;
MovieLens releases are downloaded from GroupLens (checksum checked, with progress) or
unpacked from a release archive already in ``DATA_DIR``. Reading the files is
`ratings_readers` (ratings) and `movie_titles` (titles).

Local layout: ``DATA_DIR/<dataset>/<ratings file>`` for MovieLens releases (what the
GroupLens archives unpack to), ``DATA_DIR/ncf/<prefix>.{train.rating,test.rating,
test.negative}`` for the NCF paper's files. All file access goes through
`tf.io.gfile`, so ``gs://`` data dirs work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import os
import re
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator

import tensorflow as tf
from absl import logging

from official.utils.misc import atomic, errors
from official.utils.misc.progress import ProgressBar


class DataError(Exception):
    """Bad or missing input data; the message says what is wrong and how to fix it."""


@dataclasses.dataclass(frozen=True)
class FileFormat:
    """How a ratings file is laid out.

    Attributes:
        separator: Field separator; ``"::"`` is read as ``":"`` with empty odd fields.
        header: Whether the first line names the columns.
        num_fields: Fields per line (after splitting on `separator`); 0 means as many
            as the first line has.
        user_field, item_field, timestamp_field: Field positions (None: absent).
    """

    separator: str
    header: bool
    num_fields: int
    user_field: int
    item_field: int
    timestamp_field: int | None


DAT_FORMAT = FileFormat(
    "::", header=False, num_fields=4, user_field=0, item_field=1, timestamp_field=3
)
U_DATA_FORMAT = FileFormat(
    "\t", header=False, num_fields=4, user_field=0, item_field=1, timestamp_field=3
)
CSV_FORMAT = FileFormat(
    ",", header=True, num_fields=4, user_field=0, item_field=1, timestamp_field=3
)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """One registry entry.

    Attributes:
        name: The ``--dataset`` value.
        kind: ``"movielens"``, ``"ncf_split"``, ``"generic"`` or ``"synthetic"``.
        ratings_file: File name inside ``DATA_DIR/<name>/`` (MovieLens kinds).
        file_format: Layout of `ratings_file`.
        archive: GroupLens archive name, if it can be downloaded.
        archive_folder: Folder inside the archive holding the files.
        movies_file: Titles file of the release (used for printing recommendations).
        ncf_prefix: File prefix of the NCF paper's split files (``ncf_split`` kind).
    """

    name: str
    kind: str
    ratings_file: str = ""
    file_format: FileFormat | None = None
    archive: str | None = None
    archive_folder: str = ""
    movies_file: str = ""
    ncf_prefix: str = ""


def _movielens(
    name: str,
    ratings_file: str,
    file_format: FileFormat,
    movies_file: str,
    archive_folder: str | None = None,
) -> DatasetInfo:
    return DatasetInfo(
        name=name,
        kind="movielens",
        ratings_file=ratings_file,
        file_format=file_format,
        archive=f"{name}.zip",
        archive_folder=archive_folder or name,
        movies_file=movies_file,
    )


ML_100K = "ml-100k"
ML_1M = "ml-1m"
ML_10M = "ml-10m"
ML_20M = "ml-20m"
ML_25M = "ml-25m"
ML_32M = "ml-32m"
ML_LATEST_SMALL = "ml-latest-small"
NCF_ML_1M = "ncf-ml-1m"
NCF_PINTEREST_20 = "ncf-pinterest-20"
GENERIC = "generic"
SYNTHETIC = "synthetic"
NCF_FOLDER = "ncf"

DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        _movielens(ML_100K, "u.data", U_DATA_FORMAT, "u.item"),
        _movielens(ML_1M, "ratings.dat", DAT_FORMAT, "movies.dat"),
        # The ml-10m archive unpacks to a folder with a different name.
        _movielens(ML_10M, "ratings.dat", DAT_FORMAT, "movies.dat", "ml-10M100K"),
        _movielens(ML_20M, "ratings.csv", CSV_FORMAT, "movies.csv"),
        _movielens(ML_25M, "ratings.csv", CSV_FORMAT, "movies.csv"),
        _movielens(ML_32M, "ratings.csv", CSV_FORMAT, "movies.csv"),
        _movielens(ML_LATEST_SMALL, "ratings.csv", CSV_FORMAT, "movies.csv"),
        DatasetInfo(NCF_ML_1M, "ncf_split", ncf_prefix="ml-1m"),
        DatasetInfo(NCF_PINTEREST_20, "ncf_split", ncf_prefix="pinterest-20"),
        DatasetInfo(GENERIC, "generic"),
        DatasetInfo(SYNTHETIC, "synthetic"),
    )
}


def dataset_info(name: str) -> DatasetInfo:
    """Returns the registry entry for `name`, or raises `DataError` listing the choices."""
    try:
        return DATASETS[name]
    except KeyError:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}") from None


def dataset_dir(data_dir: str, info: DatasetInfo) -> str:
    """Folder holding the dataset's files under `data_dir`."""
    folder = NCF_FOLDER if info.kind == "ncf_split" else info.name
    return os.path.join(data_dir, folder)


def data_dir_of_ncf_split(ncf_dir: str) -> str:
    """The --data_dir whose NCF split is the folder `ncf_dir` (what the benchmark scripts'
    --ncf_dir names): the split is read from DATA_DIR/ncf, so any other folder name
    would read a sibling folder instead.

    Raises:
        DataError: `ncf_dir` is not named ncf.
    """
    folder = os.path.abspath(ncf_dir)
    if os.path.basename(folder) != NCF_FOLDER:
        raise DataError(
            f"--ncf_dir {ncf_dir} must be a folder named {NCF_FOLDER} (the split is read from "
            f"DATA_DIR/{NCF_FOLDER}): move or link its files into one"
        )
    return os.path.dirname(folder)


def ratings_path(data_dir: str, info: DatasetInfo) -> str:
    """Path of a MovieLens release's ratings file under `data_dir`."""
    return os.path.join(dataset_dir(data_dir, info), info.ratings_file)


def ncf_split_paths(data_dir: str, info: DatasetInfo) -> tuple[str, str, str]:
    """Paths of the NCF split's train, test and negatives files."""
    folder = dataset_dir(data_dir, info)
    return tuple(  # type: ignore[return-value]
        os.path.join(folder, f"{info.ncf_prefix}.{suffix}")
        for suffix in ("train.rating", "test.rating", "test.negative")
    )


# ---------------------------------------------------------------------------
# Downloading


def download_dataset(info: DatasetInfo, data_dir: str, url_base: str) -> None:
    """Downloads, verifies and unpacks a GroupLens archive into ``data_dir/<name>/``.

    The archive is fetched into the unpacking's temporary folder, its MD5 checked
    against the ``.md5`` file GroupLens publishes beside it, unpacked as
    `unpack_local_archive` does, and deleted.

    Raises:
        DataError: the download failed, the checksum does not match, the archive is
            corrupt, or `data_dir` cannot be written. Nothing is left behind.
    """
    if info.archive is None:
        raise DataError(f"dataset {info.name!r} cannot be downloaded")
    url = url_base.rstrip("/") + "/" + info.archive
    with _unpacking(info, data_dir) as unpacked:
        archive_path = os.path.join(unpacked, info.archive)
        expected_md5 = _fetch_md5(url, info)
        actual_md5 = _fetch(url, archive_path, info)
        if actual_md5 != expected_md5:
            raise DataError(
                f"checksum mismatch for {url}: GroupLens publishes MD5 {expected_md5}, the "
                f"download has {actual_md5}; the file is corrupt or was changed, download again"
            )
        _extract(archive_path, info, unpacked, url)
        tf.io.gfile.remove(archive_path)  # unpacked: the release's files only
    logging.info("%s is ready in %s", info.name, dataset_dir(data_dir, info))


def unpack_local_archive(info: DatasetInfo, data_dir: str, archive_path: str) -> None:
    """Checks and unpacks a release archive the user already has, as a download would be.

    The archive must be a zip whose members pass their CRC check and that holds the
    ratings file; a ``<archive>.md5`` file beside it (GroupLens's format, or the bare
    checksum) is verified too. Nothing is fetched from the network.

    Raises:
        DataError: the archive is corrupt or is not the release's, its MD5 does not
            match, or `data_dir` cannot be written. Nothing is left behind.
    """
    logging.info("Unpacking %s from the local archive %s", info.name, archive_path)
    md5_path = archive_path + ".md5"
    if tf.io.gfile.exists(md5_path):
        with tf.io.gfile.GFile(md5_path, "rb") as stream:
            expected_md5 = _md5_in(stream.read(4096), md5_path, "delete it or put the MD5 there")
        digest = hashlib.md5()
        with tf.io.gfile.GFile(archive_path, "rb") as stream:
            while chunk := stream.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != expected_md5:
            raise DataError(
                f"checksum mismatch for {archive_path}: {md5_path} says MD5 {expected_md5}, the "
                f"file has {digest.hexdigest()}; it is corrupt or was changed, delete it and "
                f"download again"
            )
    with _unpacking(info, data_dir) as unpacked:
        _extract(archive_path, info, unpacked, archive_path)
    logging.info("%s is ready in %s", info.name, dataset_dir(data_dir, info))


def write_error(error: tf.errors.OpError | OSError, what: str, folder: str, flag: str) -> DataError:
    """The one-line `DataError` for a failed write of `what` into `folder`
    (`errors.write_failure`)."""
    return DataError(errors.write_failure(error, what, folder, flag))


@contextlib.contextmanager
def _unpacking(info: DatasetInfo, data_dir: str) -> Iterator[str]:
    """A temporary folder in `data_dir` whose files join ``data_dir/<name>/`` when the
    block ends (`atomic.add_files`), the ratings file last, so an interrupted run never
    leaves one that looks complete; the files already there stay. File by file rather
    than a folder swap (`atomic.replace_folder`): a swap would drop those, and on
    ``gs://`` (a folder rename copies object by object) would not put the ratings file,
    the marker readers trust, last. A failed write becomes a `DataError` naming
    `data_dir`."""
    try:
        with atomic.add_files(dataset_dir(data_dir, info), (info.ratings_file,)) as unpacked:
            yield unpacked
    except (tf.errors.OpError, OSError) as error:
        raise write_error(error, f"the {info.name} files", data_dir, "--data_dir") from None


def _offline_hint(info: DatasetInfo) -> str:
    return (
        f"put {info.name}/{info.ratings_file} (from {info.archive}) into DATA_DIR, "
        f"or use --dataset synthetic"
    )


def _open_url(url: str, info: DatasetInfo):
    try:
        return urllib.request.urlopen(url, timeout=60)
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise DataError(f"could not download {url}: {reason}; {_offline_hint(info)}") from None


def _fetch_md5(url: str, info: DatasetInfo) -> str:
    with _open_url(url + ".md5", info) as response:
        return _md5_in(response.read(4096), url + ".md5", _offline_hint(info))


def _md5_in(contents: bytes, source: str, fix: str) -> str:
    """The MD5 checksum in a ``.md5`` file's `contents`."""
    match = re.search(r"\b[0-9a-fA-F]{32}\b", contents.decode("ascii", errors="replace"))
    if match is None:
        raise DataError(f"{source} holds no MD5 checksum; {fix}")
    return match.group(0).lower()


def _fetch(url: str, path: str, info: DatasetInfo) -> str:
    """Streams `url` into `path` with a progress bar; returns the MD5 of the bytes."""
    digest = hashlib.md5()
    with _open_url(url, info) as response, tf.io.gfile.GFile(path, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        progress = ProgressBar(total, f"downloading {info.archive}", unit="B")
        try:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
                progress.update(len(chunk))
        except (OSError, http.client.HTTPException) as error:
            raise DataError(f"could not download {url}: {error!r}; {_offline_hint(info)}") from None
        progress.close()
    return digest.hexdigest()


def _extract(archive_path: str, info: DatasetInfo, target: str, source: str) -> None:
    """Unpacks the members under ``info.archive_folder/`` of the archive into `target`,
    after checking every member's CRC; `source` (URL or path) names it in errors."""
    prefix = info.archive_folder + "/"
    fix = f"delete it and download again, or {_offline_hint(info)}"
    try:
        with tf.io.gfile.GFile(archive_path, "rb") as stream, zipfile.ZipFile(stream) as archive:
            bad_member = archive.testzip()
            if bad_member is not None:
                raise DataError(
                    f"{source} is a corrupt archive (member {bad_member} is damaged); {fix}"
                )
            members = [
                m for m in archive.infolist() if m.filename.startswith(prefix) and not m.is_dir()
            ]
            names = {m.filename[len(prefix) :] for m in members}
            if info.ratings_file not in names:
                raise DataError(
                    f"{source} has no {prefix}{info.ratings_file}; it is not the {info.name} "
                    f"archive, {fix}"
                )
            tf.io.gfile.makedirs(target)
            for member in members:
                relative = member.filename[len(prefix) :]
                if ".." in relative.split("/"):
                    raise DataError(f"{source} has an unsafe member name {member.filename!r}")
                destination = os.path.join(target, relative)
                tf.io.gfile.makedirs(os.path.dirname(destination))
                with (
                    archive.open(member) as member_file,
                    tf.io.gfile.GFile(destination, "wb") as out,
                ):
                    while chunk := member_file.read(1 << 22):
                        out.write(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as error:
        raise DataError(f"{source} is a corrupt archive ({error}); {fix}") from None
