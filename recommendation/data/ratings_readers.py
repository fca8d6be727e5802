"""Readers of ratings files: MovieLens releases, generic CSV/Parquet, the NCF split.

Every supported source is turned into `RawRatings` (parallel id/timestamp arrays), or,
for the NCF paper's published split, into `NcfSplitFiles` read by preprocessing as
given; which files a dataset has, and where, is the registry's (`movielens`). Reading
is vectorised (pyarrow's CSV reader); the slow line-by-line scan in `_locate_bad_line`
only runs after a parse failure, to name the offending line. All file access goes
through `tf.io.gfile`, so ``gs://`` data dirs work.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pa_parquet
import tensorflow as tf

from official.utils.misc import atomic
from recommendation.data import constants, movielens
from recommendation.data.movielens import DataError, FileFormat

# The NCF paper's *.rating files have 4 fields upstream (user, item, rating, time), 3 in
# some copies (no time): 0 = as found.
NCF_RATING_FORMAT = FileFormat(
    "\t", header=False, num_fields=0, user_field=0, item_field=1, timestamp_field=3
)


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
        train_timestamps: `(n,)` int64 times of the training lines, or None when the
            file has none (``--eval_split validation`` holds out each user's latest).
    """

    train_users: np.ndarray
    train_items: np.ndarray
    test_users: np.ndarray
    test_items: np.ndarray
    test_negatives: np.ndarray
    sources: tuple[str, ...]
    train_timestamps: np.ndarray | None = None


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
    info = movielens.dataset_info(name)
    if info.kind != "movielens":
        raise DataError(f"dataset {name!r} is not a MovieLens release")
    path = movielens.ratings_path(data_dir, info)
    if not tf.io.gfile.exists(path):
        archive_path = os.path.join(data_dir, info.archive)
        if tf.io.gfile.exists(archive_path):
            movielens.unpack_local_archive(info, data_dir, archive_path)
        elif download_if_missing:
            movielens.download_dataset(info, data_dir, url_base)
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
    require_file(path)
    if file_format.num_fields == 0:
        # As many fields as the first line has; a time field past them is absent.
        found = len(_first_line(path).split(file_format.separator))
        timestamp_field = file_format.timestamp_field
        if timestamp_field is not None and timestamp_field >= found:
            timestamp_field = None
        file_format = dataclasses.replace(
            file_format, num_fields=found, timestamp_field=timestamp_field
        )
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
    if atomic.is_local(path):
        return pa.OSFile(path, "rb")
    with tf.io.gfile.GFile(path, "rb") as stream:
        return pa.BufferReader(stream.read())


def _int_column(table: pa.Table, name: str) -> np.ndarray | None:
    column = table.column(name)
    if column.null_count:
        return None
    return column.to_numpy()


def require_file(path: str) -> None:
    """Raises `DataError` if `path` is missing or empty (before a reader opens it)."""
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
    info = movielens.dataset_info(name)
    train_path, test_path, negative_path = movielens.ncf_split_paths(data_dir, info)
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
        train_timestamps=train.timestamps,
    )


def _read_ncf_negatives(path: str) -> np.ndarray:
    """Reads lines ``(user,item)\\tneg1\\tneg2...`` into an `(u, 2 + k)` int64 array."""
    require_file(path)
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
    require_file(source.path)
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
