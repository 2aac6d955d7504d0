"""What a replica is on SageMaker, as data: one CreateTrainingJob request per replica attempt.

Nothing here talks to AWS. `plan_body` turns the `[backend]` options (`SageMakerOptions`) and a
`LaunchRequest` into the plan: the code's S3 prefix and what is shipped there (the workdir's
files, long environment values, wheels for an official image), the Secrets Manager names, and
the exact requests `create_training_job` receives (`training_job_request`), which `diloco
dryrun` prints. Each request is checked against botocore's model of CreateTrainingJob and
SageMaker's documented rules before anything is uploaded (`refuse_what_sagemaker_refuses`).
Topology: one training job per replica attempt — per-rank status, per-rank relaunch and
independent spot interruptions; replicas meet only through S3. A replica of `nodes = K` is one
job of InstanceCount K: SageMaker places the K instances together on its network, starts the
same node command on each (`replica_command(P, K)`; the bootstrap gives each its node from
resourceconfig.json) and fails the whole job when one instance fails, which is the one attempt
the supervisor relaunches.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from diloco.errors import UserError
from diloco.procgroup import replica_command
from diloco.request import LaunchRequest

from . import servicemodel, servicerules
from .bootstrap import CHANNEL, ML_ROOT, PIP_ENV, SECRET_REFS_ENV, WHEELS_ENV
from .environment import fit_environment
from .instances import instance_type, processes_fit
from .officialimage import planned_wheels, resolve_image
from .options import SageMakerOptions

BOOTSTRAP_FILE = "bootstrap.py"
SECRETS_READER_FILE = "secretsreader.py"
ENTRYPOINT = ["python", f"{ML_ROOT}/input/data/{CHANNEL}/{BOOTSTRAP_FILE}"]
RUN_TAG, RANK_TAG, ATTEMPT_TAG = "diloco-run", "diloco-rank", "diloco-attempt"
MAX_RUNTIME = servicerules.MAX_RUNTIME_SECONDS  # SageMaker's longest MaxRuntimeInSeconds: 28 days
SECRET_PREFIX = "diloco/"  # one Secrets Manager secret per run: diloco/<run id>
MAX_ARCHIVE_BYTES = 512 << 20
_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
ROLE_PLACEHOLDER = "<[backend] role: the SageMaker execution role ARN>"


def job_name(run_id: str, rank: int, attempt: int) -> str:
    """`<run>-r<rank>-a<attempt>`, valid for SageMaker (≤ 63 characters, letters, digits, dashes)."""
    suffix = f"-r{rank}-a{attempt}"
    base = re.sub(r"[^a-zA-Z0-9-]+", "-", run_id).strip("-") or "diloco"
    if len(base) + len(suffix) > 63:  # keep it unique: 64 bits of a hash of the whole run id replace the cut part
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:16]
        base = base[: 63 - len(suffix) - 17].rstrip("-") + "-" + digest
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
    """The input channel's prefix: the bootstrap and what the run ships."""
    return f"{default_prefix(opts, rendezvous)}/{run_id}/code/"


def training_job_request(opts: SageMakerOptions, *, name: str, image: str, instance: str, env: dict[str, str],
                         processes: int, timeout: float, code: str, output: str,
                         tags: dict[str, str], nodes: int = 1) -> dict[str, Any]:
    """One CreateTrainingJob request (env must already be free of secret values and within limits):
    `nodes` instances of `instance`, each running `processes` processes."""
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
    resources: dict[str, Any] = {"InstanceType": instance, "InstanceCount": nodes,
                                 "VolumeSizeInGB": int(opts.volume_size_gb)}
    if opts.keep_alive:
        resources["KeepAlivePeriodInSeconds"] = int(opts.keep_alive)
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": opts.role or ROLE_PLACEHOLDER,
        "AlgorithmSpecification": {"TrainingImage": image, "TrainingInputMode": "File",
                                   "ContainerEntrypoint": list(ENTRYPOINT),
                                   "ContainerArguments": replica_command(processes, nodes)},
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


def refuse_what_sagemaker_refuses(job: dict[str, Any], rank: int) -> None:
    """One line for the first thing SageMaker would refuse in `job` (its model, its documented
    rules). Enums are left to the service: it learns new instance types before a client's model."""
    checked = job if job["RoleArn"] != ROLE_PLACEHOLDER else {**job, "RoleArn": "arn:aws:iam::000000000000:role/r"}
    problems = servicemodel.check("CreateTrainingJob", checked, enums=False)
    found = problems.serialization + problems.validation + servicerules.create_training_job(checked)
    if found:
        raise UserError(f"SageMaker would refuse rank {rank}'s CreateTrainingJob: {found[0]} (botocore "
                        f"{servicemodel.botocore_version()}'s model of the API): check the [backend] options and "
                        f"[env] it comes from")


def bootstrap_env(refs: dict[str, str], packages: list[str], wheels: dict[str, Any] | None) -> dict[str, str]:
    """What the bootstrap reads: secret references (names, never values) and what to install."""
    out = {SECRET_REFS_ENV: json.dumps(refs, sort_keys=True)} if refs else {}
    if packages:
        out[PIP_ENV] = json.dumps(packages)
    if wheels:
        out[WHEELS_ENV] = json.dumps(wheels["install"])
    return out


def shipped_workdir(opts: SageMakerOptions, request: LaunchRequest) -> dict[str, Any] | None:
    """What of the workdir is shipped (`diloco.shipping.workdir`: never credentials, .gitignore honoured,
    `[backend] ignore` added), as `diloco dryrun` shows it; None when nothing is shipped."""
    if not (opts.include_workdir and request.workdir):
        return None
    from diloco.shipping.workdir import select_files

    shipment = select_files(request.workdir, ignore=opts.ignore)
    if shipment.total_bytes > MAX_ARCHIVE_BYTES:
        raise UserError(f"workdir {request.workdir!r} holds {shipment.total_bytes >> 20} MiB to ship, more than "
                        f"{MAX_ARCHIVE_BYTES >> 20} MiB: keep data and checkpoints in S3, add patterns to "
                        f"[backend] ignore, or set include_workdir = false and bake the code into the image")
    return shipment.summary()


def plan_body(opts: SageMakerOptions, request: LaunchRequest, region: str) -> dict[str, Any]:
    """What the executor submits for `request`: the code's prefix and what is shipped there, the
    run's Secrets Manager secret (names, never values) and one CreateTrainingJob per rank."""
    run_id, attempt = request.run_id, request.attempt
    instance = instance_type(request.gpu, opts.instance_type)
    processes_fit(instance, request.processes_per_replica)
    image = resolve_image(opts, region, instance)
    code = code_uri(opts, request.rendezvous, run_id)
    output = opts.output_path or f"{default_prefix(opts, request.rendezvous)}/{run_id}/output"
    forwarded = request.secrets.names
    refs = {**{k: f"{SECRET_PREFIX}{run_id}#{k}" for k in forwarded}, **opts.secret_refs}
    wheels = planned_wheels(opts, image)
    extra = bootstrap_env(refs, list(opts.pip), wheels)
    jobs, env_files = [], {}
    for rank in request.ranks:
        env = request.replica_env(rank)
        env.pop("PYTHONPATH", None)  # the bootstrap puts the unpacked workdir there
        env.setdefault("AWS_REGION", region)
        env.setdefault("AWS_DEFAULT_REGION", region)
        env.update(extra)
        env, long_values = fit_environment(env, user_keys=set(request.env))
        if long_values:
            env_files[env["DILOCO_ENV_FILE"]] = long_values
        job = training_job_request(
            opts, name=job_name(run_id, rank, attempt), image=image, instance=instance, env=env,
            processes=request.processes_per_replica, nodes=request.nodes, timeout=request.timeout, code=code,
            output=output, tags={RUN_TAG: run_id, RANK_TAG: str(rank), ATTEMPT_TAG: str(attempt)})
        refuse_what_sagemaker_refuses(job, rank)
        jobs.append(job)
    workdir = shipped_workdir(opts, request)
    return {"region": region,
            "code": {"s3_uri": code, "workdir": request.workdir if workdir else None, "shipped": workdir,
                     "env_files": env_files, "wheels": wheels},
            "secrets_manager": {"secret": f"{SECRET_PREFIX}{run_id}" if forwarded else None,
                                "forwarded": forwarded, "references": dict(opts.secret_refs)},
            "jobs": jobs}


def job_rank(job: dict[str, Any]) -> int:
    """The rank a planned CreateTrainingJob request starts (its diloco-rank tag)."""
    return int(next(t["Value"] for t in job["Tags"] if t["Key"] == RANK_TAG))
