"""Loads TensorFlow (through Keras, as the suite first does) with the process's stderr
sent to a file: what its libraries write while they load (CUDA drivers, oneDNN, CPU
features) comes before any setting is read, and pytest, which captures the start of a
session, would print it after its summary, where a newcomer looks for the result. The
file is shown if the loading fails. Imported first by conftest, in every process of
the suite."""

from __future__ import annotations

import os
import sys
import tempfile

with tempfile.TemporaryFile() as _log:
    sys.stderr.flush()
    _stderr = os.dup(2)
    os.dup2(_log.fileno(), 2)
    try:
        import keras  # noqa: F401  (loads TensorFlow)
    except BaseException:
        os.dup2(_stderr, 2)
        _log.seek(0)
        sys.stderr.write(_log.read().decode(errors="replace"))
        raise
    finally:
        os.dup2(_stderr, 2)
        os.close(_stderr)
