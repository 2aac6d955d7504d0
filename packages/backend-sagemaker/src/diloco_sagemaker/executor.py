"""SageMakerExecutor: each replica attempt is one SageMaker training job (InstanceCount = its `nodes`).

`plan` builds the CreateTrainingJob requests (`request`: the topology and the requests),
`submit` uploads the code (`source`, run first by `bootstrap` in the container), stores the
secrets and creates exactly the planned jobs. `status` reads a job's statuses, `logs` its
CloudWatch output, `aws` holds the clients and reads AWS's errors. Handles hold the job name,
region and creation time only, so `diloco status / logs / cancel / resume` reattach from any shell.

Reads are eventually consistent and may be throttled, so `poll` never turns a read into an
ending: a job SageMaker does not show yet within `NOT_FOUND_GRACE` seconds of its creation is
pending (a second attempt must never start while the first may live), a throttle or network
error that outlasts botocore's retries answers the status last seen, and Stopping reads as
running unless this executor asked for the stop (a rank reaching its MaxRuntime goes through
Stopping too, and must fail and be relaunched, not cancel the run). A `diloco cancel` from
another shell reaches the launcher through the run record; its jobs then read cancelled once Stopped.

A replica of `nodes = K` is one job of K instances (`capabilities.multi_node`): SageMaker places
them together and ends the job, all instances, when one fails, so the replica fails and is
relaunched as one attempt. Its result is node 0's (`logs.read_result`); a failure's first line is
SageMaker's FailureReason, the failed instance's own cause (the others' logs end in the stop).

Secrets never go into the job's Environment (anyone allowed to describe the job can read it):
forwarded `secrets` are stored in AWS Secrets Manager as one secret per run
(`diloco/<run id>`, tagged with the run), `[backend] secret_refs` name secrets you already
have, and the bootstrap resolves both inside the container with the execution role.

boto3 is imported on first use, never at import (`diloco backends` stays fast).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from diloco.errors import UserError
from diloco.bootstrap.failures import cause_from_log
from diloco.options import options_from
from diloco.protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest
from diloco.submitting import start_each
from diloco.waiting import LastStatus, poll_until_terminal, unless_failed

from . import trainingjob as rq
from . import source
from . import status as st
from .aws import Aws, Transient, console_url, is_not_found, is_transient
from .logs import LOG_GROUP, read_logs, read_result
from .options import SageMakerOptions

__all__ = ["LOG_GROUP", "SageMakerExecutor", "SageMakerOptions", "console_url"]

# How long after CreateTrainingJob a job SageMaker does not show is still taken to exist (its
# reads lag by seconds); past it, the job is gone and the replica failed.
NOT_FOUND_GRACE = 300.0
STOP_PATIENCE = 120.0  # how long cancel keeps asking through throttles and not-yet-visible jobs


class SageMakerExecutor:
    """One SageMaker training job per replica and attempt (see the README for the request).

    The code shipped as the jobs' `diloco` input channel is the request's `workdir` (the spec's
    directory), unless `include_workdir = false` or the request has none.
    """

    backend_name = "sagemaker"
    Options = SageMakerOptions
    # instances have their own disks (the rendezvous must be an object store) and meet only through it;
    # a spot interruption is retried by SageMaker itself, announced to no one. The K instances of one
    # job (a multi-node replica) share SageMaker's network; replicas never do.
    capabilities = Capabilities(shares_launcher_filesystem=False, relaunches_one_rank=True, process_groups=True,
                                multi_node=True, inter_replica_network=False, status_detail=True, cloud="aws")

    def __init__(self, options: SageMakerOptions | None = None, /, **overrides: Any):
        self.options = options_from(type(self), options, overrides)
        self.options.check()
        self.aws = Aws(self.options)
        self._stopped: set[str] = set()  # jobs this executor called StopTrainingJob on
        self._last = LastStatus()  # per job

    # -- planning and launching ----------------------------------------------------------------

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """The code's S3 prefix, the run's Secrets Manager secret (names only) and one
        CreateTrainingJob request per rank, as `create_training_job` receives them."""
        body = rq.plan_body(self.options, request, self.aws.region())
        return LaunchPlan(self.backend_name, request, body, format="json")

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        """Upload the code, store the secrets, then create the planned jobs rank by rank."""
        if not self.options.role:
            raise UserError("[backend] role is needed: the ARN of a SageMaker execution role "
                            "(arn:aws:iam::<account>:role/<name>) that can read and write the rendezvous bucket")
        request, body = plan.request, plan.body
        region, code = body["region"], body["code"]
        self.aws.call(f"upload the code to {code['s3_uri']}", source.upload_code, self.aws.client("s3", region),
                      code, list(self.options.ignore))
        secret = body["secrets_manager"]["secret"]
        if secret:
            self._store_secrets(secret, request.secrets.reveal(), request.run_id, region)
        sm = self.aws.client("sagemaker", region)
        jobs = {rq.job_rank(job): job for job in body["jobs"]}

        def start(rank: int) -> ReplicaHandle:
            job = jobs[rank]
            name = job["TrainingJobName"]
            created = time.time()
            resources = job["ResourceConfig"]
            count = f"{resources['InstanceCount']} × " if resources["InstanceCount"] > 1 else ""
            self.aws.call(f"create {name} on {count}{resources['InstanceType']}", sm.create_training_job, **job)
            return ReplicaHandle.of(request, rank, self.backend_name, job=name, region=region,
                                    url=console_url(region, name), created=created)

        return start_each(request.ranks, start, self.cancel, platform="SageMaker", unit="job(s)")

    def _store_secrets(self, name: str, values: dict[str, str], run_id: str, region: str) -> None:
        """One Secrets Manager secret per run holding the forwarded values (updated on relaunch)."""
        from botocore.exceptions import ClientError

        sm = self.aws.client("secretsmanager", region)
        body = json.dumps(values, sort_keys=True)
        try:
            sm.create_secret(Name=name, SecretString=body, Tags=[{"Key": rq.RUN_TAG, "Value": run_id}],
                             Description=f"diloco run {run_id}: secrets forwarded from the launcher's shell")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ResourceExistsException":
                raise self.aws.client_error(f"store the run's secrets as {name}", exc) from None
            self.aws.call(f"update the run's secrets in {name}", sm.put_secret_value, SecretId=name,
                          SecretString=body)

    # -- observing -----------------------------------------------------------------------------

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        md = dict(handle.metadata)
        try:
            job = self.aws.describe(md)
        except Transient:
            return self._last.last(md["job"])
        if job is None:
            return ReplicaStatus.PENDING if self._may_still_appear(md) else ReplicaStatus.FAILED
        return self._last.saw(md["job"], st.replica_status(job, stop_requested=md["job"] in self._stopped))

    def _may_still_appear(self, md: dict) -> bool:
        """Whether a job SageMaker does not show was created recently enough to be lagging."""
        return time.time() - float(md.get("created") or 0) < NOT_FOUND_GRACE

    def status_detail(self, handle: ReplicaHandle) -> str | None:
        """Why the replica is waiting (a spot interruption SageMaker is retrying, …), for events."""
        md = dict(handle.metadata)
        try:
            job = self.aws.describe(md)
        except Transient:
            return "SageMaker is throttling DescribeTrainingJob; the status shown is the last one read"
        if job is None:
            return "SageMaker does not show the job yet (its reads lag behind CreateTrainingJob)"
        return st.detail(job)

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        return read_logs(self.aws, dict(handle.metadata), n_lines)

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        """Each replica's result when it ends: the return value node 0 printed, or why it failed."""
        statuses = poll_until_terminal(self, handles, timeout=timeout, interval=1.0)
        return [unless_failed(h, s, lambda h=h: self._returned(h)) or self._failure(h, s)
                for h, s in zip(handles, statuses)]

    def _returned(self, handle: ReplicaHandle) -> object:
        try:
            return read_result(self.aws, dict(handle.metadata))
        except Transient:  # throttled past the retries: the replica succeeded, its value unread
            return None

    def _failure(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        md = dict(handle.metadata)
        try:
            job = self.aws.describe(md)
        except Transient:
            job = {}
        if job is None:
            job = {"TrainingJobName": md["job"], "FailureReason": (
                f"the training job {md['job']} is gone: SageMaker does not know it "
                f"{time.time() - float(md.get('created') or 0):.0f}s after it was created (deleted, or never created)")}
        tail = self.stream_logs(handle, n_lines=20).strip()
        code = st.exit_code(job)
        job = {"TrainingJobName": md["job"], **job}
        timed_out = job.get("SecondaryStatus") in st.TIMED_OUT  # SageMaker ended it: its reason comes first
        # several instances: the log's last cause may be a node SageMaker stopped; FailureReason is the failed one's
        several = (job.get("ResourceConfig") or {}).get("InstanceCount", 1) > 1 and job.get("FailureReason")
        first = st.failure_cause(job) if timed_out or several else (cause_from_log(tail) or st.failure_cause(job))
        error = f"{first}\n{md.get('url', '')}\n{tail}".rstrip()
        return ReplicaResult.failed(handle, status, error, code)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """StopTrainingJob; a job that already ended keeps its status, other errors surface.

        Asked directly (no describe first: right after CreateTrainingJob, SageMaker may not show
        the job yet), again while it is not found within the grace period or throttled, for at
        most STOP_PATIENCE seconds: a job left running would train and bill on its own.
        """
        import tenacity

        md = dict(handle.metadata)
        sm = self.aws.client("sagemaker", md.get("region"))
        self._stopped.add(md["job"])

        def again(exc: BaseException) -> bool:  # throttled or unreachable, or not visible yet
            return is_transient(exc) or (is_not_found(exc) and self._may_still_appear(md))

        try:
            for attempt in tenacity.Retrying(retry=tenacity.retry_if_exception(again), reraise=True,
                                             stop=tenacity.stop_after_delay(STOP_PATIENCE),
                                             wait=tenacity.wait_exponential(multiplier=0.5, max=10.0)):
                with attempt:
                    sm.stop_training_job(TrainingJobName=md["job"])
        except Exception as exc:  # noqa: BLE001 - sorted below: ended, gone, or an error to surface
            gone = is_not_found(exc) and not self._may_still_appear(md)
            if not (gone or _has_ended(exc)):
                if is_aws_error(exc):
                    raise self.aws.client_error(f"stop {md['job']}", exc) from None
                raise


def is_aws_error(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError)


def _has_ended(exc: BaseException) -> bool:
    """StopTrainingJob's answer for a job that has ended (or is stopping): nothing left to stop."""
    if not is_aws_error(exc):
        return False
    err = exc.response.get("Error", {})  # type: ignore[attr-defined]
    message = err.get("Message", "").lower()
    return err.get("Code") == "ValidationException" and ("already" in message or "status" in message)
