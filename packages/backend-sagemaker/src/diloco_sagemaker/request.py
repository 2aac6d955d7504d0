"""What a replica is on SageMaker, as data: one CreateTrainingJob request per replica attempt.

Nothing here talks to AWS. `plan_body` turns the `[backend]` options (`SageMakerOptions`) and a
`LaunchRequest` into the plan: the code's S3 prefix, the Secrets Manager names, and the exact
requests `create_training_job` receives (`training_job_request`), which `diloco dryrun` prints.
Topology: one training job per replica, InstanceCount 1 — per-rank status, per-rank relaunch
and independent spot interruptions; replicas meet only through S3.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from diloco.errors import UserError
from diloco.procgroup import replica_command
from diloco.replicaenv import pinned_requirement
from diloco.request import LaunchRequest

from .bootstrap import CHANNEL, ML_ROOT, PIP_ENV, SECRET_REFS_ENV
from .instances import instance_type
from .options import SageMakerOptions

BOOTSTRAP_FILE = "bootstrap.py"
ENTRYPOINT = ["python", f"{ML_ROOT}/input/data/{CHANNEL}/{BOOTSTRAP_FILE}"]
RUN_TAG, RANK_TAG, ATTEMPT_TAG = "diloco-run", "diloco-rank", "diloco-attempt"
MAX_RUNTIME = 28 * 24 * 3600  # SageMaker's longest MaxRuntimeInSeconds
SECRET_PREFIX = "diloco/"  # one Secrets Manager secret per run: diloco/<run id>
MAX_ENV_VALUE, MAX_ENV_ENTRIES = 1024, 100
_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


def job_name(run_id: str, rank: int, attempt: int) -> str:
    """`<run>-r<rank>-a<attempt>`, valid for SageMaker (≤ 63 characters, letters, digits, dashes)."""
    suffix = f"-r{rank}-a{attempt}"
    base = re.sub(r"[^a-zA-Z0-9-]+", "-", run_id).strip("-") or "diloco"
    if len(base) + len(suffix) > 63:  # keep it unique: a hash of the whole run id replaces the cut part
        digest = hashlib.sha1(run_id.encode()).hexdigest()[:6]
        base = base[: 63 - len(suffix) - 7].rstrip("-") + "-" + digest
    name = base + suffix
    assert _JOB_NAME.match(name), name
    return name


def default_prefix(opts: SageMakerOptions, rendezvous: str | None) -> str:
    """Where the run's code and outputs go: [backend] s3_prefix, else the rendezvous bucket."""
    if opts.s3_prefix:
        return opts.s3_prefix.rstrip("/")
    if rendezvous and rendezvous.startswith("s3://"):
        bucket = rendezvous[len("s3://"):].split("/", 1)[0]
        return f"s3://{bucket}/diloco-sagemaker"
    raise UserError("[backend] s3_prefix is needed (an s3:// URI for the run's code and outputs) when the "
                    "rendezvous is not an s3:// URI")


def code_uri(opts: SageMakerOptions, rendezvous: str | None, run_id: str) -> str:
    """The input channel's prefix: the bootstrap and the workdir archive of this run."""
    return f"{default_prefix(opts, rendezvous)}/{run_id}/code/"


def resolve_image(opts: SageMakerOptions, region: str, instance: str) -> str:
    """The training image: `image` as given, or the official PyTorch training image for
    `pytorch_version` through sagemaker-core's image_uris (the optional `images` extra)."""
    if opts.image:
        return opts.image
    if not opts.pytorch_version:
        raise UserError("[backend] image is needed: an ECR image with diloco-replica installed (see "
                        "packages/replica/README.md), or pytorch_version = \"2.8\" for the official PyTorch "
                        "training image (pip install 'diloco-backend-sagemaker[images]')")
    try:
        from sagemaker.core import image_uris
    except ImportError:
        raise UserError("[backend] pytorch_version needs sagemaker-core's image list: pip install "
                        "'diloco-backend-sagemaker[images]', or give an ECR `image`") from None
    try:
        return image_uris.retrieve("pytorch", region, version=opts.pytorch_version, py_version=opts.py_version,
                                   instance_type=instance, image_scope="training")
    except ValueError as exc:
        raise UserError(f"[backend] pytorch_version {opts.pytorch_version!r}: {exc}") from None


def pip_packages(opts: SageMakerOptions) -> list[str]:
    """What the bootstrap installs first: diloco itself on an official image, then `pip`."""
    base = [pinned_requirement("diloco-core"), pinned_requirement("diloco-replica")] if opts.pytorch_version else []
    return base + list(opts.pip)


def check_environment(env: dict[str, str]) -> None:
    """SageMaker's Environment limits, as one line naming the variable."""
    if len(env) > MAX_ENV_ENTRIES:
        raise UserError(f"SageMaker allows at most {MAX_ENV_ENTRIES} environment variables per job; this run "
                        f"needs {len(env)}: move some [env] entries into your code")
    for k, v in env.items():
        if len(v) > MAX_ENV_VALUE:
            raise UserError(f"SageMaker limits each environment value to {MAX_ENV_VALUE} characters; {k} has "
                            f"{len(v)}: move large entrypoint args or settings into a file in the workdir")


def training_job_request(opts: SageMakerOptions, *, name: str, region: str, image: str, instance: str,
                         env: dict[str, str], processes: int, timeout: float, code: str, output: str,
                         tags: dict[str, str]) -> dict[str, Any]:
    """One CreateTrainingJob request (env must already be free of secret values)."""
    runtime = int(timeout)
    if not 1 <= runtime <= MAX_RUNTIME:
        raise UserError(f"timeout {timeout:g}s is outside SageMaker's MaxRuntimeInSeconds (1..{MAX_RUNTIME}, "
                        f"28 days)")
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": runtime}
    if opts.spot:
        wait = int(opts.max_wait) if opts.max_wait is not None else min(runtime + 3600, MAX_RUNTIME)
        if wait < runtime:
            raise UserError(f"[backend] max_wait ({wait}s) must be at least the timeout ({runtime}s): it is the "
                            f"whole budget for a spot job, waiting for capacity included")
        stopping["MaxWaitTimeInSeconds"] = wait
    elif opts.max_wait is not None:
        raise UserError("[backend] max_wait only applies with spot = true")
    check_environment(env)
    resources: dict[str, Any] = {"InstanceType": instance, "InstanceCount": 1,
                                 "VolumeSizeInGB": int(opts.volume_size_gb)}
    if opts.keep_alive:
        resources["KeepAlivePeriodInSeconds"] = int(opts.keep_alive)
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": opts.role or "<[backend] role: the SageMaker execution role ARN>",
        "AlgorithmSpecification": {"TrainingImage": image, "TrainingInputMode": "File",
                                   "ContainerEntrypoint": list(ENTRYPOINT),
                                   "ContainerArguments": replica_command(processes)},
        "InputDataConfig": [{"ChannelName": CHANNEL, "InputMode": "File", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": code, "S3DataDistributionType": "FullyReplicated"}}}],
        "OutputDataConfig": {"S3OutputPath": output},
        "ResourceConfig": resources,
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": bool(opts.spot),
        "Environment": dict(env),
        "Tags": [{"Key": k, "Value": v} for k, v in {**opts.tags, **tags}.items()],
    }
    if opts.subnets:
        request["VpcConfig"] = {"Subnets": list(opts.subnets), "SecurityGroupIds": list(opts.security_groups)}
    return request


def bootstrap_env(refs: dict[str, str], packages: list[str]) -> dict[str, str]:
    """What the bootstrap reads: secret references (names, never values) and packages to install."""
    out = {SECRET_REFS_ENV: json.dumps(refs, sort_keys=True)} if refs else {}
    if packages:
        out[PIP_ENV] = json.dumps(packages)
    return out


def plan_body(opts: SageMakerOptions, request: LaunchRequest, region: str) -> dict[str, Any]:
    """What the executor submits for `request`: the code's prefix (and the workdir shipped there),
    the run's Secrets Manager secret (names, never values) and one CreateTrainingJob per rank."""
    run_id, attempt = request.run_id, request.attempt
    instance = instance_type(request.gpu, opts.instance_type)
    image = resolve_image(opts, region, instance)
    code = code_uri(opts, request.rendezvous, run_id)
    output = opts.output_path or f"{default_prefix(opts, request.rendezvous)}/{run_id}/output"
    forwarded = request.secrets.names
    refs = {**{k: f"{SECRET_PREFIX}{run_id}#{k}" for k in forwarded}, **opts.secret_refs}
    extra = bootstrap_env(refs, pip_packages(opts))
    jobs = []
    for rank in request.ranks:
        env = request.replica_env(rank)
        env.pop("PYTHONPATH", None)  # the bootstrap puts the unpacked workdir there
        env.setdefault("AWS_REGION", region)
        env.setdefault("AWS_DEFAULT_REGION", region)
        env.update(extra)
        jobs.append(training_job_request(
            opts, name=job_name(run_id, rank, attempt), region=region, image=image, instance=instance, env=env,
            processes=request.processes_per_replica, timeout=request.timeout, code=code, output=output,
            tags={RUN_TAG: run_id, RANK_TAG: str(rank), ATTEMPT_TAG: str(attempt)}))
    workdir = request.workdir if opts.include_workdir and request.workdir else None
    return {"region": region, "code": {"s3_uri": code, "workdir": workdir},
            "secrets_manager": {"secret": f"{SECRET_PREFIX}{run_id}" if forwarded else None,
                                "forwarded": forwarded, "references": dict(opts.secret_refs)},
            "jobs": jobs}


def job_rank(job: dict[str, Any]) -> int:
    """The rank a planned CreateTrainingJob request starts (its diloco-rank tag)."""
    return int(next(t["Value"] for t in job["Tags"] if t["Key"] == RANK_TAG))
