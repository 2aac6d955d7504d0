"""Names a package resolves on first use (PEP 562), so importing the package imports nothing else.

Every replica imports `diloco` on start, and a replica importing `diloco.local.warmstart` must not
load the local executor: each package's `__init__` declares which module each public name lives
in, and `lazy_exports` gives it the module-level `__getattr__` that imports the module when the
name is first read and keeps the value in the package from then on.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: `where` maps each public name to its module, relative
    to the package."""

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
