"""diloco: DiLoCo training on whatever GPUs you can rent.

From Python: `diloco.launch(spec)` returns a `diloco.Run`; `diloco.attach(run_id)` finds one from
any process (see `diloco.api`).

Importing this package loads no plugin, no torch and no cloud SDK, and almost nothing else:
every replica imports it on start, so names are resolved lazily (PEP 562). Backends are
discovered on first use (`diloco.plugins.discovery.backends()`).
"""

from __future__ import annotations

from .lazyexports import lazy_exports

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

__getattr__ = lazy_exports(__name__, _EXPORTS)
