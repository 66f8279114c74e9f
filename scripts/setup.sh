#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv with this project installed (editable) at the pinned versions.
# Safe to run again and again: it reinstalls only when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.nsa-setup-stamp
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import nsa_model, pipeline' 2>/dev/null; then
  exit 0
fi

echo "setup: installing the project and its pinned dependencies into .venv (first time: a few minutes)"
.venv/bin/python -m pip install -q --upgrade pip
# torch first, at the pinned version: on a machine that keeps a local CPU build (as this project's dev
# machines do) pip takes it from there in seconds instead of downloading a CUDA build.
.venv/bin/python -m pip install -q -c constraints.txt torch
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
echo "$want" > "$stamp"
echo "setup: done"
