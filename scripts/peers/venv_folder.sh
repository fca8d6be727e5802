# Sourced by the peers' set-up scripts: VENV (the folder given, else the default
# $HOME/.cache/ncf-peers/$PEER, made absolute), ROOT (the checkout) and PYTHON; a folder
# inside the checkout is refused (the project's tools would read the environment).
#   PEER=river; source "$(dirname "$0")/venv_folder.sh" "$@"
VENV="${1:-${HOME}/.cache/ncf-peers/${PEER}}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$(python3 -c 'import os, sys; print(os.path.abspath(sys.argv[1]))' "$VENV")"
case "$VENV/" in
  "$ROOT"/*) echo "error: $VENV is inside the checkout $ROOT: give a folder outside it" >&2; exit 2 ;;
esac
PYTHON="$VENV/bin/python"
