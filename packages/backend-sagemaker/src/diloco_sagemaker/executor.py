"""SageMakerExecutor: each replica attempt is one SageMaker training job (InstanceCount 1).

Launch is `create_training_job` per replica (see `request` for the topology and the request,
`source` for how the code travels, `bootstrap` for what the container runs first, `status` for
how a job's statuses read). Handles hold the job name and region only, so `diloco status /
logs / cancel / resume` reattach from any shell. Logs come from CloudWatch Logs
(/aws/sagemaker/TrainingJobs, one stream per instance start: `<job>/algo-1-<epoch>`).

Secrets never go into the job's Environment (anyone allowed to describe the job can read it):
forwarded `secrets` are stored in AWS Secrets Manager as one secret per run
(`diloco/<run id>`, tagged with the run), `[backend] secret_refs` name secrets you already
have, and the bootstrap resolves both inside the container with the execution role.

boto3 is imported on first use, never at import (`diloco backends` stays fast).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from diloco.errors import BackendError, UserError
from diloco.failures import cause_from_log
from diloco.launchenv import check_ranks, is_secret_name, parse_entrypoint, redact_env, replica_env
from diloco.protocol import LaunchPlan, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.state import new_run_id
from diloco.waiting import poll_until_terminal, unless_failed

from . import request as rq
from . import source
from . import status as st
from .instances import instance_type

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
SECRET_PREFIX = "diloco/"


def console_url(region: str, job: str) -> str:
    return f"https://{region}.console.aws.amazon.com/sagemaker/home?region={region}#/jobs/{job}"


def _boto3():
    try:
        import boto3
    except ImportError:  # pragma: no cover - boto3 is a dependency of this package
        raise UserError("the sagemaker backend needs boto3: pip install diloco-backend-sagemaker") from None
    return boto3


class SageMakerExecutor:
    """One SageMaker training job per replica and attempt (see the README for the request).

    Args:
        workdir: the directory uploaded as the job's source (the spec's directory by default).
        role: the execution role ARN the jobs run as; required.
        region: AWS region (default: AWS_REGION or the profile's).
        image: an ECR image holding diloco-replica (packages/replica/Dockerfile); or use pytorch_version.
        pytorch_version: the official SageMaker PyTorch image of this version (the `images` extra).
        py_version: Python of that image, e.g. "py311".
        pip: extra pip requirements installed when the job starts.
        instance_type: overrides the instance type the spec's `gpu` picks.
        volume_size_gb: the instance's EBS volume in GB.
        spot: managed spot training.
        max_wait: seconds a spot job may wait and run in all (default: timeout + 1 h).
        keep_alive: warm pool seconds (0-3600), so a relaunched replica skips provisioning; not with spot.
        subnets: VPC subnets (with security_groups).
        security_groups: VPC security groups (with subnets).
        s3_prefix: where source and outputs go (default: s3://<rendezvous bucket>/diloco-sagemaker).
        output_path: the jobs' S3OutputPath (default: <s3_prefix>/<run>/output).
        include_workdir: upload workdir as the job's source.
        tags: extra tags on every job.
        secret_refs: {ENV_NAME = Secrets Manager ARN} resolved in the container, never in the request.
    """

    backend_name = "sagemaker"
    supports_inter_replica_network = False
    supports_rank_relaunch = True
    shares_launcher_filesystem = False  # instances have their own disks: the rendezvous must be an object store

    def __init__(self, *, workdir: str | None = None, role: str | None = None, region: str | None = None,
                 image: str | None = None, pytorch_version: str | None = None, py_version: str | None = None,
                 pip: list[str] | None = None, instance_type: str | None = None, volume_size_gb: int = 100,
                 spot: bool = False, max_wait: int | None = None, keep_alive: int = 0,
                 subnets: list[str] | None = None, security_groups: list[str] | None = None,
                 s3_prefix: str | None = None, output_path: str | None = None, include_workdir: bool = True,
                 tags: dict[str, str] | None = None, secret_refs: dict[str, str] | None = None):
        self.workdir = workdir
        self.opts = rq.JobOptions(
            role=role, region=region, image=image, pytorch_version=pytorch_version, py_version=py_version,
            pip=list(pip or []), instance_type=instance_type, volume_size_gb=volume_size_gb, spot=spot,
            max_wait=max_wait, keep_alive=keep_alive, subnets=list(subnets or []),
            security_groups=list(security_groups or []), s3_prefix=s3_prefix, output_path=output_path,
            include_workdir=include_workdir, tags=dict(tags or {}), secret_refs=dict(secret_refs or {}))
        self.opts.check()
        self._clients: dict[tuple[str, str], Any] = {}

    # -- talking to AWS ------------------------------------------------------------------------

    def region(self) -> str:
        if self.opts.region:
            return self.opts.region
        import os

        found = os.environ.get("AWS_REGION") or _boto3().session.Session().region_name  # boto3 reads only AWS_DEFAULT_REGION
        if not found:
            raise UserError("no AWS region: set [backend] region = \"us-east-1\" (or AWS_REGION in this shell)")
        return found

    def _client(self, service: str, region: str | None = None) -> Any:
        region = region or self.region()
        key = (service, region)
        if key not in self._clients:
            from botocore.config import Config

            self._clients[key] = _boto3().session.Session().client(
                service, region_name=region, config=Config(retries={"mode": "standard", "max_attempts": 8}))
        return self._clients[key]

    def _call(self, what: str, fn, *args, **kwargs):
        """One AWS call, with AWS's errors turned into one line that names what failed and the fix."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

        try:
            return fn(*args, **kwargs)
        except NoCredentialsError:
            raise UserError("no AWS credentials found: run `aws configure` or `aws sso login`, or set AWS_PROFILE "
                            "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) in this shell") from None
        except NoRegionError:
            raise UserError("no AWS region: set [backend] region (or AWS_REGION in this shell)") from None
        except ClientError as exc:
            raise self._client_error(what, exc) from None
        except BotoCoreError as exc:
            raise BackendError(f"AWS call failed ({what}): {exc}") from None

    def _client_error(self, what: str, exc: Any) -> Exception:
        err = exc.response.get("Error", {})
        code, message = err.get("Code", ""), err.get("Message", str(exc))
        action = f"{exc.operation_name}"
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            return UserError(f"AWS denied {action} ({what}): {message}; allow it for the identity running diloco")
        if code in ("ExpiredToken", "ExpiredTokenException", "UnrecognizedClientException",
                    "InvalidClientTokenId", "InvalidSignatureException"):
            return UserError(f"AWS rejected this shell's credentials ({code}) on {action}: refresh them "
                             f"(`aws sso login`, or new keys)")
        if code == "ValidationException" and "assume" in message.lower():
            return UserError(f"SageMaker cannot assume role {self.opts.role}: its trust policy must allow "
                             f"sagemaker.amazonaws.com, and the identity running diloco needs iam:PassRole on it "
                             f"({message})")
        if code == "ResourceLimitExceeded":
            import re

            found = re.search(r"ml\.[a-z0-9-]+\.[a-z0-9-]+", f"{message} {what}")
            instance = found.group(0) if found else "the instance type"
            usage = "spot training job usage" if self.opts.spot else "training job usage"
            return UserError(f"SageMaker quota reached for {instance}: {message} Request more in Service Quotas "
                             f"('{instance} for {usage}'), or choose another instance type")
        if code in ("ValidationException", "ResourceInUse"):
            return UserError(f"SageMaker rejected {action} ({what}): {message}")
        return BackendError(f"AWS {action} failed ({what}): {code}: {message}")

    def _describe(self, md: dict[str, Any]) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        sm = self._client("sagemaker", md.get("region"))
        try:
            return sm.describe_training_job(TrainingJobName=md["job"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound") \
                    and "not found" in str(exc).lower():
                return None
            raise self._client_error(f"describe {md['job']}", exc) from None

    # -- planning ------------------------------------------------------------------------------

    def _plan(self, n_replicas, entrypoint, entrypoint_args, *, gpu, timeout, run_id, rendezvous, ranks, attempt,
              env, secret_env, processes) -> tuple[str, dict[str, Any], dict[str, str]]:
        """(run id, the plan as data with no secret value in it, the secret values to store)."""
        ep = parse_entrypoint(entrypoint)
        run_id = run_id or new_run_id("sagemaker")
        chosen = check_ranks(n_replicas, ranks)
        region = self.region()
        instance = instance_type(gpu, self.opts.instance_type)
        image = rq.resolve_image(self.opts, region, instance)
        code = rq.code_uri(self.opts, rendezvous, run_id)
        output = self.opts.output_path or f"{rq.default_prefix(self.opts, rendezvous)}/{run_id}/output"
        secrets = dict(secret_env or {})
        secrets.update({k: v for k, v in (env or {}).items() if is_secret_name(k)})
        refs = {**{k: f"{SECRET_PREFIX}{run_id}#{k}" for k in sorted(secrets)}, **self.opts.secret_refs}
        jobs = []
        for r in chosen:
            e = replica_env(rank=r, n_replicas=n_replicas, run_id=run_id, attempt=attempt, entrypoint=ep,
                            entrypoint_args=dict(entrypoint_args or {}), rendezvous=rendezvous, timeout=timeout,
                            env={k: v for k, v in (env or {}).items() if k not in secrets}, processes=processes)
            e.pop("PYTHONPATH", None)  # the bootstrap puts the unpacked workdir there
            e.setdefault("AWS_REGION", region)
            e.setdefault("AWS_DEFAULT_REGION", region)
            e.update(rq.bootstrap_env(refs, rq.pip_packages(self.opts)))
            jobs.append(rq.training_job_request(
                self.opts, name=rq.job_name(run_id, r, attempt), region=region, image=image, instance=instance,
                env=redact_env(e), processes=processes, timeout=timeout, code=code, output=output,
                tags={rq.RUN_TAG: run_id, rq.RANK_TAG: str(r), rq.ATTEMPT_TAG: str(attempt)}))
        plan = {"region": region, "code": {"s3_uri": code, "workdir": self.workdir if self._ships_workdir() else None},
                "secrets_manager": {"secret": f"{SECRET_PREFIX}{run_id}" if secrets else None,
                                    "forwarded": sorted(secrets), "references": dict(self.opts.secret_refs)},
                "jobs": jobs}
        return run_id, plan, secrets

    def _ships_workdir(self) -> bool:
        return bool(self.opts.include_workdir and self.workdir)

    def dryrun(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600, run_id=None,
               rendezvous=None, ranks=None, attempt=0, env=None, secret_env=None,
               processes_per_replica=1) -> LaunchPlan:
        _, plan, _ = self._plan(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout, run_id=run_id,
                                rendezvous=rendezvous, ranks=ranks, attempt=attempt, env=env,
                                secret_env=secret_env, processes=processes_per_replica)
        return LaunchPlan(self.backend_name, plan, format="json")

    # -- launching -----------------------------------------------------------------------------

    def launch_replicas(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600,
                        run_id=None, rendezvous=None, ranks=None, attempt=0, env=None, secret_env=None,
                        processes_per_replica=1) -> list[ReplicaHandle]:
        if not self.opts.role:
            raise UserError("[backend] role is needed: the ARN of a SageMaker execution role "
                            "(arn:aws:iam::<account>:role/<name>) that can read and write the rendezvous bucket")
        run_id, plan, secrets = self._plan(
            n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout, run_id=run_id, rendezvous=rendezvous,
            ranks=ranks, attempt=attempt, env=env, secret_env=secret_env, processes=processes_per_replica)
        region = plan["region"]
        self._call(f"upload the code to {plan['code']['s3_uri']}", source.upload_code, self._client("s3", region),
                   plan["code"]["s3_uri"], self.workdir if self._ships_workdir() else None)
        if secrets:
            self._store_secrets(plan["secrets_manager"]["secret"], secrets, run_id, region)
        sm = self._client("sagemaker", region)
        handles: list[ReplicaHandle] = []
        for job in plan["jobs"]:
            rank = int(next(t["Value"] for t in job["Tags"] if t["Key"] == rq.RANK_TAG))
            try:
                self._call(f"create {job['TrainingJobName']} on {job['ResourceConfig']['InstanceType']}",
                           sm.create_training_job, **job)
            except (UserError, BackendError) as exc:
                for h in handles:
                    self.cancel(h)
                started = f"; the {len(handles)} job(s) already started were stopped" if handles else ""
                raise type(exc)(f"launching rank {rank} on SageMaker failed: {exc}{started}") from None
            name = job["TrainingJobName"]
            handles.append(ReplicaHandle(rank, self.backend_name, {
                "run_id": run_id, "attempt": attempt, "job": name, "region": region,
                "url": console_url(region, name)}))
        return handles

    def _store_secrets(self, name: str, values: dict[str, str], run_id: str, region: str) -> None:
        """One Secrets Manager secret per run holding the forwarded values (updated on relaunch)."""
        from botocore.exceptions import ClientError

        sm = self._client("secretsmanager", region)
        body = json.dumps(values, sort_keys=True)
        try:
            sm.create_secret(Name=name, SecretString=body, Tags=[{"Key": rq.RUN_TAG, "Value": run_id}],
                             Description=f"diloco run {run_id}: secrets forwarded from the launcher's shell")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ResourceExistsException":
                raise self._client_error(f"store the run's secrets as {name}", exc) from None
            self._call(f"update the run's secrets in {name}", sm.put_secret_value, SecretId=name, SecretString=body)

    # -- observing -----------------------------------------------------------------------------

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        job = self._describe(dict(handle.metadata))
        return ReplicaStatus.FAILED if job is None else st.replica_status(job)

    def status_detail(self, handle: ReplicaHandle) -> str | None:
        """Why the replica is waiting (a spot interruption SageMaker is retrying, …), for events."""
        job = self._describe(dict(handle.metadata))
        return st.detail(job) if job else None

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        from botocore.exceptions import ClientError

        md = dict(handle.metadata)
        logs = self._client("logs", md.get("region"))
        try:
            streams = self._call(f"list the log streams of {md['job']}", logs.describe_log_streams,
                                 logGroupName=LOG_GROUP, logStreamNamePrefix=f"{md['job']}/")["logStreams"]
        except UserError:
            raise
        except BackendError as exc:
            if "ResourceNotFoundException" not in str(exc):
                raise
            streams = []
        lines: list[str] = []
        for stream in sorted(streams, key=lambda s: (s.get("creationTime", 0), s["logStreamName"])):
            try:
                events = logs.get_log_events(logGroupName=LOG_GROUP, logStreamName=stream["logStreamName"],
                                             startFromHead=False, limit=max(1, min(n_lines, 10000)))["events"]
            except ClientError as exc:
                raise self._client_error(f"read {stream['logStreamName']}", exc) from None
            for e in events:
                lines.extend(e["message"].rstrip("\n").split("\n"))
        lines = lines[-n_lines:]
        if not lines:
            job = self._describe(md)
            where = st.detail(job) if job else "no such job"
            return (f"(no output yet from {md['job']}: {where or 'starting'}; CloudWatch Logs {LOG_GROUP}, "
                    f"stream {md['job']}/algo-1-…)\n")
        return "\n".join(lines) + "\n"

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        statuses = poll_until_terminal(self, handles, timeout=timeout, interval=1.0)
        return [self._result(h, s) for h, s in zip(handles, statuses)]

    def _result(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        done = unless_failed(handle, status, lambda n: self.stream_logs(handle, n_lines=n))
        if done is not None:
            return done
        md = dict(handle.metadata)
        job = self._describe(md) or {"TrainingJobName": md["job"], "FailureReason": "the training job is gone"}
        tail = self.stream_logs(handle, n_lines=20).strip()
        code = st.exit_code(job)
        first = cause_from_log(tail) or st.failure_cause(job)
        error = f"{first}\n{md.get('url', '')}\n{tail}".rstrip()
        return ReplicaResult(handle.rank, status, code if code is not None else 1, error, None, handle.attempt)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """StopTrainingJob; a job that already ended keeps its status, other errors surface."""
        from botocore.exceptions import ClientError

        md = dict(handle.metadata)
        job = self._describe(md)
        if job is None or job.get("TrainingJobStatus") in ("Completed", "Failed", "Stopped", "Stopping"):
            return
        try:
            self._client("sagemaker", md.get("region")).stop_training_job(TrainingJobName=md["job"])
        except ClientError as exc:
            err = exc.response.get("Error", {})
            if err.get("Code") == "ValidationException" and ("already" in err.get("Message", "").lower()
                                                             or "status" in err.get("Message", "").lower()):
                return  # it ended between the describe and the stop
            raise self._client_error(f"stop {md['job']}", exc) from None
