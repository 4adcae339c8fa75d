"""The RL frameworks themselves, for the adapters' real-framework tests.

``.ci/run`` installs verl, TRL, SkyRL (+ skyrl-gym), tinker-cookbook (+ tinker) and AReaL with
``--no-deps`` plus the few packages their data modules import (see ``install_frameworks``
there), never replacing the pinned torch. ``require("verl")`` imports a framework module or
skips the test, except when ``CI`` is set, where it fails so CI cannot pass by skipping.
"""

from __future__ import annotations

import importlib
import sys
import typing
from types import ModuleType

import pytest
from receivers import in_ci


def require(module: str) -> ModuleType:
    """Import ``module`` (a framework or one of its submodules) or skip/fail the test."""
    if module.split(".")[0] in ("skyrl", "skyrl_gym"):
        _typed_dicts_for_pydantic()
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
        message = f"{module} is not importable here ({type(exc).__name__}: {exc}); .ci/run installs it"
        if in_ci():
            pytest.fail(f"CI is set, refusing to skip: {message}", pytrace=False)
        pytest.skip(message)


def _typed_dicts_for_pydantic() -> None:
    """SkyRL's pydantic models use ``typing.TypedDict``, which pydantic refuses on Python < 3.12
    ("use typing_extensions.TypedDict"); on those versions its types need the backport."""
    if sys.version_info < (3, 12) and "skyrl" not in sys.modules:
        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
