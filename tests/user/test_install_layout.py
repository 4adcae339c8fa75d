"""The package imports from its source folder under any install, not only an editable one.

The exporters are written in the checkout's top-level ``exporters/`` and installed as
``otel_rollouts.exporters``. A user with a regular (non-editable) install who runs a script from
the checkout imports ``otel_rollouts`` from the folder itself, ahead of the install; that failed
at import (``No module named 'otel_rollouts.exporters'``). Here: a real regular install (pip,
``--target``) of a copy of the sources, then Python started the way such a user starts it.
``python -S`` keeps the test environment's own editable finder out, as on the user's machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import otel_rollouts as otr
import otel_rollouts.exporters as exporters
from otel_rollouts.exporters import ConsoleExporter
otr.configure(service_name="layout", exporters=[ConsoleExporter()])
with otr.episode(step=0, group_id="g", sample_index=0) as ep:
    ep.reward(1.0)
otr.end_step(0)
otr.shutdown()
print("package", otr.__file__)
print("exporters", exporters.__file__)
print("finders", [type(f).__name__ for f in sys.meta_path])
"""


@pytest.fixture(scope="module")
def checkout_and_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the checkout's sources, and a regular install of them in a folder of its own."""
    base = tmp_path_factory.mktemp("layout")
    checkout = base / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("otel_rollouts", "exporters"):
        shutil.copytree(ROOT / folder, checkout / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, checkout / name)
    site = base / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(checkout)],
        check=True, capture_output=True, timeout=300,
    )
    assert (site / "otel_rollouts" / "exporters" / "trackio.py").is_file()  # a regular install's layout
    return checkout, site


def _probe(cwd: Path, site: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    env.pop("OTEL_ROLLOUTS_STRICT", None)
    done = subprocess.run(
        [sys.executable, "-S", "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


def test_a_script_run_in_the_checkout_imports_the_package_and_its_exporters_from_the_checkout(
    checkout_and_install: tuple[Path, Path],
) -> None:
    checkout, site = checkout_and_install
    seen = _probe(checkout, site)
    # the checkout shadows the install (the current folder is first on sys.path), both halves of it
    assert Path(seen["package"]).parent == checkout / "otel_rollouts"
    assert Path(seen["exporters"]).parent == checkout / "exporters"


def test_elsewhere_the_regular_install_is_used_as_installed(checkout_and_install: tuple[Path, Path]) -> None:
    checkout, site = checkout_and_install
    elsewhere = checkout.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    seen = _probe(elsewhere, site)
    assert Path(seen["package"]).parent == site / "otel_rollouts"
    assert Path(seen["exporters"]).parent == site / "otel_rollouts" / "exporters"
    assert "ExportersBeside" not in seen["finders"]  # an install's own layout is left alone
