#!/usr/bin/env bash
# The river peer's virtual environment: river (pinned) and what it needs, outside the
# checkout and outside the project's own set-up, so that the river peer harness
# (scripts/peers/river_online.py) runs beside ncf-online on the same event folders.
#
#   scripts/peers/setup_river.sh [VENV_DIR]    # default $HOME/.cache/ncf-peers/river
#
# Idempotent: an environment that already imports the pinned river is left as it is.
# Prints the python to run the harness with (its last line). The harness also loads
# two numpy-only modules of this checkout by path (recommendation/online/prequential.py,
# event_parsing.py): the environment holds no TensorFlow and no copy of the project.
set -euo pipefail
RIVER_VERSION="0.26.1"
PEER=river
source "$(dirname "$0")/venv_folder.sh" "$@"
installed() {
  "$PYTHON" -c "import sys, river; sys.exit(river.__version__ != '$RIVER_VERSION')" 2>/dev/null
}
if [ -x "$PYTHON" ] && installed; then
  echo "river $RIVER_VERSION ready in $VENV" >&2
else
  if [ ! -x "$PYTHON" ]; then python3 -m venv "$VENV"; fi
  "$PYTHON" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  "$PYTHON" -m pip install -q "river==$RIVER_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  installed || { echo "error: river $RIVER_VERSION did not install into $VENV" >&2; exit 1; }
  echo "river $RIVER_VERSION installed in $VENV" >&2
fi
echo "$PYTHON"
