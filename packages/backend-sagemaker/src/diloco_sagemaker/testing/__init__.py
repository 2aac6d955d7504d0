"""A SageMaker training-job control plane for tests, as strict as SageMaker's.

SageMaker's control plane cannot run here, and moto's keeps every training job Completed and
has no StopTrainingJob, so this package serves SageMaker's JSON API over HTTP on 127.0.0.1; the
real boto3 client talks to it through `AWS_ENDPOINT_URL_SAGEMAKER`, while S3, CloudWatch Logs,
IAM, STS and Secrets Manager are a real moto server. What it follows, each from botocore's
service model or AWS's documentation (the backend's README, "Checked against the real
service", lists them with the botocore version):

- every request validated against botocore's own SageMaker model (`validation`, `patterns`) and
  the documented cross-field rules (`rules`), refused with SageMaker's error codes and words
  (`api`); these are the stand-in's own, sharing no code with the launcher's plan-time checks
  (`diloco_sagemaker.servicemodel`, `servicerules`, `javaregex`), so a wrong launcher rule is
  refused here as SageMaker would refuse it, not agreed with;
- the caller's IAM permissions for every call the launcher makes, SageMaker's and the other
  services' (`iam`, `gateway`): a missing action is AccessDeniedException naming it;
- the documented lifecycles (`instance`): Stopping → Stopped, MaxRuntimeExceeded and
  MaxWaitTimeExceeded through Stopping, spot interruptions (Interrupted → Starting), PID 1 alone
  signalled with a grace period of 120 s (shorter in tests) before SIGKILL; a job of several
  instances as one container per instance, each with its own resourceconfig.json, the job failing
  (the others stopped) when one fails (`containers`, which also says how host names reach
  loopback here);
- reads that lag behind CreateTrainingJob (not found for `not_found_seconds`), throttling
  bursts on demand (`FakeSageMaker.throttle`);
- containers whose interpreter holds only what their image declares (`images`).

State lives in files under the root (`jobfiles`), so every process (a second shell, a resumed
launcher) sees the same jobs.
"""

from __future__ import annotations

import json

from .api import ApiError
from .iam import create_launcher_identity
from .jobfiles import ACCOUNT
from .plane import GRACE_SECONDS, LAUNCHER_USER, FakeSageMaker

__all__ = ["ACCOUNT", "GRACE_SECONDS", "LAUNCHER_USER", "ApiError", "FakeSageMaker", "create_execution_role",
           "create_launcher_identity"]


def create_execution_role(aws_endpoint: str, name: str = "diloco-sagemaker",
                          principal: str = "sagemaker.amazonaws.com") -> str:
    """An IAM role on the moto server whose trust policy names `principal` (a role SageMaker can
    assume, or with another principal one it cannot); returns its ARN. Idempotent: moto keeps IAM
    across servers in one process."""
    import boto3

    iam = boto3.client("iam", endpoint_url=aws_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"Service": principal}}]}
    try:
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
    except iam.exceptions.EntityAlreadyExistsException:
        pass
    return f"arn:aws:iam::{ACCOUNT}:role/{name}"
