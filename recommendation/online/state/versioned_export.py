"""Versioned, atomic SavedModel exports for serving while training goes on.

Layout (the one TensorFlow Serving polls): ``EXPORT_BASE/<version>/`` with a
SavedModel and ``export_info.json`` (step, stream position, time). A version is
written under a hidden temporary name in the same folder and renamed into place
(`atomic.replace_folder`), so a reader listing numeric folders never sees one
half-written; versions beyond `keep` are renamed aside (hidden) before they are
deleted (`atomic.remove_folder`), so they vanish at once too.

A version is complete when its ``export_info.json`` is there, and `versions` lists only
those. On a local path that is the same as the folder being there. On ``gs://``, where
a folder rename is a copy object by object, it is not: there ``saved_model.pb`` and
then ``export_info.json`` are written last, once every other file of the version is
in place (`MARKERS`), and removed first when a version is pruned; a reader of
``gs://`` must go by `versions` / `latest_export` (a poller that loads the highest
numeric folder can meet one being copied; it has no ``saved_model.pb`` yet).

Versions only ever increase, across restarts too: a version is the training step, or
one more than the newest version in the folder when that is higher. A trainer that
crashed before its checkpoint and resumed from an older step (or from none) thus
exports above the versions of the run that crashed, and a server loading the highest
version loads the newest model; pruning by version keeps the newest ones. One
exporter writes to a folder at a time: ncf-online holds its lease
(`writer_lease.hold_export`), and an exporter whose lease was taken over writes nothing
more there.

The publications of a run's changes between versions (`serving.publications`) live
beside the versions, in ``publications/``: once a version is written, those the
version before it holds are deleted (a server further behind loads the newest).

(ncf-main's one-off SavedModel and ONNX export of a trained model is
`recommendation/export.py`; this module knows no model: `serving.online_version` says
what a version holds.)
"""

from __future__ import annotations

import json
import os
import time

import tensorflow as tf

from official.core import writer_lease
from official.utils.misc import atomic
from recommendation.serving import publication_channels

INFO_FILE = "export_info.json"
# Written last, in this order, on gs:// (`atomic.replace_folder`): a version whose info
# file is there is complete.
MARKERS = (tf.saved_model.SAVED_MODEL_FILENAME_PB, INFO_FILE)


def versions(export_base: str) -> list[int]:
    """Complete versions in `export_base` (their info file is there), oldest first."""
    return _complete(export_base, _numbered(export_base))


def _complete(export_base: str, numbered: list[int]) -> list[int]:
    """Those of the version folders `numbered` whose info file is there."""
    return [
        version
        for version in numbered
        if tf.io.gfile.exists(os.path.join(export_base, str(version), INFO_FILE))
    ]


def _numbered(export_base: str) -> list[int]:
    """Every version folder in `export_base`, complete or not, oldest first."""
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


class Exporter:
    """Writes versions of one module's SavedModel into `export_base`, atomically.

    The first version is a full ``tf.saved_model.save``; later ones reuse its graph
    files (the module's functions do not change, only its variable and table values)
    and write just the variables, a checkpoint with the module as root, laid out as
    the SavedModel loader reads it. That makes an export a small fraction of a
    second instead of most of one, which is what lets exports run every few seconds.

    Args:
        export_base: Folder of versions.
        module: What to save.
        signatures: Serving signatures (``{"serving_default": fn}``).
        keep: Versions kept; older ones are removed.
        channel: Where the publications between versions go
            (`publication_channels`; None: the folder's ``publications/``): what no
            kept version needs is pruned from it.
    """

    def __init__(
        self,
        export_base: str,
        module: tf.Module,
        signatures: dict,
        keep: int = 3,
        channel=None,
    ) -> None:
        self.export_base, self.keep = export_base, keep
        self.channel = channel or publication_channels.Folder(export_base)
        self.module, self.signatures = module, signatures
        self._graph_files: dict[str, bytes] | None = None
        self._variables = tf.train.Checkpoint(root=module)
        # What an exporter killed midway left: half-written versions, versions being
        # deleted.
        atomic.remove_leftovers(export_base)

    def export(self, step: int, info: dict) -> str:
        """Writes the model at `step` as the next version (`step`, or one more than the
        newest version there if that is higher), with `info` in ``export_info.json``;
        returns its folder.

        Raises:
            ModelDirError: Another process took over the folder's lease
                (`writer_lease.check_held`): this one writes no more versions there.
        """
        writer_lease.check_held(self.export_base)
        tf.io.gfile.makedirs(self.export_base)
        # Above every version folder, complete or not: a server loading the highest
        # one must find the newest model, never an older one's leftover.
        existing = _numbered(self.export_base)
        version = max(step, existing[-1] + 1) if existing else step
        final = os.path.join(self.export_base, str(version))
        with atomic.replace_folder(final, markers=MARKERS) as temp:
            if self._graph_files is None:
                tf.saved_model.save(self.module, temp, signatures=self.signatures)
                self._graph_files = _graph_files(temp)
            else:
                for name, content in self._graph_files.items():
                    tf.io.gfile.makedirs(os.path.dirname(os.path.join(temp, name)))
                    with tf.io.gfile.GFile(os.path.join(temp, name), "wb") as out:
                        out.write(content)
                self._variables.write(os.path.join(temp, "variables", "variables"))
            with tf.io.gfile.GFile(os.path.join(temp, INFO_FILE), "w") as out:
                json.dump({**info, "version": version, "exported_at": time.time()}, out)
        numbered = _numbered(self.export_base)
        complete = _complete(self.export_base, numbered)
        # Incomplete folders are a killed exporter's (one exporter writes a folder at a
        # time): on gs://, a version it was copying into place or deleting.
        for old in sorted(set(numbered) - set(complete[-self.keep :])):
            atomic.remove_folder(os.path.join(self.export_base, str(old)), markers=MARKERS)
        self._prune_publications(complete[-2:])
        return final

    def _prune_publications(self, kept: list[int]) -> None:
        """Deletes the publications a server no longer needs: those the version before
        the newest holds (a server that lags less than a version's time never loads one
        again; one behind loads the newest), and those of other runs."""
        newest = read_info(os.path.join(self.export_base, str(kept[-1])))
        if "run" not in newest:
            return
        before = read_info(os.path.join(self.export_base, str(kept[-2]))) if kept[:-1] else {}
        base = before if before.get("run") == newest["run"] else newest
        self.channel.prune(
            {newest["run"]: base["publication"] + 1}, base.get("copied_at", base["exported_at"])
        )


def _graph_files(saved_model_dir: str) -> dict[str, bytes]:
    """Every file of a SavedModel but its variables, by relative path."""
    found = {}
    for folder, _, names in tf.io.gfile.walk(saved_model_dir):
        relative = os.path.relpath(folder, saved_model_dir)
        if relative.split(os.sep)[0] == "variables":
            continue
        for name in names:
            with tf.io.gfile.GFile(os.path.join(folder, name), "rb") as stream:
                found[os.path.normpath(os.path.join(relative, name))] = stream.read()
    return found
