"""The core conformance kit against the sagemaker backend: real boto3 → the training-job control
plane over HTTP, code and logs through a moto server."""

from __future__ import annotations

import pytest

from conftest import ROLE
from diloco.testing import ExecutorConformance
from diloco_sagemaker.executor import SageMakerExecutor


class TestSageMakerConformance(ExecutorConformance):
    wait_timeout = 90.0

    @pytest.fixture(autouse=True)
    def _aws(self, sagemaker):
        self.plane = sagemaker

    def make_executor(self):
        return SageMakerExecutor(role=ROLE, image="123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:test",
                                 s3_prefix="s3://diloco-sm/sagemaker")
