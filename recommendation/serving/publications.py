"""Publications: what an online model changed between two moments, as its trainer
publishes it and servers apply it (`OnlineVersion.apply`), in one format for every
channel (files beside the versions, a Kafka topic, a Redis stream).

A trainer's run (``run``: a token of its own, made when it starts) numbers its
publications 1, 2, ... (``seq``); publication n holds what changed from the state of
publication n - 1 to its own, so it applies to that state only. A full version says
which publication of which run it holds the state of (``export_info.json``'s
``run`` and ``publication``; 0: none yet), so that a server that loads it goes on with
the next one. Of each table (``users``, ``items``) a publication holds the rows written
since (their row numbers ``slots``, ids ``keys`` and values ``rows``), the live count
``size`` (rows past it were dropped) and the ids that left the table (``deleted``:
evicted, or expired), and it holds the dense layers' weights whole (kilobytes).

A publication is one object: an uncompressed NumPy ``.npz`` archive (its members'
CRC-32 checked on reading) holding ``header.json`` (format, run, seq, the trainer's
step and stream position, the time it was published) beside the arrays. Files live
in ``EXPORT_BASE/publications/<run>/<seq>.npz``, each written whole or not at all
(`atomic.write_file`; on ``gs://`` one object), in order.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from typing import Any

import numpy as np
import tensorflow as tf

from official.utils.misc import atomic

# The tables a publication (and a version) holds, by name: an online NeuMF's two.
TABLES = ("users", "items")
FORMAT = 1
FOLDER = "publications"
SUFFIX = ".npz"
# What each table's changes hold, and their types.
TABLE_ARRAYS = {"slots": np.int64, "keys": np.int64, "rows": np.float32, "deleted": np.int64}


class PublicationError(Exception):
    """A publication that cannot be read whole; the message says what is wrong."""


@dataclasses.dataclass
class Publication:
    """One publication (module docstring).

    Attributes:
        run: The trainer run's token.
        seq: Its number in the run (from 1).
        step: The trainer's step when it was taken.
        position: The stream position trained by then (JSON-able).
        published_at: When it was taken (seconds since the epoch).
        tables: Per table (`TABLES`): ``slots``, ``keys``, ``rows``, ``deleted``
            (`TABLE_ARRAYS`) and ``size`` (an int).
        dense: The dense layers' weights (`online_version.dense_weights` order).
    """

    run: str
    seq: int
    step: int
    position: Any
    published_at: float
    tables: dict[str, dict[str, Any]]
    dense: list[np.ndarray]

    @property
    def rows(self) -> int:
        """Rows it holds, of both tables."""
        return sum(len(self.tables[name]["slots"]) for name in TABLES)


def encode(publication: Publication) -> bytes:
    """The publication as one ``.npz`` archive's bytes."""
    header = {
        "format": FORMAT,
        "run": publication.run,
        "seq": publication.seq,
        "step": publication.step,
        "position": publication.position,
        "published_at": publication.published_at,
        "sizes": {name: int(publication.tables[name]["size"]) for name in TABLES},
        "dense": len(publication.dense),
    }
    arrays = {"header.json": np.frombuffer(json.dumps(header).encode(), np.uint8)}
    for name in TABLES:
        for key, dtype in TABLE_ARRAYS.items():
            arrays[f"{name}.{key}"] = np.asarray(publication.tables[name][key], dtype)
    for index, weight in enumerate(publication.dense):
        arrays[f"dense.{index}"] = np.asarray(weight, np.float32)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def decode(data: bytes, where: str) -> Publication:
    """The publication `data` holds.

    Raises:
        PublicationError: It is truncated or damaged, of another format, or its arrays
            do not fit together; the message names `where` and what is wrong.
    """
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        header = json.loads(arrays.pop("header.json").tobytes())
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as error:
        raise PublicationError(f"{where} is truncated or damaged ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PublicationError(
            f"{where} is of format {header.get('format') if isinstance(header, dict) else None},"
            f" not {FORMAT}: serve it with the ncf-serve of the trainer that wrote it"
        )
    try:
        tables = {
            name: {
                **{key: arrays[f"{name}.{key}"] for key in TABLE_ARRAYS},
                "size": int(header["sizes"][name]),
            }
            for name in TABLES
        }
        dense = [arrays[f"dense.{index}"] for index in range(int(header["dense"]))]
        publication = Publication(
            str(header["run"]),
            int(header["seq"]),
            int(header["step"]),
            header["position"],
            float(header["published_at"]),
            tables,
            dense,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise PublicationError(f"{where} lacks {error}") from None
    for name, changes in tables.items():
        count = len(changes["slots"])
        if (
            changes["keys"].shape != (count,)
            or changes["rows"].ndim != 2
            or len(changes["rows"]) != count
        ):
            raise PublicationError(
                f"{where}: the {name} table's slots, keys and rows differ in length"
            )
        if count and (changes["slots"].min() < 1 or changes["slots"].max() > changes["size"]):
            raise PublicationError(f"{where}: a {name} row lies outside 1..{changes['size']}")
    return publication


def run_folder(export_base: str, run: str) -> str:
    """Where the files of `run`'s publications are."""
    return os.path.join(export_base, FOLDER, run)


def path(export_base: str, run: str, seq: int) -> str:
    """The file of publication `seq` of `run`."""
    return os.path.join(run_folder(export_base, run), f"{seq:010d}{SUFFIX}")


def write(export_base: str, run: str, seq: int, data: bytes) -> None:
    """Writes publication `seq` of `run` (`data`: `encode`'s) into `export_base`, whole or
    not at all.

    Raises:
        OSError, tf.errors.OpError: It could not be written (a full disk, say).
    """
    tf.io.gfile.makedirs(run_folder(export_base, run))
    atomic.write_file(path(export_base, run, seq), data)


def read(export_base: str, run: str, seq: int) -> Publication | None:
    """Publication `seq` of `run` from `export_base`, or None while there is none.

    Raises:
        PublicationError: It is there but cannot be read whole.
    """
    where = path(export_base, run, seq)
    try:
        with tf.io.gfile.GFile(where, "rb") as stream:
            data = stream.read()
    except tf.errors.NotFoundError:
        return None
    publication = decode(data, where)
    if (publication.run, publication.seq) != (run, seq):
        raise PublicationError(
            f"{where} holds publication {publication.seq} of run {publication.run}"
        )
    return publication


def exists(export_base: str, run: str, seq: int) -> bool:
    """Whether publication `seq` of `run` is in `export_base`."""
    return tf.io.gfile.exists(path(export_base, run, seq))


def numbers(export_base: str, run: str) -> list[int]:
    """The numbers of `run`'s publications in `export_base`, in order."""
    folder = run_folder(export_base, run)
    if not tf.io.gfile.isdir(folder):
        return []
    names = (name for name in tf.io.gfile.listdir(folder) if name.endswith(SUFFIX))
    return sorted(int(name[: -len(SUFFIX)]) for name in names if name[: -len(SUFFIX)].isdigit())


def runs(export_base: str) -> list[str]:
    """The runs with a publication folder in `export_base`."""
    folder = os.path.join(export_base, FOLDER)
    if not tf.io.gfile.isdir(folder):
        return []
    return sorted(
        name.rstrip("/") for name in tf.io.gfile.listdir(folder) if not name.startswith(".")
    )


def prune(export_base: str, needed: dict[str, int]) -> None:
    """Deletes the publications of `export_base` that no server needs: of the runs in
    `needed`, those numbered below the first one needed; of other runs, all."""
    for run in runs(export_base):
        if run not in needed:
            tf.io.gfile.rmtree(run_folder(export_base, run))
            continue
        for seq in numbers(export_base, run):
            if seq >= needed[run]:
                break
            tf.io.gfile.remove(path(export_base, run, seq))
