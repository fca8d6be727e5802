"""Raw data: the dataset registry, downloads from GroupLens and fast ratings readers.

Every supported source is turned into `RawRatings` (parallel id/timestamp arrays), or,
for the NCF paper's published split, into `NcfSplitFiles` read by preprocessing as
given. Reading is vectorised (pyarrow's CSV reader); the slow line-by-line scan in
`_locate_bad_line` only runs after a parse failure, to name the offending line.

Local layout: ``DATA_DIR/<dataset>/<ratings file>`` for MovieLens releases (what the
GroupLens archives unpack to), ``DATA_DIR/ncf/<prefix>.{train.rating,test.rating,
test.negative}`` for the NCF paper's files. All file access goes through
`tf.io.gfile`, so ``gs://`` data dirs work.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import http.client
import io
import os
import re
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pa_parquet
import tensorflow as tf
from absl import logging

from official.utils.misc import errors
from official.utils.misc.progress import ProgressBar
from recommendation import constants


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
# The NCF paper's *.rating files have 4 fields upstream, 3 in some copies: 0 = as found.
NCF_RATING_FORMAT = FileFormat(
    "\t", header=False, num_fields=0, user_field=0, item_field=1, timestamp_field=None
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


@dataclasses.dataclass(frozen=True)
class RawRatings:
    """Interactions as read from the source, in source order.

    Attributes:
        users: `(n,)` int32 or int64 raw user ids.
        items: `(n,)` int32 or int64 raw item ids.
        timestamps: `(n,)` int64 seconds, or None when the source has no time (file
            order is then the time order).
        sources: Files the data came from (for cache invalidation).
    """

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray | None
    sources: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.users)


@dataclasses.dataclass(frozen=True)
class NcfSplitFiles:
    """The NCF paper's published split, read as given (ids are already dense).

    Attributes:
        train_users, train_items: `(n,)` int64 training interactions.
        test_users, test_items: `(u,)` int64, one held-out interaction per user.
        test_negatives: `(u, k)` int64 fixed evaluation negatives, rows aligned with
            `test_users`.
        sources: The three files.
    """

    train_users: np.ndarray
    train_items: np.ndarray
    test_users: np.ndarray
    test_items: np.ndarray
    test_negatives: np.ndarray
    sources: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class GenericSource:
    """A user's own implicit-feedback file (``--dataset generic``).

    Attributes:
        path: CSV (any separator) or Parquet file (by extension ``.parquet``/``.pq``).
        user_column, item_column: Column names holding integer ids.
        timestamp_column: Column holding integer times; "" means file order is time.
        separator: CSV field separator.
    """

    path: str
    user_column: str = "user_id"
    item_column: str = "item_id"
    timestamp_column: str = "timestamp"
    separator: str = ","


def dataset_dir(data_dir: str, info: DatasetInfo) -> str:
    """Folder holding the dataset's files under `data_dir`."""
    folder = NCF_FOLDER if info.kind == "ncf_split" else info.name
    return os.path.join(data_dir, folder)


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
# Reading


def read_movielens(
    data_dir: str,
    name: str,
    download_if_missing: bool = False,
    url_base: str = constants.MOVIELENS_URL,
) -> RawRatings:
    """Reads a MovieLens release from ``data_dir/<name>/``.

    A missing ratings file is unpacked from the release archive when one lies in
    `data_dir` (``data_dir/ml-1m.zip``), else downloaded if asked.

    Raises:
        DataError: the file is missing (and not unpacked or downloaded), empty or
            malformed, or the local archive is corrupt.
    """
    info = dataset_info(name)
    if info.kind != "movielens":
        raise DataError(f"dataset {name!r} is not a MovieLens release")
    path = ratings_path(data_dir, info)
    if not tf.io.gfile.exists(path):
        archive_path = os.path.join(data_dir, info.archive)
        if tf.io.gfile.exists(archive_path):
            unpack_local_archive(info, data_dir, archive_path)
        elif download_if_missing:
            download_dataset(info, data_dir, url_base)
        else:
            raise DataError(
                f"{path} not found; put {info.ratings_file} from {info.archive} there, or "
                f"{info.archive} into {data_dir}, or pass --download_if_missing"
            )
    return read_ratings_file(path, info.file_format)


def read_ratings_file(path: str, file_format: FileFormat) -> RawRatings:
    """Reads `path` in `file_format` into integer arrays.

    Raises:
        DataError: the file is missing, empty, has no rows, or has a malformed line
            (named with its line number).
    """
    _require_file(path)
    if file_format.num_fields == 0:
        found = len(_first_line(path).split(file_format.separator))
        file_format = dataclasses.replace(file_format, num_fields=found)
    separator = ":" if file_format.separator == "::" else file_format.separator
    stride = 2 if file_format.separator == "::" else 1
    num_columns = (file_format.num_fields - 1) * stride + 1
    names = [f"f{i}" for i in range(num_columns)]
    fields = {
        "user": file_format.user_field * stride,
        "item": file_format.item_field * stride,
    }
    if file_format.timestamp_field is not None:
        fields["timestamp"] = file_format.timestamp_field * stride
    include = [names[i] for i in fields.values()]
    # 32-bit ids halve the memory the reader fills; a file with larger ids is read again.
    for id_type in (pa.int32(), pa.int64()):
        column_types = {name: id_type for name in include}
        if "timestamp" in fields:
            column_types[names[fields["timestamp"]]] = pa.int64()
        try:
            with _open_for_arrow(path) as stream:
                table = pa_csv.read_csv(
                    stream,
                    read_options=pa_csv.ReadOptions(
                        column_names=names,
                        skip_rows=1 if file_format.header else 0,
                        block_size=1 << 24,
                    ),
                    parse_options=pa_csv.ParseOptions(delimiter=separator),
                    convert_options=pa_csv.ConvertOptions(
                        include_columns=include, column_types=column_types
                    ),
                )
            break
        except (pa.ArrowInvalid, ValueError) as error:
            if id_type == pa.int64():
                raise _malformed_error(path, file_format, error) from None
    if table.num_rows == 0:
        raise DataError(f"{path} holds no ratings; check that it is the right file")
    columns = {key: _int_column(table, names[index]) for key, index in fields.items()}
    if any(column is None for column in columns.values()):
        raise _malformed_error(path, file_format, ValueError("missing values"))
    return RawRatings(
        users=columns["user"],
        items=columns["item"],
        timestamps=columns.get("timestamp"),
        sources=(path,),
    )


def _open_for_arrow(path: str):
    """A file pyarrow reads fast: its own reader for local paths (parallel, no copy into
    Python), else the bytes read through `tf.io.gfile` (``gs://`` and other schemes)."""
    if "://" not in path:
        return pa.OSFile(path, "rb")
    with tf.io.gfile.GFile(path, "rb") as stream:
        return pa.BufferReader(stream.read())


def _int_column(table: pa.Table, name: str) -> np.ndarray | None:
    column = table.column(name)
    if column.null_count:
        return None
    return column.to_numpy()


def _require_file(path: str) -> None:
    if not tf.io.gfile.exists(path):
        raise DataError(f"{path} not found")
    if tf.io.gfile.stat(path).length == 0:
        raise DataError(f"{path} is empty; download or copy the file again")


def _malformed_error(path: str, file_format: FileFormat, error: Exception) -> DataError:
    """Builds the error for a file pyarrow could not parse, naming the first bad line."""
    located = _locate_bad_line(path, file_format)
    if located is None:
        return DataError(f"{path} could not be parsed: {error}")
    line_number, reason, line = located
    return DataError(f"{path}:{line_number}: {reason}: {line[:80]!r}; fix or delete that line")


def _locate_bad_line(path: str, file_format: FileFormat) -> tuple[int, str, str] | None:
    """Scans `path` line by line for the first line that breaks `file_format`."""
    int_fields = [file_format.user_field, file_format.item_field]
    if file_format.timestamp_field is not None:
        int_fields.append(file_format.timestamp_field)
    names = {
        file_format.user_field: "user id",
        file_format.item_field: "item id",
        file_format.timestamp_field: "timestamp",
    }
    with tf.io.gfile.GFile(path, "rb") as stream:
        for line_number, raw in enumerate(stream, start=1):
            if file_format.header and line_number == 1:
                continue
            line = raw.decode("latin-1").rstrip("\r\n")
            if not line:
                continue
            fields = line.split(file_format.separator)
            if file_format.num_fields > 0 and len(fields) != file_format.num_fields:
                return (
                    line_number,
                    f"expected {file_format.num_fields} fields, found {len(fields)}",
                    line,
                )
            if len(fields) <= max(int_fields):
                return line_number, f"expected at least {max(int_fields) + 1} fields", line
            for index in int_fields:
                if not re.fullmatch(r"\s*[+-]?\d+\s*", fields[index]):
                    return line_number, f"{names[index]} {fields[index]!r} is not an integer", line
    return None


def read_ncf_split(data_dir: str, name: str) -> NcfSplitFiles:
    """Reads the NCF paper's train/test/negative files for dataset `name`.

    Raises:
        DataError: a file is missing, empty or malformed, or the test and negative
            files do not describe the same users.
    """
    info = dataset_info(name)
    train_path, test_path, negative_path = ncf_split_paths(data_dir, info)
    for path in (train_path, test_path, negative_path):
        if not tf.io.gfile.exists(path):
            raise DataError(
                f"{path} not found; copy the NCF paper's {os.path.basename(path)} "
                f"(from its Data/ folder) into {os.path.dirname(path)}"
            )
    train = read_ratings_file(train_path, NCF_RATING_FORMAT)
    test = read_ratings_file(test_path, NCF_RATING_FORMAT)
    negatives = _read_ncf_negatives(negative_path)
    if not np.array_equal(negatives[:, 0], test.users) or not np.array_equal(
        negatives[:, 1], test.items
    ):
        raise DataError(
            f"{negative_path} does not list the same (user, item) pairs, in the same "
            f"order, as {test_path}; use the two files from the same release"
        )
    return NcfSplitFiles(
        train_users=train.users,
        train_items=train.items,
        test_users=test.users,
        test_items=test.items,
        test_negatives=negatives[:, 2:],
        sources=(train_path, test_path, negative_path),
    )


def _read_ncf_negatives(path: str) -> np.ndarray:
    """Reads lines ``(user,item)\\tneg1\\tneg2...`` into an `(u, 2 + k)` int64 array."""
    _require_file(path)
    with tf.io.gfile.GFile(path, "rb") as stream:
        text = stream.read().decode("ascii", errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise DataError(f"{path} holds no lines; check that it is the right file")
    width = len(lines[0].rstrip("\t").split("\t"))
    pattern = re.compile(r"\(\d+,\d+\)(?:\t\d+){" + str(width - 1) + r"}\t?")
    for line_number, line in enumerate(lines, start=1):
        if pattern.fullmatch(line) is None:
            raise DataError(
                f"{path}:{line_number}: expected '(user,item)' and {width - 1} tab-separated "
                f"item ids: {line[:80]!r}; fix or delete that line"
            )
    numbers = re.sub(r"[(),\t]", " ", "\n".join(lines)).split()
    return np.array(numbers, dtype=np.int64).reshape(len(lines), width + 1)


def read_generic(source: GenericSource) -> RawRatings:
    """Reads a user-supplied CSV or Parquet file of user,item[,timestamp].

    Raises:
        DataError: the file or a named column is missing, or a value is not an integer.
    """
    _require_file(source.path)
    columns = [source.user_column, source.item_column]
    if source.timestamp_column:
        columns.append(source.timestamp_column)
    is_parquet = source.path.endswith((".parquet", ".pq"))
    try:
        with tf.io.gfile.GFile(source.path, "rb") as stream:
            if is_parquet:
                contents = pa.BufferReader(stream.read())
                _check_columns(source, columns, pa_parquet.read_schema(contents).names)
                table = pa_parquet.read_table(contents, columns=columns)
            else:
                table = pa_csv.read_csv(
                    pa.BufferReader(stream.read()),
                    parse_options=pa_csv.ParseOptions(delimiter=source.separator),
                    convert_options=pa_csv.ConvertOptions(include_columns=columns),
                )
    except (pa.ArrowInvalid, KeyError) as error:
        if "not found in CSV" in str(error) or isinstance(error, KeyError):
            header = _first_line(source.path).split(source.separator)
            _check_columns(source, columns, header)
        raise DataError(f"{source.path} could not be parsed: {error}") from None
    if table.num_rows == 0:
        raise DataError(f"{source.path} holds no rows")
    arrays = [_generic_ints(table, name, source.path) for name in columns]
    return RawRatings(
        users=arrays[0],
        items=arrays[1],
        timestamps=arrays[2] if source.timestamp_column else None,
        sources=(source.path,),
    )


def _check_columns(source: GenericSource, wanted: list[str], available: list[str]) -> None:
    missing = [name for name in wanted if name not in available]
    if missing:
        raise DataError(
            f"{source.path} has no column {missing[0]!r} (columns: {', '.join(available)}); "
            f"name the right ones with --user_column/--item_column/--timestamp_column"
        )


def _first_line(path: str) -> str:
    with tf.io.gfile.GFile(path, "rb") as stream:
        return stream.readline().decode("utf-8", errors="replace").strip()


def _generic_ints(table: pa.Table, name: str, path: str) -> np.ndarray:
    column = table.column(name)
    if pa.types.is_dictionary(column.type):  # e.g. a pandas categorical
        column = column.cast(column.type.value_type)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = _parse_decimal_strings(column, name, path)
    elif not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise DataError(
            f"{path}: column {name!r} holds {column.type} values, not integers; "
            f"map ids to integers first"
        )
    values = column.to_numpy(zero_copy_only=False)
    if column.null_count or (values.dtype.kind == "f" and not np.all(values == np.round(values))):
        raise DataError(f"{path}: column {name!r} has empty or non-integer values")
    return values.astype(np.int64)


def _parse_decimal_strings(column: pa.ChunkedArray, name: str, path: str) -> pa.ChunkedArray:
    """Integer ids stored as text (a Parquet file written from string columns) as int64."""
    is_decimal = pc.fill_null(pc.match_substring_regex(column, r"^\s*[+-]?[0-9]+\s*$"), True)
    if not pc.all(is_decimal).as_py():
        bad = column.filter(pc.invert(is_decimal))[0].as_py()
        raise DataError(
            f"{path}: column {name!r} holds {bad!r}, which is not an integer id; "
            f"map ids to integers first"
        )
    digits = pc.replace_substring_regex(pc.utf8_trim_whitespace(column), r"^\+", "")
    try:
        return pc.cast(digits, pa.int64())
    except pa.ArrowInvalid as error:  # digits beyond 64 bits
        raise DataError(f"{path}: column {name!r}: {error}; ids must fit in 64 bits") from None


# ---------------------------------------------------------------------------
# Movie titles


@dataclasses.dataclass(frozen=True)
class _MoviesFormat:
    suffix: str
    separator: str  # "," means a CSV with a header and quoted titles
    encoding: str
    num_fields: int


# Chosen by file name. GroupLens wrote the older releases in Latin-1, the CSV ones in UTF-8.
_MOVIES_FORMATS = (
    _MoviesFormat(".dat", "::", "latin-1", 3),  # movies.dat: id::title::genres
    _MoviesFormat(".csv", ",", "utf-8-sig", 3),  # movies.csv: movieId,title,genres
    _MoviesFormat(".item", "|", "latin-1", 24),  # ML-100K u.item: id|title|date|...
)


def read_movie_titles(path: str) -> dict[int, str]:
    """Movie id -> title, from a MovieLens ``movies.dat``, ``movies.csv`` or ``u.item``.

    Raises:
        DataError: the file is missing or empty, is none of those kinds, or has a
            malformed line (named by its number).
    """
    _require_file(path)
    movies_format = next((f for f in _MOVIES_FORMATS if path.endswith(f.suffix)), None)
    if movies_format is None:
        raise DataError(
            f"{path} is not a MovieLens movies file; pass movies.dat (ml-1m, ml-10m), "
            "movies.csv (ml-20m and later) or u.item (ml-100k)"
        )
    with tf.io.gfile.GFile(path, "rb") as stream:
        try:
            text = stream.read().decode(movies_format.encoding)
        except UnicodeDecodeError as error:
            raise DataError(f"{path} is not {movies_format.encoding} text: {error}") from None
    if movies_format.separator == ",":
        rows = enumerate(csv.reader(io.StringIO(text)), start=1)
        _, header = next(rows, (1, []))
        if header[:2] != ["movieId", "title"]:
            raise DataError(f"{path}:1: expected the header movieId,title,genres")
    else:
        rows = enumerate((line.split(movies_format.separator) for line in text.splitlines()), 1)
    titles = {}
    for number, fields in rows:
        if fields in ([], [""]):
            continue
        if len(fields) != movies_format.num_fields or not fields[0].strip().isdigit():
            raise DataError(
                f"{path}:{number}: expected {movies_format.num_fields} fields, the first a "
                f"movie id: {movies_format.separator.join(fields)[:80]!r}; is it a movies file?"
            )
        titles[int(fields[0])] = fields[1]
    if not titles:
        raise DataError(f"{path} lists no movies")
    return titles


# ---------------------------------------------------------------------------
# Downloading


def download_dataset(info: DatasetInfo, data_dir: str, url_base: str) -> None:
    """Downloads, verifies and unpacks a GroupLens archive into ``data_dir/<name>/``.

    The archive is fetched to a temporary name, its MD5 checked against the ``.md5``
    file GroupLens publishes beside it, and unpacked as `unpack_local_archive` does.

    Raises:
        DataError: the download failed, the checksum does not match, the archive is
            corrupt, or `data_dir` cannot be written. Nothing is left behind.
    """
    if info.archive is None:
        raise DataError(f"dataset {info.name!r} cannot be downloaded")
    url = url_base.rstrip("/") + "/" + info.archive
    with _scratch_dir(info, data_dir) as temp_dir:
        archive_path = os.path.join(temp_dir, info.archive)
        expected_md5 = _fetch_md5(url, info)
        actual_md5 = _fetch(url, archive_path, info)
        if actual_md5 != expected_md5:
            raise DataError(
                f"checksum mismatch for {url}: GroupLens publishes MD5 {expected_md5}, the "
                f"download has {actual_md5}; the file is corrupt or was changed, download again"
            )
        _unpack(archive_path, info, data_dir, temp_dir, url)
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
    with _scratch_dir(info, data_dir) as temp_dir:
        _unpack(archive_path, info, data_dir, temp_dir, archive_path)
    logging.info("%s is ready in %s", info.name, dataset_dir(data_dir, info))


def write_error(error: tf.errors.OpError | OSError, what: str, folder: str, flag: str) -> DataError:
    """The one-line `DataError` for a failed write of `what` into `folder`
    (`errors.write_failure`)."""
    return DataError(errors.write_failure(error, what, folder, flag))


@contextlib.contextmanager
def _scratch_dir(info: DatasetInfo, data_dir: str) -> Iterator[str]:
    """A temporary folder in `data_dir` (so files move into place by rename), removed at
    the end; a failed write in it becomes a `DataError` naming `data_dir`."""
    temp_dir = os.path.join(data_dir, f".{info.name}.unpack-{os.getpid()}")
    try:
        tf.io.gfile.makedirs(temp_dir)
        yield temp_dir
    except (tf.errors.OpError, OSError) as error:
        raise write_error(error, f"the {info.name} files", data_dir, "--data_dir") from None
    finally:
        if tf.io.gfile.exists(temp_dir):
            tf.io.gfile.rmtree(temp_dir)


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


def _unpack(
    archive_path: str, info: DatasetInfo, data_dir: str, temp_dir: str, source: str
) -> None:
    """Unpacks the archive into `temp_dir`, then moves its files into ``data_dir/<name>/``,
    the ratings file last, so an interrupted run never leaves one that looks complete."""
    extracted = os.path.join(temp_dir, "extracted")
    _extract(archive_path, info, extracted, source)
    _move_into_place(extracted, dataset_dir(data_dir, info), info.ratings_file)


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


def _move_into_place(source_dir: str, target_dir: str, ratings_file: str) -> None:
    """Moves unpacked files into `target_dir`, the ratings file last."""
    tf.io.gfile.makedirs(target_dir)
    names = sorted(tf.io.gfile.listdir(source_dir), key=lambda name: name == ratings_file)
    for name in names:
        destination = os.path.join(target_dir, name)
        if not tf.io.gfile.exists(destination) or name == ratings_file:
            tf.io.gfile.rename(os.path.join(source_dir, name), destination, overwrite=True)
