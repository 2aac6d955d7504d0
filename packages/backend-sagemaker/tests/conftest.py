"""AWS for the sagemaker backend's tests: a moto server (S3, CloudWatch Logs, IAM, STS, Secrets
Manager over real HTTP) and the training-job control plane from diloco_sagemaker.testing beside
it; the tests' shell is the launcher's IAM user (the README's policy), every call authorized."""

from __future__ import annotations

import time
from importlib import metadata

import pytest

ROLE = "arn:aws:iam::123456789012:role/diloco-sagemaker"


def installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


# pytorch_version ships wheels of the launcher's diloco-replica: only where it is installed
needs_replica = pytest.mark.skipif(not installed("diloco-replica"),
                                   reason="builds a wheel of diloco-replica, which this environment does not hold")


def pytest_report_header(config):
    """Which model the stand-in held every request to (the installed botocore's, read now)."""
    from diloco_sagemaker.testing import validation

    return f"sagemaker stand-in: requests validated against botocore {validation.botocore_version()}'s model"


@pytest.fixture
def aws(monkeypatch):
    """moto on 127.0.0.1 with a bucket, a SageMaker execution role and a role SageMaker cannot assume;
    this shell's AWS_* point at it."""
    from diloco.testing.s3server import moto_s3
    from diloco_sagemaker.testing import create_execution_role

    with moto_s3(bucket="diloco-sm") as server:
        for k, v in server["env"].items():
            monkeypatch.setenv(k, v)
        assert create_execution_role(server["env"]["AWS_ENDPOINT_URL"]) == ROLE
        create_execution_role(server["env"]["AWS_ENDPOINT_URL"], "no-trust", principal="ec2.amazonaws.com")
        yield server


@pytest.fixture
def sagemaker(tmp_path, aws, monkeypatch):
    from diloco_sagemaker.testing import FakeSageMaker

    with FakeSageMaker(tmp_path / "sagemaker", aws_endpoint=aws["env"]["AWS_ENDPOINT_URL"], grace_seconds=2.0,
                       spot_wait_seconds=1.0, step_seconds=0.1) as plane:
        for k, v in plane.env.items():
            monkeypatch.setenv(k, v)
        yield plane
        deadline = time.monotonic() + 15
        while plane.live_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        leftover = plane.live_processes()
    assert not leftover, f"processes still running on test instances: {leftover}"
