"""Movie titles of a MovieLens release (``movies.dat``, ``movies.csv``, ``u.item``),
for printing recommendations (`recommend`)."""

from __future__ import annotations

import csv
import dataclasses
import io

import tensorflow as tf

from recommendation.data.movielens import DataError
from recommendation.data.ratings_readers import require_file


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
    require_file(path)
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
