#!/usr/bin/env bash
# Set up (idempotent) and run the main job on its embedded defaults; extra arguments go to jobs/pretrain.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python jobs/pretrain.py "$@"
