"""The local backend: replicas as processes on this machine, forked from a warm template where they can be.

`diloco.local.tail_text` is part of the backend API (`diloco.backendapi.NAMES`); it and the
executor are resolved lazily (PEP 562), so a replica importing `diloco.local.warmstart` does not
load the executor.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"LocalProcessExecutor": "executor", "tail_text": "executor"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'diloco.local' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"diloco.local.{module}"), name)
    globals()[name] = value
    return value
