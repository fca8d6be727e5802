"""The preprocessing cache: the preprocessed arrays of a `DataConfig`, kept on disk.

`load_or_build` keeps the result in ``<cache_dir>/ncf_cache.npz`` (with a readable
copy of its metadata in ``ncf_cache.json``), written atomically and rebuilt when the
source files, the parameters or the format change, when it is older than
`cache_max_age_sec`, or when it is corrupt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import time
import zipfile
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from absl import logging

from official.utils.misc import atomic
from recommendation.data import constants, data_preprocessing, movielens
from recommendation.data.data_preprocessing import DataConfig, PreprocessedData

CACHE_FILE = "ncf_cache.npz"
CACHE_METADATA_FILE = "ncf_cache.json"
_ARRAY_KEYS = (
    "user_ids",
    "item_ids",
    "train_offsets",
    "train_items",
    "eval_items",
    "eval_negatives",
    "validation_items",
)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What `load_or_build` returns.

    Attributes:
        data: The preprocessed dataset.
        cache_path: Where it is cached.
        from_cache: Whether it was read from an existing cache.
        reason: Why the cache was (re)built, or "" when it was used.
        seconds: Time taken.
    """

    data: PreprocessedData
    cache_path: str
    from_cache: bool
    reason: str
    seconds: float


def load_or_build(config: DataConfig) -> LoadResult:
    """Returns the preprocessed dataset, from the cache when it is still valid.

    Raises:
        DataError: the source cannot be read (nothing is written in that case), or
            the cache folder cannot be written (a valid cache there is only read).
    """
    start = time.monotonic()
    cache_dir = config.resolved_cache_dir()
    cache_path = os.path.join(cache_dir, CACHE_FILE)
    data, reason = _read_cache(cache_path, config)
    if data is not None:
        logging.info("Loaded preprocessed %s from %s", config.dataset, cache_path)
        return LoadResult(data, cache_path, True, "", time.monotonic() - start)
    logging.info("Preprocessing %s (%s)", config.dataset, reason)
    data, sources = data_preprocessing.build(config)
    _write_cache(cache_dir, data, _metadata(config, data, sources))
    return LoadResult(data, cache_path, False, reason, time.monotonic() - start)


def _metadata(config: DataConfig, data: PreprocessedData, sources: tuple[str, ...]) -> dict:
    return {
        "format_version": constants.CACHE_FORMAT_VERSION,
        "created": time.time(),
        "parameters": config.cache_parameters(),
        "sources": [_fingerprint(path, with_hash=True) for path in sources],
        "statistics": {
            "num_users": data.num_users,
            "num_items": data.num_items,
            "num_train_positives": data.num_train_positives,
            "num_eval_users": len(data.eval_items),
        },
    }


def _fingerprint(path: str, with_hash: bool) -> dict:
    stat = tf.io.gfile.stat(path)
    fingerprint = {"path": path, "size": stat.length, "mtime_ns": stat.mtime_nsec}
    if with_hash:
        digest = hashlib.sha256()
        with tf.io.gfile.GFile(path, "rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
        fingerprint["sha256"] = digest.hexdigest()
    return fingerprint


def _stale_reason(metadata: dict, config: DataConfig) -> str:
    """Why a cache with `metadata` cannot be used for `config` ("" if it can)."""
    if metadata.get("format_version") != constants.CACHE_FORMAT_VERSION:
        return "cache format changed"
    if metadata.get("parameters") != json.loads(json.dumps(config.cache_parameters())):
        return "parameters changed"
    if time.time() - metadata.get("created", 0) > config.cache_max_age_sec:
        return "cache is older than its maximum age"
    for recorded in metadata.get("sources", []):
        path = recorded["path"]
        if not tf.io.gfile.exists(path):
            return f"source {path} is gone"
        current = _fingerprint(path, with_hash=False)
        if current["size"] != recorded["size"]:
            return f"source {path} changed"
        if current["mtime_ns"] != recorded["mtime_ns"]:
            if _fingerprint(path, with_hash=True)["sha256"] != recorded["sha256"]:
                return f"source {path} changed"
    return ""


def read_cache(path: str) -> PreprocessedData:
    """Loads a cache written by `load_or_build` without re-validating it.

    For processes (the data producer) handed a cache the trainer just validated.
    """
    with _open_npz(path) as contents:
        return _arrays(contents)


@contextlib.contextmanager
def _open_npz(path: str) -> Iterator[np.lib.npyio.NpzFile]:
    """Opens the archive without reading it: each member is read when first asked for."""
    with tf.io.gfile.GFile(path, "rb") as stream, np.load(stream, allow_pickle=False) as contents:
        yield contents


def _arrays(contents: np.lib.npyio.NpzFile) -> PreprocessedData:
    return PreprocessedData(**{key: contents[key] for key in _ARRAY_KEYS if key in contents})


def _read_cache(path: str, config: DataConfig) -> tuple[PreprocessedData | None, str]:
    """Returns (data, "") for a valid cache, else (None, why it must be rebuilt).

    The metadata member decides staleness before any array is read, so a stale cache
    of a large dataset costs a few bytes, not the whole archive.
    """
    if not tf.io.gfile.exists(path):
        return None, "no cache yet"
    try:
        with _open_npz(path) as contents:
            metadata = json.loads(str(contents["metadata"]))
            reason = _stale_reason(metadata, config)
            if reason:
                return None, reason
            data = _arrays(contents)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as error:
        logging.warning("Preprocessing cache %s is corrupt (%s); rebuilding it", path, error)
        return None, "cache was corrupt"
    if metadata["statistics"]["num_train_positives"] != data.num_train_positives:
        logging.warning("Preprocessing cache %s does not match its metadata; rebuilding", path)
        return None, "cache was corrupt"
    return data, ""


def _write_cache(cache_dir: str, data: PreprocessedData, metadata: dict) -> None:
    """Writes arrays and metadata atomically, both written before either is renamed.

    Raises:
        DataError: `cache_dir` cannot be written (read-only, forbidden, full); no
            temporary file is left and an existing cache is left as it was.
    """
    arrays = {key: value for key, value in dataclasses.asdict(data).items() if value is not None}
    text = json.dumps(metadata, indent=2, sort_keys=True)
    packed = io.BytesIO()  # zip writing needs seeks, which gfile writers lack
    np.savez(packed, metadata=np.array(text), **arrays)
    try:
        tf.io.gfile.makedirs(cache_dir)
        atomic.write_files(
            {
                os.path.join(cache_dir, CACHE_FILE): packed.getvalue(),
                os.path.join(cache_dir, CACHE_METADATA_FILE): text,
            }
        )
    except (tf.errors.OpError, OSError) as error:
        raise movielens.write_error(
            error, "the preprocessing cache", cache_dir, "--cache_dir"
        ) from None
