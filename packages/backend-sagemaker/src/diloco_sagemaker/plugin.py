"""Registers the sagemaker backend with diloco (entry point group `diloco`)."""

from __future__ import annotations

from diloco import hookimpl


@hookimpl
def diloco_register_executors() -> list[type]:
    from .executor import SageMakerExecutor  # boto3 loads on first use, never here

    return [SageMakerExecutor]
