"""The training-job operations of the test control plane, answering as SageMaker answers.

Every request is checked in SageMaker's order: the caller's IAM permissions (`iam`), then the
request against botocore's service model (`validation`: SerializationException for what cannot
be read, ValidationException "N validation errors detected: …" for broken constraints), then
the documented cross-field rules (`rules`), then the state of the account (the execution role,
unique names, quotas). `validation` and `rules` are the stand-in's own, independent of the
launcher's plan-time checks (`diloco_sagemaker.servicemodel`, `servicerules`): the stand-in must
refuse what SageMaker refuses even where the launcher's checks are wrong. Reads are eventually
consistent: a job is not found for `not_found_seconds` after its creation. Throttling comes in
bursts a test asks for (`throttle`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import patterns, rules, validation
from .jobfiles import ACCOUNT, STOP_REQUEST, describe, job_dir, read_json, summary, visible_after, write_json

ACTIVE = ("InProgress", "Stopping")
OPERATIONS = ("CreateTrainingJob", "DescribeTrainingJob", "StopTrainingJob", "ListTrainingJobs")  # served


class ApiError(Exception):
    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


NOT_FOUND = ("ValidationException", "Requested resource not found.")


class TrainingJobs:
    """CreateTrainingJob, DescribeTrainingJob, StopTrainingJob and ListTrainingJobs over the job files."""

    def __init__(self, root: Path, config: dict[str, Any]):
        self.root = root
        self.config = config
        self._lock = threading.Lock()

    def validate(self, operation: str, req: dict[str, Any]) -> None:
        try:
            found = validation.violations(operation, req)
        except validation.Unreadable as exc:
            raise ApiError("SerializationException", str(exc)) from None
        except patterns.Unreadable as exc:  # the stand-in's gap, never a pass: the test sees a 500
            raise ApiError("InternalFailure", f"the test control plane cannot read the pattern {exc}", 500) from None
        if found:
            raise ApiError("ValidationException", validation.summary(found))
        broken = rules.broken(operation, req)
        if broken:
            raise ApiError("ValidationException", broken[0])

    def handle(self, operation: str, req: dict[str, Any]) -> dict[str, Any]:
        if operation not in OPERATIONS:
            raise ApiError("UnknownOperationException", f"{operation} is not implemented by the test control plane")
        self.validate(operation, req)
        if operation == "CreateTrainingJob":
            return self.create(req)
        if operation == "ListTrainingJobs":
            return self.list(req)
        return (self.describe if operation == "DescribeTrainingJob" else self.stop)(req["TrainingJobName"])

    def visible(self, name: str) -> dict[str, Any]:
        """The job as the API shows it now; not found before it exists and while reads lag."""
        job = describe(self.root, name)
        if job is None or not visible_after(job, self.config["not_found_seconds"]):
            raise ApiError(*NOT_FOUND)
        return job

    def describe(self, name: str) -> dict[str, Any]:
        return self.visible(name)

    def list(self, req: dict[str, Any]) -> dict[str, Any]:
        names = sorted(p.name for p in (self.root / "jobs").iterdir())
        jobs = [j for j in (describe(self.root, n) for n in names)
                if j and visible_after(j, self.config["not_found_seconds"])]
        if req.get("NameContains"):
            jobs = [j for j in jobs if req["NameContains"] in j["TrainingJobName"]]
        if req.get("StatusEquals"):
            jobs = [j for j in jobs if j["TrainingJobStatus"] == req["StatusEquals"]]
        return {"TrainingJobSummaries": [summary(j) for j in jobs]}

    def create(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req["TrainingJobName"]
        arn = f"arn:aws:sagemaker:{self.config['region']}:{ACCOUNT}:training-job/{name.lower()}"
        self._check_role(req["RoleArn"])
        instance = req["ResourceConfig"]["InstanceType"]
        with self._lock:
            jobdir = job_dir(self.root, name)
            if jobdir.exists():
                raise ApiError("ResourceInUse", f"Training job names must be unique within an AWS account and "
                               f"region, and a training job with this name already exists ({arn})")
            self._check_quota(instance, int(req["ResourceConfig"].get("InstanceCount") or 1),
                              bool(req.get("EnableManagedSpotTraining")))
            jobdir.mkdir()
            write_json(jobdir / "request.json", {**req, "TrainingJobArn": arn, "CreationTime": time.time()})
            write_json(jobdir / "state.json", {"TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting",
                                              "transitions": [{"Status": "Starting", "StartTime": time.time(),
                                                               "StatusMessage": "Launching requested ML instances"}]})
        proc = subprocess.Popen([sys.executable, "-m", "diloco_sagemaker.testing.instance", str(jobdir),
                                 str(self.root / "config.json")], start_new_session=True,
                                stdout=open(jobdir / "instance.log", "ab"), stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items()
                                     if not k.startswith(("DILOCO_", "AWS_ENDPOINT_URL_"))})
        write_json(jobdir / "instance.pid.json", {"pid": proc.pid})
        return {"TrainingJobArn": arn}

    def _check_quota(self, instance: str, count: int, spot: bool) -> None:
        """The account's quota counts instances, not jobs: a job of InstanceCount K uses K."""
        limit = self.config["quotas"].get(instance)
        if limit is None:
            return
        used = 0
        for d in (self.root / "jobs").iterdir():
            job = describe(self.root, d.name)
            if job and job["ResourceConfig"]["InstanceType"] == instance and job["TrainingJobStatus"] in ACTIVE:
                used += int(job["ResourceConfig"].get("InstanceCount") or 1)
        if used + count > limit:
            usage = "spot training job usage" if spot else "training job usage"
            raise ApiError("ResourceLimitExceeded", f"The account-level service limit '{instance} for {usage}' is "
                           f"{limit} Instances, with current utilization of {used} Instances and a request delta "
                           f"of {count} Instances. Please use AWS Service Quotas to request an increase for this "
                           f"quota.")

    def stop(self, name: str) -> dict[str, Any]:
        job = self.visible(name)
        if job["TrainingJobStatus"] != "InProgress":
            raise ApiError("ValidationException", f"The request was rejected because the training job is in status "
                           f"{job['TrainingJobStatus']}.")
        (job_dir(self.root, name) / STOP_REQUEST).write_text(str(time.time()))
        return {}

    def _check_role(self, arn: str) -> None:
        """SageMaker assumes the execution role: it must exist in IAM and trust sagemaker.amazonaws.com."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.config["aws_endpoint"], region_name=self.config["region"],
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        name = arn.rsplit("/", 1)[-1]
        try:
            doc = iam.get_role(RoleName=name)["Role"]["AssumeRolePolicyDocument"]
        except iam.exceptions.NoSuchEntityException:
            doc = None
        if doc is None or "sagemaker.amazonaws.com" not in (doc if isinstance(doc, str) else json.dumps(doc)):
            raise ApiError("ValidationException", f"Could not assume role {arn}. Please ensure that the role exists "
                           f"and allows principal 'sagemaker.amazonaws.com' to assume the role.")


def role_credentials(config: dict[str, Any], root: Path, job: str) -> dict[str, Any]:
    """What a container's credentials endpoint answers: the job's execution role, assumed (moto STS)."""
    import boto3

    req = read_json(job_dir(root, job) / "request.json")
    if req is None:
        raise ApiError("NotFound", f"no training job {job}", 404)
    sts = boto3.client("sts", endpoint_url=config["aws_endpoint"], region_name=config["region"],
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    creds = sts.assume_role(RoleArn=req["RoleArn"], RoleSessionName=job[:64])["Credentials"]
    return {"AccessKeyId": creds["AccessKeyId"], "SecretAccessKey": creds["SecretAccessKey"],
            "Token": creds["SessionToken"], "Expiration": creds["Expiration"].strftime("%Y-%m-%dT%H:%M:%SZ"),
            "RoleArn": req["RoleArn"]}
