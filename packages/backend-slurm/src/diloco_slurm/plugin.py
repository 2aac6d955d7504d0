"""Registers the slurm backend with diloco (entry point group `diloco`)."""

from __future__ import annotations

from diloco import hookimpl


@hookimpl
def diloco_register_executors() -> list[type]:
    from .executor import SlurmExecutor

    return [SlurmExecutor]
