"""The built-in plugin: registers the local backend and the TensorBoard sink through the same hooks
as any other plugin."""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl
def diloco_register_executors() -> list[type]:
    from .executor import LocalProcessExecutor

    return [LocalProcessExecutor]


@hookimpl
def diloco_register_metric_sinks() -> list[type]:
    from ..plugins.sinks import TensorBoardSink

    return [TensorBoardSink]
