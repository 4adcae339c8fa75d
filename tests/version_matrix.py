"""The frameworks' second tested releases: one virtual environment each, under ``.venv-matrix/``.

The main environment holds each framework's newest release (``.ci/run``'s ``FRAMEWORKS``); the
entries here add the other release a user meets (what a plain ``pip install`` resolves, or the
previous release when that is the newest), so every adapter is tested on two releases.

Each is an *overlay*: a virtual environment whose own site-packages hold just the other release,
installed ``--no-deps``, followed by the main environment's (a ``.pth`` file adds ``.venv``'s
site-packages after its own). It sees the main environment's torch, transformers and the editable
otel_rollouts and shadows only the framework itself: seconds to build, a few MB on disk.

SkyRL 0.4.0 declares ``Requires-Python >=3.12``. A 3.12 environment would need the registry's
CUDA build of torch (4.7 GB, 4-16 minutes to install: no CPU build of torch 2.13.0 for cp312 is
reachable here). Its code parses on 3.11 (no 3.12-only syntax or standard-library name in its 343
modules) and runs there but for one thing: pydantic refuses a ``typing.TypedDict`` before 3.12 and
asks for ``typing_extensions.TypedDict``, the same class 3.12's ``typing`` has. So its overlay
installs it with ``--ignore-requires-python`` on the main 3.11 interpreter, with that one alias
set at start-up (``COMPAT``): SkyRL 0.4.0's own code and objects, on an interpreter it does not
declare, which is what the matrix checks (our adapter against that release's objects).

``.ci/run`` builds them (``python tests/version_matrix.py build``, run by the test environment's
Python, reusing an overlay that already holds its release) and ``tests/adapters/test_version_matrix.py`` runs, inside each, the tests of its files marked
``@pytest.mark.matrix`` (what depends on the release: entry points, field names, the shapes of
the framework's objects); the rest of those files runs once, in the main environment.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX_DIR = ROOT / ".venv-matrix"


@dataclass(frozen=True)
class Entry:
    distribution: str  # the package's distribution name on the registry
    version: str  # the release this environment holds
    tests: tuple[str, ...]  # test files (relative to the repository root) whose `matrix` tests run inside it
    pip_flags: tuple[str, ...] = ()  # extra options for its `pip install --no-deps`
    compat: str = ""  # a line of Python run at the environment's start-up (a .pth file)

    @property
    def name(self) -> str:
        return f"{self.distribution}-{self.version}"

    @property
    def python(self) -> Path:
        return MATRIX_DIR / self.name / "bin" / "python"


MATRIX: tuple[Entry, ...] = (
    Entry("verl", "0.9.0", ("tests/adapters/test_real_verl.py", "tests/adapters/test_real_verl_reward_loop.py",
                           "tests/adapters/test_real_verl_v1.py")),
    Entry("tinker-cookbook", "0.5.8", ("tests/adapters/test_real_tinker.py", "tests/adapters/test_real_tinker_kinds.py")),
    Entry("trl", "1.15.0", ("tests/adapters/test_real_trl.py",)),
    # SkyRL 0.4.0 declares Python >= 3.12 (see above); the main environment holds 0.3.0, what pip
    # on 3.11 resolves.
    Entry("skyrl", "0.4.0", ("tests/adapters/test_real_skyrl.py",), pip_flags=("--ignore-requires-python",),
          compat="import typing, typing_extensions; typing.TypedDict = typing_extensions.TypedDict"),
)


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _holds(entry: Entry) -> bool:
    check = (f"import importlib.metadata as m, sys; "
             f"sys.exit(m.version({entry.distribution!r}) != {entry.version!r})")
    return entry.python.exists() and subprocess.run([str(entry.python), "-c", check],
                                                    capture_output=True).returncode == 0


def build(entry: Entry) -> None:
    """The overlay over the running interpreter's environment (``.ci/run`` runs this with
    ``.venv``'s Python): its own site-packages first, then ours."""
    if _holds(entry):
        print(f"reusing .venv-matrix/{entry.name}", flush=True)
        return
    print(f"building .venv-matrix/{entry.name}", flush=True)
    directory = MATRIX_DIR / entry.name
    venv.EnvBuilder(clear=True, with_pip=False).create(directory)
    site = _site_packages(entry.python)
    main_site = sysconfig.get_paths()["purelib"]
    (site / "_otr_main_env.pth").write_text(f"import site; site.addsitedir({main_site!r})\n")
    if entry.compat:
        (site / "_otr_compat.pth").write_text(entry.compat + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    *entry.pip_flags, f"{entry.distribution}=={entry.version}"], check=True)
    if not _holds(entry):
        sys.exit(f".venv-matrix/{entry.name} does not hold {entry.distribution} {entry.version}")


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        for entry in MATRIX:
            build(entry)
    else:
        sys.exit("usage: python tests/version_matrix.py build")
