"""AWS for the sagemaker backend's tests: a moto server (S3, CloudWatch Logs, IAM, Secrets Manager
over real HTTP) and the training-job control plane from diloco_sagemaker.testing beside it."""

from __future__ import annotations

import json
import time

import pytest

ROLE = "arn:aws:iam::123456789012:role/diloco-sagemaker"
TRUST = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                 "Principal": {"Service": "sagemaker.amazonaws.com"}}]}


@pytest.fixture
def aws(monkeypatch):
    """moto on 127.0.0.1 with a bucket and a SageMaker execution role; this shell's AWS_* point at it."""
    import boto3

    from diloco.testing.s3server import moto_s3

    with moto_s3(bucket="diloco-sm") as server:
        for k, v in server["env"].items():
            monkeypatch.setenv(k, v)
        iam = boto3.client("iam", endpoint_url=server["env"]["AWS_ENDPOINT_URL"], region_name="us-east-1")
        untrusted = {**TRUST, "Statement": [{**TRUST["Statement"][0], "Principal": {"Service": "ec2.amazonaws.com"}}]}
        for name, trust in (("diloco-sagemaker", TRUST), ("no-trust", untrusted)):
            try:  # moto keeps IAM across servers in one process
                iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
            except iam.exceptions.EntityAlreadyExistsException:
                pass
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
