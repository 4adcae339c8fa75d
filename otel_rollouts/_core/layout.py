"""Where ``otel_rollouts.exporters`` is when the package is imported from its source folder.

The exporters are written in the checkout's top-level ``exporters/`` folder and installed as the
subpackage ``otel_rollouts.exporters`` (pyproject.toml's ``package-dir``; an editable install maps
it with its own import finder). Python started in the checkout, or with the checkout on
``PYTHONPATH``, imports ``otel_rollouts`` from the folder itself, ahead of any regular install, and
that folder has no ``exporters`` inside: the package, which imports its exporters, failed at import.
:func:`map_exporters` gives that case the install's mapping and leaves every other case alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_SUBPACKAGE = "otel_rollouts.exporters"


class ExportersBeside(importlib.abc.MetaPathFinder):
    """Finds ``otel_rollouts.exporters`` in the ``exporters/`` folder beside the package's folder.

    Last on ``sys.meta_path``: an install's own mapping (editable finder, or the subpackage inside
    an installed package) is found first; this answers only when nothing else did."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _SUBPACKAGE:
            return None  # its submodules are found through the subpackage's __path__
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.folder, "__init__.py"), submodule_search_locations=[self.folder]
        )


def map_exporters(package_folder: str) -> None:
    """Add the install's ``exporters`` mapping when ``package_folder`` is a source checkout's.

    Nothing is added when the folder holds the subpackage (a regular install), when no sibling
    ``exporters/`` package exists (not a checkout), or when a finder for it is already in place."""
    if os.path.isdir(os.path.join(package_folder, "exporters")):
        return
    beside = os.path.join(os.path.dirname(os.path.abspath(package_folder)), "exporters")
    if not os.path.isfile(os.path.join(beside, "__init__.py")):
        return
    if any(type(finder).__name__ == ExportersBeside.__name__ for finder in sys.meta_path):
        return  # (the package re-imported, e.g. after a test removed it from sys.modules)
    sys.meta_path.append(ExportersBeside(beside))
