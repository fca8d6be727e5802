#!/usr/bin/env bash
# The TorchRec peer's virtual environment: torch, FBGEMM's CPU build and TorchRec
# (pinned) and what TorchRec needs, outside the checkout and outside the project's own
# set-up, so that the TorchRec peer harness (scripts/peers/torchrec_online.py) runs
# beside ncf-online on the same event folders.
#
#   scripts/peers/setup_torchrec.sh [VENV_DIR]    # default $HOME/.cache/ncf-peers/torchrec
#
# The pins: torchrec 1.8.0 with fbgemm-gpu-cpu 1.8.0, which is built against torch 2.13
# (the table in fbgemm_gpu/__init__.py), and torch 2.13.0's CPU build (pip takes it from
# the machine's wheel folder where it lies there; elsewhere PyPI's build). torchrec 1.9.2
# with fbgemm-gpu-cpu 1.9.0 runs too, but needs torch 2.14, whose only build on PyPI is
# the CUDA one (5.5 GB installed, and about 470 MB more resident memory from its CUDA
# libraries on a CPU run); the results are the same. torchrec requires the CUDA package
# `fbgemm-gpu`, so it is installed without its requirements (--no-deps), after the
# others by hand: fbgemm-gpu-cpu and torchrec's own list (tensordict, torchmetrics,
# tqdm, pyre-extensions).
#
# Idempotent: an environment that already imports the pinned versions is left as it is.
# Prints the python to run the harness with (its last line). The harness also loads
# numpy-only modules of this checkout by path (recommendation/online/prequential.py,
# event_parsing.py): the environment holds no TensorFlow and no copy of the project.
set -euo pipefail
TORCH_VERSION="2.13.0"
FBGEMM_VERSION="1.8.0"
TORCHREC_VERSION="1.8.0"
REQUIREMENTS=("tensordict==0.15.3" "torchmetrics==1.0.3" "tqdm==4.70.1" "pyre-extensions==0.0.32")
PEER=torchrec
source "$(dirname "$0")/venv_folder.sh" "$@"
PINS="torchrec $TORCHREC_VERSION, fbgemm-gpu-cpu $FBGEMM_VERSION, torch $TORCH_VERSION"
installed() {
  "$PYTHON" - "$TORCH_VERSION" "$FBGEMM_VERSION" "$TORCHREC_VERSION" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version

import torch
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection  # noqa: F401

found = (torch.__version__.split("+")[0], version("fbgemm-gpu-cpu"), version("torchrec"))
sys.exit(found != tuple(sys.argv[1:]))
EOF
}
quiet_pip() {
  "$PYTHON" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
if [ -x "$PYTHON" ] && installed; then
  echo "$PINS ready in $VENV" >&2
else
  if [ ! -x "$PYTHON" ]; then python3 -m venv "$VENV"; fi
  quiet_pip --upgrade pip
  quiet_pip "torch==$TORCH_VERSION" "fbgemm-gpu-cpu==$FBGEMM_VERSION" "${REQUIREMENTS[@]}"
  quiet_pip --no-deps "torchrec==$TORCHREC_VERSION"
  installed || { echo "error: $PINS did not install into $VENV" >&2; exit 1; }
  echo "$PINS installed in $VENV" >&2
fi
echo "$PYTHON"
