"""diloco's Modal backend: `backend = "modal"` in a spec, or `ModalExecutor` from Python.

Importing this package does not import modal (the SDK loads on first use), so `diloco backends`
stays fast and works where modal is not configured.
"""

from __future__ import annotations

from .replica import run_replica

__all__ = ["ModalExecutor", "ModalOptions", "replica_image", "run_replica"]


def __getattr__(name: str):
    if name == "ModalExecutor":
        from .executor import ModalExecutor

        return ModalExecutor
    if name == "replica_image":
        from .wheels import replica_image

        return replica_image
    if name == "ModalOptions":
        from .options import ModalOptions

        return ModalOptions
    raise AttributeError(name)
