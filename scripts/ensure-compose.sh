#!/usr/bin/env bash
# Installs podman-compose (PyPI, pinned with hashes in scripts/compose/requirements.txt) into
# .cache/compose, idempotently, and prints the command that runs it:
#   python3 .cache/compose/run.py
# The compose test (tests/system/container.rs) runs compose.yaml with it.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=scripts/compose/requirements.txt
DIR=$PWD/.cache/compose
STAMP=$DIR/.requirements.sha256
if [ "$(cat "$STAMP" 2>/dev/null)" != "$(sha256sum <"$REQ")" ]; then
  echo "== installing podman-compose ($REQ)" >&2
  rm -rf "$DIR"
  mkdir -p "$DIR"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes -r "$REQ" --target "$DIR/lib" >&2
  cat >"$DIR/run.py" <<'PY'
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from podman_compose import main
sys.exit(main())
PY
  sha256sum <"$REQ" >"$STAMP"
fi
echo "python3 $DIR/run.py"
