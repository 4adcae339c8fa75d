"""The frameworks' second tested releases: one virtual environment each, under ``.venv-matrix/``.

The main environment holds each framework's newest release (``.ci/run``'s ``FRAMEWORKS``); the
entries here add the other release a user meets (what a plain ``pip install`` resolves, or the
previous release when that is the newest), so every adapter is tested on two releases.

* an ``overlay`` environment is ``python3 -m venv --system-site-packages`` with just the other
  release installed ``--no-deps`` on top: it sees the main environment's torch, transformers and
  the editable otel_rollouts, and shadows only the framework itself (seconds to build);
* a ``full`` environment is built by ``.ci/run`` on another Python (SkyRL 0.4.0 needs 3.12).

``.ci/run`` builds them (``python3 tests/version_matrix.py overlays`` lists the overlay specs) and
``tests/adapters/test_version_matrix.py`` runs each entry's real-framework tests inside its environment.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX_DIR = ROOT / ".venv-matrix"


@dataclass(frozen=True)
class Entry:
    distribution: str  # the package's distribution name on the registry
    version: str  # the release this environment holds
    tests: tuple[str, ...]  # test files (relative to the repository root) run inside it
    kind: str = "overlay"  # overlay | full

    @property
    def name(self) -> str:
        return f"{self.distribution}-{self.version}" + ("-py312" if self.kind == "full" else "")

    @property
    def python(self) -> Path:
        return MATRIX_DIR / self.name / "bin" / "python"


MATRIX: tuple[Entry, ...] = (
    Entry("verl", "0.9.0", ("tests/adapters/test_real_verl.py", "tests/adapters/test_real_verl_reward_loop.py",
                           "tests/adapters/test_real_verl_v1.py")),
    Entry("tinker-cookbook", "0.5.8", ("tests/adapters/test_real_tinker.py", "tests/adapters/test_real_tinker_kinds.py")),
    Entry("trl", "1.15.0", ("tests/adapters/test_real_trl.py",)),
    # SkyRL 0.4.0 needs Python >= 3.12: a full environment on pyenv's 3.12 (.ci/run's
    # setup_skyrl_py312); the main environment holds 0.3.0, what pip on 3.11 resolves.
    Entry("skyrl", "0.4.0", ("tests/adapters/test_real_skyrl.py",), kind="full"),
)


if __name__ == "__main__":
    if sys.argv[1:] == ["overlays"]:
        for entry in MATRIX:
            if entry.kind == "overlay":
                print(entry.name, f"{entry.distribution}=={entry.version}")
    else:
        sys.exit("usage: python3 tests/version_matrix.py overlays")
