"""The Kubernetes objects a launch submits, built as plain dicts (no SDK needed): the plan's body.

Replicas of one node: one Indexed Job per launch, completions = parallelism = number of ranks,
completionMode Indexed, the completion index is the rank (REPLICA_RANK from the downward API),
and deleting the Job cancels the whole cohort. A relaunch of one rank is a one-pod Indexed Job
whose rank is a literal.

Replicas of K nodes (`nodes = K`): one Indexed Job of K pods per replica, the completion index
the node rank, and a headless Service for the pods' DNS names (`diloco_eks.island`).

Secret values never enter a Job: they go into a Secret the pods reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from diloco.errors import UserError
from diloco.inputs.replicaenv import Entrypoint
from diloco.procgroup import replica_command
from diloco.inputs.envvars import ENV_RANK

from .gpus import INSTANCE_TYPE_LABEL, GpuRequest, check_layout, resolve_gpu
from .island import check_island, headless_service, node_env_list
from .k8s_values import dns_label

if TYPE_CHECKING:
    from diloco.request import LaunchRequest

    from .options import EksOptions

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
LABEL_RUN = "diloco.dev/run-id"
LABEL_RANK = "diloco.dev/rank"
LABEL_ATTEMPT = "diloco.dev/attempt"

GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def job_name(run_id: str, attempt: int, rank: int | None = None) -> str:
    """Job names stay ≤ 52 chars: pods are named <job>-<index>-<5 random> within 63."""
    suffix = f"-a{attempt}" if rank is None else f"-r{rank}-a{attempt}"
    return dns_label(run_id, 52 - len(suffix)) + suffix


def label_value(text: str) -> str:
    return dns_label(text, 63)


def _env_list(env: Mapping[str, str], secret_names: Sequence[str], secret_ref: str | None,
              rank_vars: Sequence[str], from_annotation: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key, value in env.items():
        if key in rank_vars and from_annotation:
            out.append({"name": key, "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}})
        else:
            out.append({"name": key, "value": value})
    for name in secret_names:
        out.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret_ref, "key": name}}})
    return out


def build_job(*, name: str, run_id: str, attempt: int, ranks: Sequence[int], n_replicas: int,
              entrypoint: Entrypoint, env: Mapping[str, str], rank_env: str, secret_names: Sequence[str],
              secret_ref: str | None, timeout: float | None, gpu: GpuRequest | None,
              opts: EksOptions, processes: int = 1, nodes: int = 1, service: str | None = None) -> dict[str, Any]:
    """The Job for `ranks` of a world of `n_replicas` (all of them, or one relaunched rank), or,
    with `nodes` K > 1, the K pods of one replica (`service`: the headless Service they join).

    With `processes` L > 1 each pod runs torchrun over L processes (`diloco.procgroup`), gets
    a memory-backed /dev/shm (NCCL and DataLoader workers need more than a container's 64 MB)
    and, with a `gpu`, its GPUs: one per process at least.
    """
    whole = list(ranks) == list(range(n_replicas)) and nodes == 1
    if not whole and len(ranks) != 1:
        raise ValueError("a Job launches either every rank or exactly one")
    env = dict(env)
    rank_vars = sorted({ENV_RANK, rank_env})
    if not whole:
        for var in rank_vars:
            env[var] = str(ranks[0])
    container: dict[str, Any] = {
        "name": "replica",
        "image": opts.image,
        "env": _env_list(env, secret_names, secret_ref, rank_vars, from_annotation=whole),
    }
    if nodes > 1:
        container["env"] += node_env_list(name, service, opts.master_port)
    if processes > 1 or nodes > 1:
        if opts.command:
            raise UserError("[backend] command replaces the replica's launcher, so it cannot be combined with "
                            f"processes_per_replica = {processes}; drop one of them")
        container["command"] = replica_command(processes, nodes)
    elif entrypoint.command:
        container["command"] = list(entrypoint.command)
    else:
        container["command"] = list(opts.command or ["diloco-replica"])
    if processes > 1:
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    requests = {k: v for k, v in (("cpu", opts.cpu), ("memory", opts.memory)) if v}
    limits: dict[str, str] = {}
    if gpu:
        limits[GPU_RESOURCE] = str(gpu.count)  # quantities are strings in the API
    if requests or limits:
        container["resources"] = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    node_selector = {}
    if gpu and gpu.instance_type:
        node_selector[INSTANCE_TYPE_LABEL] = gpu.instance_type
    node_selector.update(opts.node_selector or {})  # the user's selectors win on conflicts
    tolerations = opts.tolerations if opts.tolerations is not None else ([GPU_TOLERATION] if gpu else [])
    labels = {**(opts.labels or {}), LABEL_RUN: label_value(run_id), LABEL_ATTEMPT: str(attempt)}
    if not whole:
        labels[LABEL_RANK] = str(ranks[0])
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if service:
        pod_spec["subdomain"] = service  # with the host name the Job gives each pod: <job>-<index>.<service>
    if processes > 1:
        pod_spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if opts.service_account:
        pod_spec["serviceAccountName"] = opts.service_account
    if opts.runtime_class:
        pod_spec["runtimeClassName"] = opts.runtime_class
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = list(tolerations)
    n = nodes if nodes > 1 else len(ranks)
    spec: dict[str, Any] = {
        "completions": n,
        "parallelism": n,
        "completionMode": "Indexed",
        "ttlSecondsAfterFinished": opts.ttl_seconds_after_finished,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},  # a copy: no YAML anchors
    }
    if nodes > 1:
        spec["backoffLimit"] = 0  # one pod lost ends the replica: Kubernetes stops the others, diloco relaunches all
    elif opts.per_index:
        # One failed index fails alone (the others keep training); the supervisor relaunches it.
        spec["backoffLimitPerIndex"] = opts.index_retries
        # A pod lost to a disruption (spot reclaim, eviction, node drain) is recreated by
        # Kubernetes without counting as a failure of its index.
        spec["podFailurePolicy"] = {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
    else:
        spec["backoffLimit"] = 0  # fail fast: any failure fails the Job (the supervisor restarts the gang)
    if timeout:
        spec["activeDeadlineSeconds"] = int(math.ceil(timeout))
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": opts.namespace, "labels": labels}, "spec": spec}


def build_secret(*, name: str, run_id: str, namespace: str, values: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_RUN: label_value(run_id)}},
            "stringData": dict(values)}


def launch_documents(request: LaunchRequest, opts: EksOptions) -> list[dict[str, Any]]:
    """What a launch submits, in order: for each Job, its env Secret (values REDACTED: `submit`
    fills them in), its headless Service if its replica has several nodes, and then the Job.
    With one node per replica the whole world is one Job, and a relaunch of some ranks is one
    Job per rank; with several, each replica is a Job. One Secret per Job, so relaunches of
    different ranks never share (or delete) each other's."""
    if not opts.image:
        raise UserError("the eks backend needs [backend] image: a container image with your code and "
                        "diloco-replica installed")
    nodes, processes = request.nodes, request.processes_per_replica
    gpu = resolve_gpu(request.gpu, opts.gpu_types)
    check_layout(gpu, processes, nodes, opts.node_selector)
    check_island(nodes, command=opts.command, index_retries=opts.index_retries)
    rank_env = str(request.args.get("rank_env", ENV_RANK))
    env = request.replica_env(0)  # the rank's own variables are set per Job by `build_job`
    env.pop("PYTHONPATH", None)
    literal = {k: v for k, v in env.items() if k not in request.secrets}
    one_job = request.all_ranks and nodes == 1
    docs: list[dict[str, Any]] = []
    for group in [list(request.ranks)] if one_job else [[r] for r in request.ranks]:
        name = job_name(request.run_id, request.attempt, None if one_job else group[0])
        secret_ref = f"{name}-env" if request.secrets else None
        if secret_ref:
            docs.append(build_secret(name=secret_ref, run_id=request.run_id, namespace=opts.namespace,
                                     values=request.secrets.redacted()))
        job = build_job(name=name, run_id=request.run_id, attempt=request.attempt, ranks=group,
                        n_replicas=request.n_replicas, entrypoint=request.entrypoint, env=literal,
                        rank_env=rank_env, secret_names=request.secrets.names, secret_ref=secret_ref,
                        timeout=request.timeout, gpu=gpu, opts=opts, processes=processes, nodes=nodes,
                        service=name if nodes > 1 else None)
        if nodes > 1:  # before the Job: its pods' names resolve from their start
            docs.append(headless_service(name, opts.namespace, job["metadata"]["labels"]))
        docs.append(job)
    return docs


def job_ranks(job: Mapping[str, Any]) -> list[int]:
    """The ranks a planned Job starts, in index order: its rank label (a relaunch, or a replica of
    several nodes), else 0..completions-1."""
    rank = (job["metadata"].get("labels") or {}).get(LABEL_RANK)
    return [int(rank)] if rank is not None else list(range(int(job["spec"]["completions"])))


def job_service(job: Mapping[str, Any]) -> str | None:
    """The headless Service a planned Job's pods join (replicas of several nodes), if any."""
    return job["spec"]["template"]["spec"].get("subdomain")


def secret_refs(job: Mapping[str, Any]) -> set[str]:
    """The Secrets a Job's containers read their environment from."""
    return {e["valueFrom"]["secretKeyRef"]["name"] for c in job["spec"]["template"]["spec"]["containers"]
            for e in c.get("env") or [] if "secretKeyRef" in (e.get("valueFrom") or {})}
