"""Registers the eks backend with diloco (entry point group `diloco`)."""

from __future__ import annotations

from diloco import hookimpl


@hookimpl
def diloco_register_executors() -> list[type]:
    from .executor import EksExecutor  # the kubernetes SDK itself loads on first API call

    return [EksExecutor]
