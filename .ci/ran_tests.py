"""Exit non-zero unless the pytest JUnit report REPORT shows at least one test that really ran.

    python .ci/ran_tests.py REPORT.xml

pytest itself exits 5 when it collects nothing, but 0 when every collected test was skipped: this closes that hole.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def tests_run(report: str) -> int:
    """Test cases that ran (passed, failed or errored), i.e. collected minus skipped."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    return sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: ran_tests.py REPORT.xml", file=sys.stderr)
        return 2
    ran = tests_run(argv[0])
    if ran <= 0:
        print(f"CI: no test ran (report {argv[0]}: every collected test was skipped, or none was collected)",
              file=sys.stderr)
        return 1
    return 0  # silent: pytest's own summary stays the last line of the run


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
