#!/usr/bin/env bash
# Set up (idempotent) and run the test suite; extra arguments go to pytest.
# One pytest-xdist worker per core: the Triton interpreter tests are CPU-bound and most of the Ray tests wait on
# their cluster, so two cores run the suite in about half the time of one. The modules that start a Ray cluster
# share one xdist group (one worker, one after another). The slowest tests are listed at the end, so a test that
# grew shows up in CI's log.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests/ -n auto --dist loadgroup --durations=25 "$@"
