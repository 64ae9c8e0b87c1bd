"""A pytest plugin (``-p tests.unprotected``) that imports some modules from other files.

``UNPROTECTED_MODULES`` is a JSON object of module name to file: those modules are loaded
from those files instead (``tests/test_testing_sample.py`` serves copies of the sample
shop's views and tasks with their protection taken off). Nothing else changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from types import ModuleType

COPIES: dict[str, str] = json.loads(os.environ.get("UNPROTECTED_MODULES", "{}"))


class FromCopies(importlib.abc.MetaPathFinder):
    """Finds the modules of ``COPIES`` in their copies, before any other finder looks."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        copy = COPIES.get(fullname)
        return importlib.util.spec_from_file_location(fullname, copy) if copy else None


if COPIES:
    loaded = sorted(set(COPIES) & set(sys.modules))
    if loaded:
        raise RuntimeError(f"already imported, too late to serve from copies: {loaded}")
    sys.meta_path.insert(0, FromCopies())
