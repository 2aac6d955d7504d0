"""The local backend: replicas as processes on this machine, forked from a warm template where they can be.

`diloco.local.tail_text` is part of the backend API (`diloco.backendapi.NAMES`); it and the
executor are resolved lazily (PEP 562), so a replica importing `diloco.local.warmstart` does not
load the executor.
"""

from __future__ import annotations

from ..lazyexports import lazy_exports

_EXPORTS = {"LocalProcessExecutor": "executor", "tail_text": "executor"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
