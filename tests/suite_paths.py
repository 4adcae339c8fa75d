"""Where the test suite lives, for processes it starts.

The tests are grouped in folders (``record/``, ``exporters/``...), and a test module may import a
sibling group's module by name. A worker process (a subprocess, a Ray worker) sees none of
pytest's ``sys.path`` changes, so whoever starts one gives it ``TEST_PATHS`` on its PYTHONPATH.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GROUPS = [p for p in sorted(TESTS.iterdir()) if p.is_dir() and p.name.isidentifier() and not p.name.startswith("_")]
# the top of tests/, every group folder, then the repository
TEST_PATHS = os.pathsep.join(str(p) for p in [TESTS, *GROUPS, REPO])


def with_test_paths(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the suite's folders ahead of its own PYTHONPATH."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [TEST_PATHS, env.get("PYTHONPATH")]))}
