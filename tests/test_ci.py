""".ci/run and scripts/test.sh: a pytest run in which no test ran (all skipped, or none collected) fails CI; the
suite's xdist groups hold."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

def test_passes():
    pass

@pytest.mark.skip(reason="skipped on purpose")
def test_skipped():
    pass

def test_skips_itself():
    pytest.skip("skipped on purpose")
'''


def checker():
    spec = importlib.util.spec_from_file_location("ran_tests", REPO / ".ci" / "ran_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def junit_report(tmp_path: Path, *selection: str) -> tuple[int, str]:
    (tmp_path / "test_sample.py").write_text(TESTS)
    report = tmp_path / "report.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_sample.py", f"--junitxml={report}", *selection],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return proc.returncode, str(report)


@pytest.mark.parametrize("selection, pytest_status, ran", [
    ((), 0, 1),  # one passed, two skipped
    (("-k", "skip"), 0, 0),  # every collected test skipped: pytest says 0, CI must not
    (("-k", "no_such_test"), 5, 0),  # nothing collected: pytest's own exit 5
])
def test_ci_fails_when_no_test_ran(tmp_path, selection, pytest_status, ran):
    status, report = junit_report(tmp_path, *selection)
    assert status == pytest_status
    ran_tests = checker()
    assert ran_tests.tests_run(report) == ran
    assert ran_tests.main([report]) == (0 if ran else 1)


@pytest.mark.parametrize("body, ok", [
    ("def test_a():\n    pass\n", True),
    ("import pytest\n\ndef test_a():\n    pytest.skip('skipped on purpose')\n", False),  # pytest exits 0 here
    ("def test_a():\n    assert False\n", False),
])
def test_ci_run_script_end_to_end(tmp_path, body, ok):
    """.ci/run itself, in a copy of the repo layout whose scripts/test.sh runs one sample test file (the real
    one runs the whole suite); the README names scripts/test.sh as its test command."""
    assert "./scripts/test.sh       # set up, then run the test suite" in (REPO / "README.md").read_text()
    (tmp_path / ".ci").mkdir()
    for name in ("run", "ran_tests.py"):
        (tmp_path / ".ci" / name).write_text((REPO / ".ci" / name).read_text())
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text(
        f'#!/usr/bin/env bash\nset -euo pipefail\nexec "{sys.executable}" -m pytest -q -p no:cacheprovider '
        'test_sample.py "$@"\n')
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "test_sample.py").write_text(body)
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd="/", capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    if body.startswith("import pytest"):
        assert "CI: no test ran" in proc.stderr


GROUPED = '''
import os
import time

import pytest

pytestmark = pytest.mark.xdist_group("ray")


@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    time.sleep(0.2)
    with open("workers.txt", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
'''

FREE = '''
import time

import pytest


@pytest.mark.parametrize("i", range(4))
def test_free(i):
    time.sleep(0.2)
'''

# Test modules that start a Ray cluster (a local one, `ray start`, or a job or sweep that starts one).
STARTS_RAY = ("ray.init(", "init_ray(", '"start", "--head"', "run_pretraining(", "run_sweep(")


def test_modules_that_start_ray_share_one_xdist_group_and_the_group_holds(tmp_path):
    """scripts/test.sh runs the suite on pytest-xdist workers with --dist loadgroup; two Ray clusters at once would
    share two cores, and one module split over two workers runs its module fixtures (a sweep, prepared data)
    twice. So every module that starts Ray carries xdist_group("ray"), and with the installed pytest and
    pytest-xdist a group really runs on one worker (pytest 9.2 made xdist 3.8 ignore groups without a word)."""
    assert "-n auto --dist loadgroup" in (REPO / "scripts" / "test.sh").read_text()
    starting = [p for p in sorted((REPO / "tests").glob("test_*.py"))
                if p.name != "test_ci.py" and any(s in p.read_text() for s in STARTS_RAY)]
    assert len(starting) >= 5, starting
    for path in starting:
        assert 'pytest.mark.xdist_group("ray")' in path.read_text(), f"{path.name} starts Ray outside the group"

    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_free.py").write_text(FREE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "test_grouped.py", "test_free.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 4 and len(set(workers)) == 1, workers
