"""Top-k recommendations by raw user id from an exported SavedModel.

    python -m recommendation.recommend --export_dir DIR --user_id 42 [--k 10] \
        [--movies ml-1m/movies.dat]
    python -m recommendation.recommend --export_dir DIR --users_file users.txt \
        --output recommendations.csv [--k 10] [--movies PATH]

One user: prints a table (rank, item id, score, title when --movies names the
release's movies.dat, movies.csv or u.item). Many users (--users_file, one raw user id
a line): writes CSV rows ``user_id,rank,item_id,score[,title]``, atomically (its folder
created if missing). Items the user rated in training are left out unless
--noexclude_seen. Ids are the dataset's raw ids, as in its ratings file.

--export_dir may also name what ncf-online exports: a version, or the folder of
versions (its newest complete one). An online version ranks every item its model holds
a row for; it keeps no history, so nothing is left out.

Bad input (a missing or damaged export, an id that is no 64-bit integer, an --output
that cannot be written) ends the command with one ``error:`` line naming it and the
fix, and writes nothing.
"""

from __future__ import annotations

import csv
import io
import os

import numpy as np
import tensorflow as tf
from absl import app, flags

from official.utils.misc import atomic, errors
from recommendation.data import movie_titles, movielens
from recommendation.data.movielens import DataError
from recommendation.online.state import versioned_export
from recommendation.serving import export_files

_USER_IDS_HINT = os.path.join("assets", export_files.USER_IDS_FILE)
# Raw ids are int64, as in the ratings files and the signatures.
_MIN_ID, _MAX_ID = -(2**63), 2**63 - 1


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of this command."""
    fv = flag_values
    flags.DEFINE_string("export_dir", None, "SavedModel written by an export.", flag_values=fv)
    flags.DEFINE_integer(
        "user_id",
        None,
        "Raw id of the user to recommend for.",
        lower_bound=_MIN_ID,
        upper_bound=_MAX_ID,
        flag_values=fv,
    )
    flags.DEFINE_string(
        "users_file", None, "Batch mode: a file of raw user ids, one a line.", flag_values=fv
    )
    flags.DEFINE_string("output", None, "Batch mode: the CSV file to write.", flag_values=fv)
    flags.DEFINE_integer("k", 10, "Recommendations per user.", lower_bound=1, flag_values=fv)
    flags.DEFINE_string(
        "movies", None, "movies.dat, movies.csv or u.item, to print titles.", flag_values=fv
    )
    flags.DEFINE_boolean(
        "exclude_seen", True, "Leave out the user's training items.", flag_values=fv
    )
    flags.DEFINE_integer(
        "batch_size", 64, "Users per call in batch mode.", lower_bound=1, flag_values=fv
    )
    flags.mark_flag_as_required("export_dir", flag_values=fv)
    flags.register_multi_flags_validator(
        ["user_id", "users_file"],
        lambda values: (values["user_id"] is None) != (values["users_file"] is None),
        message="give exactly one of --user_id and --users_file",
        flag_values=fv,
    )
    flags.register_multi_flags_validator(
        ["users_file", "output"],
        lambda values: (values["users_file"] is None) == (values["output"] is None),
        message="--users_file and --output go together (batch mode writes a CSV file)",
        flag_values=fv,
    )


class Recommender:
    """The ``recommend`` signature of an export, with errors a user can act on.

    Args:
        export_dir: A SavedModel written by `recommendation.export`.

    Raises:
        ExportError: there is no SavedModel there, or it is damaged or incomplete.
        DataError: it has no ``recommend`` signature.
    """

    def __init__(self, export_dir: str) -> None:
        newest = versioned_export.latest_export(export_dir)
        if newest is not None and not tf.saved_model.contains_saved_model(export_dir):
            export_dir = newest  # an ncf-online export base: its newest version
        signatures = export_files.load_export(export_dir).signatures
        if "recommend" not in signatures:
            raise DataError(
                f"{export_dir} has no 'recommend' signature; export it again with this "
                "version of python -m recommendation.export or ncf-online"
            )
        self.export_dir = export_dir
        self._recommend = signatures["recommend"]
        # An online version's: every item with a row ranked, no history to leave out.
        self.online = "exclude_seen" not in self._recommend.structured_input_signature[1]

    def __call__(
        self, user_ids: np.ndarray, k: int, exclude_seen: bool = True, batch_size: int = 64
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-`k` raw item ids and scores, `(users, k)` each; -1 / NaN pad short rows.

        Raises:
            DataError: a user id is not in the training data.
        """
        item_ids, scores = [], []
        for start in range(0, len(user_ids), batch_size):
            inputs = {
                "user_id": tf.constant(user_ids[start : start + batch_size], tf.int64),
                "k": tf.constant(k, tf.int32),
            }
            if not self.online:
                inputs["exclude_seen"] = tf.constant(exclude_seen)
            result = self._recommend(**inputs)
            unknown = user_ids[start : start + batch_size][~result["known"].numpy()]
            if len(unknown) and self.online:
                raise DataError(
                    f"user id(s) {', '.join(map(str, unknown[:5]))} hold no row in the model "
                    f"of {self.export_dir}: an online model holds the users it has trained on "
                    "(and evicted none of)"
                )
            if len(unknown):
                raise DataError(
                    f"user id(s) {', '.join(map(str, unknown[:5]))} not in the training "
                    f"data of {self.export_dir}; use the dataset's raw user ids (listed in "
                    f"{os.path.join(self.export_dir, _USER_IDS_HINT)})"
                )
            item_ids.append(result["item_ids"].numpy())
            scores.append(result["scores"].numpy())
        return np.concatenate(item_ids), np.concatenate(scores)


def read_user_ids(path: str) -> np.ndarray:
    """Raw user ids, one a line (blank lines skipped).

    Raises:
        DataError: the file is missing or empty, or a line is not an int64 integer.
    """
    if not tf.io.gfile.exists(path):
        raise DataError(f"{path} not found")
    users = []
    with tf.io.gfile.GFile(path, "r") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                user = int(line)
            except ValueError:
                raise DataError(
                    f"{path}:{number}: {line.strip()[:40]!r} is not a user id; "
                    "the file holds one integer user id a line"
                ) from None
            if not _MIN_ID <= user <= _MAX_ID:
                raise DataError(
                    f"{path}:{number}: {line.strip()[:40]} is not a user id: raw ids are "
                    f"64-bit integers, from {_MIN_ID} to {_MAX_ID}"
                )
            users.append(user)
    if not users:
        raise DataError(f"{path} holds no user ids")
    return np.asarray(users, np.int64)


def _rows(users, item_ids, scores, titles):
    """(user, rank, item, score[, title]) for every real (not padding) recommendation."""
    for user, items, values in zip(users, item_ids, scores, strict=True):
        for rank, (item, score) in enumerate(zip(items, values, strict=True), start=1):
            if item >= 0:
                row = [int(user), rank, int(item), f"{score:.6f}"]
                yield row if titles is None else [*row, titles.get(int(item), "")]


def format_table(user: int, item_ids, scores, titles: dict[int, str] | None) -> str:
    """What the one-user mode prints."""
    rows = list(_rows([user], item_ids[None], scores[None], titles))
    lines = [f"top {len(rows)} for user {user}:", "rank  item_id     score  title"]
    for _, rank, item, score, *title in rows:
        lines.append(f"{rank:>4}  {item:>7}  {score:>8}  {title[0] if title else ''}".rstrip())
    return "\n".join(lines)


def write_csv(path: str, users, item_ids, scores, titles: dict[int, str] | None) -> int:
    """Writes the rows to `path` (`check_output` passed) atomically; returns how many.

    Raises:
        DataError: It could not be written (a read-only folder, a full disk).
    """
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["user_id", "rank", "item_id", "score"] + ([] if titles is None else ["title"]))
    count = 0
    for row in _rows(users, item_ids, scores, titles):
        writer.writerow(row)
        count += 1
    folder = os.path.dirname(path) or "."
    try:
        atomic.write_file(path, text.getvalue())
    except (OSError, tf.errors.OpError) as error:
        raise movielens.write_error(error, os.path.basename(path), folder, "--output") from None
    return count


def check_output(path: str) -> None:
    """Refuses, before any work, an `--output` that is a folder or whose folder does
    not exist (a mistyped path; on ``gs://`` there are no folders to miss).

    Raises:
        DataError: Saying which, and the fix.
    """
    if tf.io.gfile.isdir(path):
        raise DataError(f"--output {path} is a folder; give the path of the CSV file to write")
    folder = os.path.dirname(path) or "."
    if atomic.is_local(path) and not tf.io.gfile.isdir(folder):
        raise DataError(
            f"--output {path}: its folder {folder} does not exist; create it, or give "
            "--output in an existing folder"
        )


def run(fv: flags.FlagValues) -> str:
    """Does what the parsed flags `fv` ask; returns the text to print.

    Raises:
        DataError, ExportError: bad input (the message names it and the fix).
    """
    if fv.output:
        check_output(fv.output)
    titles = movie_titles.read_movie_titles(fv.movies) if fv.movies else None
    users = read_user_ids(fv.users_file) if fv.users_file else np.array([fv.user_id], np.int64)
    item_ids, scores = Recommender(fv.export_dir)(users, fv.k, fv.exclude_seen, fv.batch_size)
    if not fv.users_file:
        return format_table(fv.user_id, item_ids[0], scores[0], titles)
    count = write_csv(fv.output, users, item_ids, scores, titles)
    return f"wrote {count} recommendations for {len(users)} users to {fv.output}"


def main(argv: list[str]) -> None:
    del argv  # the flags parser refused any other argument
    with errors.exit_on_user_errors(DataError, export_files.ExportError):
        print(run(flags.FLAGS))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=errors.command_line_parser())
