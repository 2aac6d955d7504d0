"""A replica of several nodes (`nodes = K`) on Kubernetes: one Indexed Job of K pods and the
headless Service that gives them stable DNS names.

Each replica is its own Job, `completions = parallelism = K`, completion index = node rank:
- every pod runs `diloco.procgroup.replica_command(P, K)` (torchrun with torch's static
  rendezvous) and gets `diloco.procgroup.node_env`: its node rank from the pod's completion
  index (the downward API, the annotation Kubernetes also exports as JOB_COMPLETION_INDEX),
  the first node's address as a literal;
- the Job controller names each pod's host `<job>-<index>` and the pods' `subdomain` is a
  headless Service of the Job's own name selecting its pods, so node 0 is reachable as
  `<job>-0.<job>` from every pod of the namespace (cluster DNS). The Service publishes pods
  before they are ready: the other nodes look node 0 up while it starts;
- `backoffLimit: 0`: one pod failed, deleted or lost fails the Job, and Kubernetes stops the
  others. The replica ends as one attempt, which the supervisor relaunches as one (a new Job
  `<run>-r<rank>-a<attempt>`); the other replicas, other Jobs, never notice. A pod retried in
  place (`index_retries`) could not rejoin the others' torch group, so that option is refused.

Why Indexed Job + headless Service and not JobSet: see the README ("Replicas of several nodes").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.errors import UserError
from diloco.procgroup import node_env

COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on each of its pods


def first_node(job: str, service: str) -> str:
    """Node 0's stable DNS name, as pods of the same namespace resolve it: `<host>.<subdomain>`."""
    return f"{job}-0.{service}"


def node_env_list(job: str, service: str, port: int) -> list[dict[str, Any]]:
    """torchrun's per-node variables (`node_env`) as a pod template's env: what differs between
    nodes (the node rank) from the pod's completion index, the rest (node 0's address and port) literal."""
    first, second = node_env(0, first_node(job, service), port), node_env(1, first_node(job, service), port)
    return [{"name": key, "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}}
            if first[key] != second[key] else {"name": key, "value": value} for key, value in first.items()]


def headless_service(name: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """The Service that gives Job `name`'s pods their DNS names (`<name>-<index>.<name>`)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"clusterIP": "None", "selector": {JOB_NAME_LABEL: name}, "publishNotReadyAddresses": True}}


def check_island(nodes: int, *, command: list[str] | None, index_retries: int) -> None:
    """What a replica of several nodes cannot be combined with, in one line."""
    if nodes <= 1:
        return
    if command:
        raise UserError(f"[backend] command replaces the replica's launcher, which starts each of the {nodes} nodes "
                        "of a replica; drop [backend] command or use nodes = 1")
    if index_retries:
        raise UserError(f"[backend] index_retries = {index_retries} retries one pod in place, which cannot rejoin the "
                        f"other nodes of its replica (nodes = {nodes}); drop index_retries: the supervisor relaunches "
                        "the whole replica")
