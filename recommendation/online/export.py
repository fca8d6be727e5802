"""Versioned, atomic SavedModel exports for serving while training goes on.

Layout (the one TensorFlow Serving polls): ``EXPORT_BASE/<version>/`` with a
SavedModel and ``export_info.json`` (step, stream position, time). A version is
written under a hidden temporary name in the same folder and renamed into place, so a
reader listing numeric folders never sees one half-written; versions beyond `keep`
are renamed aside (hidden) before they are deleted, so they vanish at once too.
"""

from __future__ import annotations

import json
import os
import time

import tensorflow as tf

INFO_FILE = "export_info.json"


def versions(export_base: str) -> list[int]:
    """Complete versions in `export_base`, oldest first."""
    if not tf.io.gfile.isdir(export_base):
        return []
    names = (name.rstrip("/") for name in tf.io.gfile.listdir(export_base))
    return sorted(int(name) for name in names if name.isdigit())


def latest_export(export_base: str) -> str | None:
    """The newest complete version's folder, or None."""
    found = versions(export_base)
    return os.path.join(export_base, str(found[-1])) if found else None


def read_info(export_dir: str) -> dict:
    """The ``export_info.json`` of a version."""
    with tf.io.gfile.GFile(os.path.join(export_dir, INFO_FILE)) as info:
        return json.load(info)


def export_saved_model(
    export_base: str,
    version: int,
    module: tf.Module,
    signatures: dict,
    info: dict,
    keep: int = 3,
) -> str:
    """Saves `module` as version `version` of `export_base`, atomically.

    Args:
        export_base: Folder of versions.
        version: Version number (the training step: newer exports are larger).
        module: What to save.
        signatures: Serving signatures (``{"serving_default": fn}``).
        info: Written to ``export_info.json`` inside the version, with the time.
        keep: Versions kept; older ones are removed.
    Returns:
        The version's folder.
    """
    tf.io.gfile.makedirs(export_base)
    final = os.path.join(export_base, str(version))
    temp = os.path.join(export_base, f".tmp-{version}-{os.getpid()}")
    if tf.io.gfile.exists(temp):
        tf.io.gfile.rmtree(temp)
    tf.saved_model.save(module, temp, signatures=signatures)
    with tf.io.gfile.GFile(os.path.join(temp, INFO_FILE), "w") as out:
        json.dump({**info, "version": version, "exported_at": time.time()}, out)
    if tf.io.gfile.exists(final):  # re-export of the same step after a restart
        _remove(export_base, final)
    tf.io.gfile.rename(temp, final)
    for old in versions(export_base)[:-keep]:
        _remove(export_base, os.path.join(export_base, str(old)))
    return final


def _remove(export_base: str, path: str) -> None:
    hidden = os.path.join(export_base, f".old-{os.path.basename(path)}-{os.getpid()}")
    tf.io.gfile.rename(path, hidden, overwrite=True)
    tf.io.gfile.rmtree(hidden)
