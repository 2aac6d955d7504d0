"""The built-in plugin: registers the local backend through the same hook as any other."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def diloco_register_executors() -> list[type]:
    from .local import LocalProcessExecutor

    return [LocalProcessExecutor]
