"""Each framework's second tested release: its release-dependent tests (``@pytest.mark.matrix``)
run inside its own environment (``tests/version_matrix.py``; ``.ci/run`` builds them).

A missing environment skips here and fails in CI (where ``.ci/run`` must have built it); the run
passes only if the environment holds exactly the release named, none failed, and most ran (a test
written for the other release only skips).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import xml.etree.ElementTree as ET

import pytest
import tomllib
from receivers import in_ci
from version_matrix import MATRIX, ROOT, Entry


def _child_env() -> dict[str, str]:
    # The parent's PYTEST_ADDOPTS carries CI's --junitxml, and its conftest set TRACKIO_DIR (one
    # temporary store per session): the child gets its own of both.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TRACKIO_", "OTEL_"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.mark.parametrize("entry", MATRIX, ids=lambda e: e.name)
@pytest.mark.slow
def test_release_passes_the_adapter_tests(entry: Entry, tmp_path) -> None:
    if not entry.python.exists():
        message = f"{entry.name}: no environment at .venv-matrix/{entry.name} (.ci/run builds it)"
        if in_ci():
            pytest.fail(f"CI is set, refusing to skip: {message}", pytrace=False)
        pytest.skip(message)
    env = _child_env()
    found = subprocess.run(
        [str(entry.python), "-c",
         f"import importlib.metadata as m; print(m.version({entry.distribution!r}))"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert found.stdout.strip() == entry.version, (entry.name, found.stdout, found.stderr[-2000:])

    junit = tmp_path / "junit.xml"
    env["CI"] = "1"  # inside the environment a missing framework module fails, never skips
    run = subprocess.run(
        [str(entry.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
         "-m", "matrix", *entry.tests],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=840,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"{entry.name}: pytest exited {run.returncode}\n{tail}"
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    # a test written for the other release only skips here (e.g. SkyRL 0.4.0's time splits on
    # 0.3.0); most must run
    assert failed == 0 and total > 0 and total - skipped >= total / 2, (entry.name, total, skipped, failed, tail)


def _installed_by_ci() -> dict[str, str]:
    """distribution → the release the main environment pins (.ci/run's FRAMEWORKS, pyproject)."""
    ci = (ROOT / ".ci" / "run").read_text()
    frameworks = re.search(r"^FRAMEWORKS=\((.*?)\)", ci, re.S | re.M)
    assert frameworks, ".ci/run has no FRAMEWORKS=(...)"
    pins = dict(re.findall(r"([\w.-]+)==([\w.]+)", frameworks.group(1)))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in project.get("optional-dependencies", {}).values():
        for dep in extra:
            if m := re.fullmatch(r"([\w.-]+)==([\w.]+)", dep.strip()):
                pins.setdefault(m.group(1), m.group(2))
    return pins


@pytest.mark.parametrize("adapter,distribution", [
    ("verl", "verl"), ("trl", "trl"), ("skyrl", "skyrl"), ("areal", "areal"), ("tinker", "tinker-cookbook"),
])
def test_each_adapter_names_exactly_the_releases_ci_tests(adapter: str, distribution: str) -> None:
    """An adapter's TESTED releases (what a newer release is warned against) are the main
    environment's pin plus its matrix entries, and the docs' table (docs/adapters/index.md) lists them."""
    tested = importlib.import_module(f"otel_rollouts.adapters.{adapter}").TESTED
    main = _installed_by_ci()[distribution]
    others = [e.version for e in MATRIX if e.distribution == distribution]
    assert sorted(tested) == sorted([main, *others]), (adapter, tested, main, others)
    page = (ROOT / "docs" / "adapters" / "index.md").read_text()
    table = page[page.index("| Framework | Releases tested |"):]
    row = next(line for line in table.splitlines() if line.lower().startswith(f"| {distribution.split('-')[0]}"))
    assert all(v in row for v in tested), (row, tested)
