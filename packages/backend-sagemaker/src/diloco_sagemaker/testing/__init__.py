"""A SageMaker training-job control plane for tests, shaped exactly like SageMaker's API.

SageMaker's control plane cannot run here, and moto's keeps every training job Completed and
has no StopTrainingJob, so this module serves the training-job subset of SageMaker's JSON API
over HTTP on 127.0.0.1: the real boto3 client talks to it through `AWS_ENDPOINT_URL_SAGEMAKER`
while S3, CloudWatch Logs, IAM and Secrets Manager are a real moto server. It implements
CreateTrainingJob, DescribeTrainingJob, StopTrainingJob and ListTrainingJobs with SageMaker's
error codes and messages (ValidationException for a role that cannot be assumed or a missing
job, ResourceInUse for a duplicate name, ResourceLimitExceeded for a quota, AccessDeniedException
for a denied action).

Each job runs on an *instance*: a detached process (`python -m diloco_sagemaker.testing.instance
JOBDIR`) that does what SageMaker does — moves the job through InProgress (Starting, Downloading,
Training, Uploading) to Completed, Failed (FailureReason from /opt/ml/output/failure) or Stopped;
downloads the input channels from S3 into its /opt/ml/input/data/<channel>/; writes the /opt/ml
config files; runs ContainerEntrypoint + ContainerArguments with the job's Environment and the
role's credentials; ships every output line to CloudWatch Logs (group
/aws/sagemaker/TrainingJobs, stream `<job>/algo-1-<epoch>`); uploads /opt/ml/model to the
output path; enforces MaxRuntimeInSeconds and MaxWaitTimeInSeconds; stops on SIGTERM with a
grace period (StopTrainingJob). `interrupt(job)` is a managed-spot interruption: the container gets SIGTERM, the
job shows InProgress/Interrupted, and after a wait it restarts from Starting on a fresh /opt/ml
with a new log stream, as SageMaker does.

What it cannot be: images are not pulled. The container runs this machine's Python (its bin
directory first on PATH), and /opt/ml is a directory per job: paths under /opt/ml in the
entrypoint and arguments are mapped there, and DILOCO_ML_ROOT tells diloco's bootstrap where.
State lives in files under the root, so every process (a second shell, a resumed launcher) sees
the same jobs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from diloco.testing import process_alive
from diloco.testing.jsonfiles import read_json, write_json  # noqa: F401 (the instance process imports them from here)

ACCOUNT = "123456789012"
GRACE_SECONDS = 5.0
SPOT_WAIT_SECONDS = 3.0
STOP_REQUEST, INTERRUPT_REQUEST = "stop.request", "interrupt.request"  # what the instance process watches for




def pid_alive(pid: int | None) -> bool:
    return bool(pid) and process_alive(pid)


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


class ApiError(Exception):
    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


class FakeSageMaker:
    """The control plane: `with FakeSageMaker(root, aws_endpoint=moto) as sm:` then point boto3 at
    `sm.endpoint` (`sm.env` holds AWS_ENDPOINT_URL_SAGEMAKER)."""

    def __init__(self, root: Path, *, aws_endpoint: str, region: str = "us-east-1",
                 grace_seconds: float = GRACE_SECONDS, spot_wait_seconds: float = SPOT_WAIT_SECONDS,
                 step_seconds: float = 0.2):
        self.root = Path(root)
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)
        self.config = {"aws_endpoint": aws_endpoint, "region": region, "grace_seconds": grace_seconds,
                       "spot_wait_seconds": spot_wait_seconds, "step_seconds": step_seconds,
                       "python_bin": os.path.dirname(sys.executable), "deny": [], "quotas": {}}
        self._save_config()
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()

    # -- test controls -------------------------------------------------------------------------

    def deny(self, action: str) -> None:
        """Make the caller's identity lack sagemaker:<action>."""
        self.config["deny"].append(action)
        self._save_config()

    def quota(self, instance_type: str, instances: int) -> None:
        """The account's 'ml.x for training job usage' quota."""
        self.config["quotas"][instance_type] = instances
        self._save_config()

    def interrupt(self, job: str) -> bool:
        """A managed-spot interruption of `job`'s instance (SageMaker restarts the job itself)."""
        return self._request(job, INTERRUPT_REQUEST)

    def kill(self, job: str, sig: int = signal.SIGKILL) -> bool:
        """The container's processes die of `sig` (an OOM kill, a crash)."""
        deadline = time.monotonic() + 5  # the instance records its container a moment after Training starts
        pid = None
        while not pid_alive(pid) and time.monotonic() < deadline:
            state = read_json(self.root / "jobs" / job / "state.json", {})
            if state.get("TrainingJobStatus") not in (None, "InProgress"):
                return False
            pid = state.get("container_pid")
            time.sleep(0.05)
        if not pid_alive(pid):
            return False
        os.killpg(pid, sig)
        return True

    def job(self, name: str) -> dict[str, Any]:
        return describe(self.root, name)

    def received(self, name: str) -> dict[str, Any] | None:
        """The CreateTrainingJob request for job `name` exactly as the API received it (None: never created)."""
        req = read_json(self.root / "jobs" / name / "request.json")
        return None if req is None else {k: v for k, v in req.items() if k not in ("TrainingJobArn", "CreationTime")}

    def live_processes(self) -> list[int]:
        out = []
        for d in (self.root / "jobs").iterdir():
            out += [p for p in _pids(d) if pid_alive(p)]
        return out

    # -- serving -------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "use FakeSageMaker as a context manager"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_SAGEMAKER": self.endpoint}

    def __enter__(self) -> FakeSageMaker:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                target = self.headers.get("X-Amz-Target", "")
                try:
                    payload = json.loads(body or b"{}")
                    out = plane.handle(target.rpartition(".")[2], payload)
                    status, data = 200, out
                except ApiError as exc:
                    status, data = exc.status, {"__type": exc.code, "message": exc.message}
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(raw)))
                if status != 200:
                    self.send_header("x-amzn-ErrorType", data["__type"])
                self.end_headers()
                self.wfile.write(raw)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for d in (self.root / "jobs").iterdir():
            for pid in _pids(d):
                if pid_alive(pid):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- the API -------------------------------------------------------------------------------

    def handle(self, action: str, req: dict[str, Any]) -> dict[str, Any]:
        self.config = read_json(self.root / "config.json", self.config)
        if action in self.config["deny"]:
            resource = f"arn:aws:sagemaker:{self.config['region']}:{ACCOUNT}:training-job/{req.get('TrainingJobName', '*')}"
            raise ApiError("AccessDeniedException", f"User: arn:aws:iam::{ACCOUNT}:user/diloco-test is not authorized "
                           f"to perform: sagemaker:{action} on resource: {resource} because no identity-based "
                           f"policy allows the sagemaker:{action} action")
        if action == "CreateTrainingJob":
            return self.create(req)
        if action == "DescribeTrainingJob":
            return describe(self.root, req["TrainingJobName"])
        if action == "StopTrainingJob":
            return self.stop(req["TrainingJobName"])
        if action == "ListTrainingJobs":
            names = sorted(p.name for p in (self.root / "jobs").iterdir())
            return {"TrainingJobSummaries": [summary(describe(self.root, n)) for n in names]}
        raise ApiError("UnknownOperationException", f"{action} is not implemented by the test control plane")

    def create(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req["TrainingJobName"]
        arn = f"arn:aws:sagemaker:{self.config['region']}:{ACCOUNT}:training-job/{name.lower()}"
        self._check_role(req["RoleArn"])
        instance = req["ResourceConfig"]["InstanceType"]
        with self._lock:
            jobdir = self.root / "jobs" / name
            if jobdir.exists():
                raise ApiError("ResourceInUse", f"Training job names must be unique within an AWS account and "
                               f"region, and a training job with this name already exists ({arn})")
            limit = self.config["quotas"].get(instance)
            if limit is not None:
                used = sum(1 for d in (self.root / "jobs").iterdir()
                           if read_json(d / "request.json", {}).get("ResourceConfig", {}).get("InstanceType") == instance
                           and describe(self.root, d.name)["TrainingJobStatus"] in ("InProgress", "Stopping"))
                if used + 1 > limit:
                    usage = "spot training job usage" if req.get("EnableManagedSpotTraining") else "training job usage"
                    raise ApiError("ResourceLimitExceeded", f"The account-level service limit '{instance} for "
                                   f"{usage}' is {limit} Instances, with current utilization of {used} Instances "
                                   f"and a request delta of 1 Instances. Please use AWS Service Quotas to request "
                                   f"an increase for this quota.")
            jobdir.mkdir()
            write_json(jobdir / "request.json", {**req, "TrainingJobArn": arn, "CreationTime": time.time()})
            write_json(jobdir / "state.json", {"TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting",
                                              "transitions": [{"Status": "Starting", "StartTime": time.time(),
                                                               "StatusMessage": "Launching requested ML instances"}]})
        proc = subprocess.Popen([sys.executable, "-m", "diloco_sagemaker.testing.instance", str(jobdir),
                                 str(self.root / "config.json")], start_new_session=True,
                                stdout=open(jobdir / "instance.log", "ab"), stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")})
        write_json(jobdir / "instance.pid.json", {"pid": proc.pid})
        return {"TrainingJobArn": arn}

    def stop(self, name: str) -> dict[str, Any]:
        job = describe(self.root, name)
        if job["TrainingJobStatus"] != "InProgress":
            raise ApiError("ValidationException", f"The request was rejected because the training job is in status "
                           f"{job['TrainingJobStatus']}.")
        self._request(name, STOP_REQUEST)
        return {}

    def _request(self, name: str, what: str) -> bool:
        jobdir = self.root / "jobs" / name
        if describe(self.root, name)["TrainingJobStatus"] != "InProgress":
            return False
        (jobdir / what).write_text(str(time.time()))
        return True

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

    def _save_config(self) -> None:
        write_json(self.root / "config.json", self.config)


def _pids(jobdir: Path) -> list[int]:
    """The instance's and the container's process (each leads its own process group)."""
    return [p for p in (read_json(jobdir / "instance.pid.json", {}).get("pid"),
                        read_json(jobdir / "state.json", {}).get("container_pid")) if p]


def describe(root: Path, name: str) -> dict[str, Any]:
    """A DescribeTrainingJob response from the job's files (timestamps as epoch seconds)."""
    jobdir = Path(root) / "jobs" / name
    req = read_json(jobdir / "request.json")
    if req is None:
        raise ApiError("ValidationException", "Requested resource not found.")
    state = read_json(jobdir / "state.json", {})
    out = {k: v for k, v in req.items() if k not in ("Tags",)}
    transitions = state.get("transitions", [])
    for a, b in zip(transitions, transitions[1:]):
        a.setdefault("EndTime", b["StartTime"])
    out.update({"TrainingJobStatus": state.get("TrainingJobStatus", "InProgress"),
                "SecondaryStatus": state.get("SecondaryStatus", "Starting"),
                "SecondaryStatusTransitions": transitions,
                "LastModifiedTime": transitions[-1]["StartTime"] if transitions else req["CreationTime"],
                "ModelArtifacts": {"S3ModelArtifacts": f"{req['OutputDataConfig']['S3OutputPath'].rstrip('/')}/"
                                                       f"{name}/output/model.tar.gz"}})
    for key in ("FailureReason", "TrainingStartTime", "TrainingEndTime", "TrainingTimeInSeconds",
                "BillableTimeInSeconds"):
        if state.get(key) is not None:
            out[key] = state[key]
    return out


def summary(job: dict[str, Any]) -> dict[str, Any]:
    return {k: job[k] for k in ("TrainingJobName", "TrainingJobArn", "CreationTime", "TrainingJobStatus",
                                "SecondaryStatus") if k in job}
