"""Read the junit file a pytest run wrote: fail when no test ran, print the time per test folder.

``.ci/run`` calls it after ``python -m pytest -q tests`` (``python tests/junit_report.py
.ci-reports/junit.xml``). pytest's own ``--durations`` gives the slowest tests; this adds where the
suite's time goes by folder (``record``, ``sampling``... and ``(top)`` for the cross-cutting files)
and the share each takes, so a slow folder is seen before it doubles.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def folder_of(classname: str) -> str:
    # "tests.adapters.test_real_trl.TestX" -> "adapters"; "tests.test_exits" -> "(top)"
    parts = classname.split(".")
    if parts and parts[0] == "tests":
        parts = parts[1:]
    return parts[0] if len(parts) > 1 and not parts[0].startswith("test_") else "(top)"


def main(path: str) -> int:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    ran = tests - skipped
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in root.iter("testcase"):
        name = folder_of(case.get("classname", ""))
        seconds[name] += float(case.get("time", 0) or 0)
        counts[name] += 1
    total = sum(seconds.values()) or 1.0
    print("\ntime per test folder (s, share of test time):")
    for name, secs in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<12} {secs:8.1f}  {100 * secs / total:5.1f}%  {counts[name]:5d} tests")
    print(f"  {'all':<12} {total:8.1f}")
    print(f"junit: {tests} tests, {skipped} skipped, {ran} ran")
    if ran <= 0:
        print("CI failure: no test actually ran (nothing collected, or everything skipped)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/junit_report.py JUNIT_XML")
    sys.exit(main(sys.argv[1]))
