"""What a replica is on SageMaker, as data: one CreateTrainingJob request per replica attempt.

Nothing here talks to AWS. `JobOptions` holds the [backend] table; `training_job_request`
turns it and the launch arguments into the exact request `create_training_job` receives (and
`diloco dryrun` prints). Topology: one training job per replica, InstanceCount 1 — per-rank
status, per-rank relaunch and independent spot interruptions; replicas meet only through S3.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from diloco.errors import UserError
from diloco.procgroup import replica_command

from .bootstrap import CHANNEL, ML_ROOT, PIP_ENV, SECRET_REFS_ENV

BOOTSTRAP_FILE = "bootstrap.py"
ENTRYPOINT = ["python", f"{ML_ROOT}/input/data/{CHANNEL}/{BOOTSTRAP_FILE}"]
RUN_TAG, RANK_TAG, ATTEMPT_TAG = "diloco-run", "diloco-rank", "diloco-attempt"
MAX_RUNTIME = 28 * 24 * 3600  # SageMaker's longest MaxRuntimeInSeconds
MAX_KEEP_ALIVE = 3600
MAX_ENV_VALUE, MAX_ENV_ENTRIES = 1024, 100
_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$")


@dataclass
class JobOptions:
    role: str | None = None
    region: str | None = None
    image: str | None = None
    pytorch_version: str | None = None
    py_version: str | None = None
    pip: list[str] = field(default_factory=list)
    instance_type: str | None = None
    volume_size_gb: int = 100
    spot: bool = False
    max_wait: int | None = None
    keep_alive: int = 0
    subnets: list[str] = field(default_factory=list)
    security_groups: list[str] = field(default_factory=list)
    s3_prefix: str | None = None
    output_path: str | None = None
    include_workdir: bool = True
    tags: dict[str, str] = field(default_factory=dict)
    secret_refs: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Everything checkable without AWS, each as one line naming the key."""
        if self.role and not _ROLE_ARN.match(self.role):
            raise UserError(f"[backend] role {self.role!r} is not an IAM role ARN "
                            f"(arn:aws:iam::<account>:role/<name>): give the SageMaker execution role")
        if self.image and self.pytorch_version:
            raise UserError("[backend] set `image` or `pytorch_version`, not both")
        if self.spot and self.keep_alive:
            raise UserError("[backend] keep_alive (warm pools) does not work with spot = true on SageMaker; "
                            "drop one of them")
        if not 0 <= int(self.keep_alive) <= MAX_KEEP_ALIVE:
            raise UserError(f"[backend] keep_alive must be 0..{MAX_KEEP_ALIVE} seconds, got {self.keep_alive}")
        if bool(self.subnets) != bool(self.security_groups):
            raise UserError("[backend] VPC config needs both `subnets` and `security_groups`")
        for prefix_key in ("s3_prefix", "output_path"):
            value = getattr(self, prefix_key)
            if value and not value.startswith("s3://"):
                raise UserError(f"[backend] {prefix_key} {value!r} must be an s3:// URI")
        for var, ref in self.secret_refs.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", var) or not ref:
                raise UserError(f"[backend] secret_refs: {var!r} = {ref!r} must map a variable name to a "
                                f"Secrets Manager secret id or ARN (optionally '#json-key')")


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


def default_prefix(opts: JobOptions, rendezvous: str | None) -> str:
    """Where the run's code and outputs go: [backend] s3_prefix, else the rendezvous bucket."""
    if opts.s3_prefix:
        return opts.s3_prefix.rstrip("/")
    if rendezvous and rendezvous.startswith("s3://"):
        bucket = rendezvous[len("s3://"):].split("/", 1)[0]
        return f"s3://{bucket}/diloco-sagemaker"
    raise UserError("[backend] s3_prefix is needed (an s3:// URI for the run's code and outputs) when the "
                    "rendezvous is not an s3:// URI")


def code_uri(opts: JobOptions, rendezvous: str | None, run_id: str) -> str:
    """The input channel's prefix: the bootstrap and the workdir archive of this run."""
    return f"{default_prefix(opts, rendezvous)}/{run_id}/code/"


def _pinned(dist: str) -> str:
    try:
        return f"{dist}=={metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return dist


def resolve_image(opts: JobOptions, region: str, instance: str) -> str:
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


def pip_packages(opts: JobOptions) -> list[str]:
    """What the bootstrap installs first: diloco itself on an official image, then `pip`."""
    base = [_pinned("diloco-core"), _pinned("diloco-replica")] if opts.pytorch_version else []
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


def training_job_request(opts: JobOptions, *, name: str, region: str, image: str, instance: str,
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
