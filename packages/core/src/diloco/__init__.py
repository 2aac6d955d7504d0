"""diloco: DiLoCo training on whatever GPUs you can rent.

From Python: `diloco.launch(spec)` returns a `diloco.Run`; `diloco.attach(run_id)` finds one from
any process (see `diloco.api`).

Importing this package loads no plugin, no torch and no cloud SDK, and almost nothing else:
every replica imports it on start, so names are resolved lazily (PEP 562). Backends are
discovered on first use (`diloco.plugins.discovery.backends()`).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Run": "api", "attach": "api", "launch": "api", "runs": "api",
    "ReplicaContext": "bootstrap.context",
    "BackendError": "errors", "DilocoError": "errors", "SpecError": "errors", "UserError": "errors",
    "hookimpl": "hookspecs",
    "Capabilities": "protocol", "Executor": "protocol", "ReplicaHandle": "protocol", "ReplicaResult": "protocol",
    "ReplicaStatus": "protocol",
    "LaunchPlan": "request", "LaunchRequest": "request", "Secrets": "request",
    "option": "options",
    "BACKEND_API": "backendapi",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'diloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"diloco.{module}"), name)
    globals()[name] = value
    return value
