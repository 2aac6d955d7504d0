"""The eks backend's `[backend]` options: declared once (`EksOptions`), checked by core.

Types, bounds and choices are checked from the declaration (`diloco.options`), each as one line
naming `backend.KEY`; `check` adds what the declaration cannot say (a namespace's shape, and
that labels, selectors, quantities and names are values the API server accepts).
The same object shapes every pod (`diloco_eks.manifest`) and says how to reach the cluster
(`diloco_eks.api`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.options import option
from diloco.procgroup import NODE_PORT

from . import k8s_values
from .gpus import GPU_TYPE_FIELDS, MAX_GPUS_PER_POD
from .k8s_values import dns_label


@dataclass(frozen=True)
class EksOptions:
    """The eks backend's `[backend]` options (see the README for what each maps to)."""

    image: str | None = option(None, help="the container image holding diloco-replica (packages/replica/Dockerfile "
                                          "builds one); required to plan or launch")
    namespace: str = option("default", help="the namespace Jobs and Secrets are created in")
    command: list[str] | None = option(None, help='the container command; default ["diloco-replica"] '
                                                  "(a command entrypoint replaces it)")
    service_account: str | None = option(None, help="serviceAccountName of the pods (IRSA / workload identity "
                                                    "for the store); not created")
    runtime_class: str | None = option(None, help="runtimeClassName (gVisor, Kata); referenced, never created")
    node_selector: dict[str, str] = option({}, help="extra nodeSelector labels (yours win over the GPU's "
                                                    "instance type)")
    tolerations: list[dict[str, Any]] | None = option(None, help="pod tolerations; default with a GPU: "
                                                                 "nvidia.com/gpu Exists NoSchedule",
                                                      not_secrets=("key",))  # the taint's key, a field
    cpu: str | None = option(None, help='CPU request per pod, e.g. "8"')
    memory: str | None = option(None, help='memory request per pod, e.g. "64Gi"')
    ttl_seconds_after_finished: int = option(3600, help="seconds a finished Job stays before Kubernetes "
                                                        "deletes it", min=0, max=2**31 - 1)  # int32 in the Job API
    per_index: bool = option(True, help="one pod per index with its own backoff (backoffLimitPerIndex), so one "
                                        "rank can be relaunched alone; false: the whole Job fails fast and "
                                        "restarts as a gang")
    index_retries: int = option(0, help="retries Kubernetes itself gives each index before diloco relaunches it "
                                        "(replicas of one node only)", min=0, max=100)
    master_port: int = option(NODE_PORT, help="the port node 0 of a replica of several nodes (nodes > 1) serves "
                                              "torch's store on (torchrun's --master-port); each pod has its own "
                                              "network, so change it only if something else in the pod uses it",
                              min=1024, max=65535)
    gpu_types: dict[str, dict[str, Any]] = option({}, help='more GPU names and the GPUs one node of their instance '
                                                           'type has, e.g. { L4 = { count = 1, instance_type = '
                                                           '"g6.xlarge" } }')
    labels: dict[str, str] = option({}, help="extra labels on Jobs and pods")
    kubeconfig: str | None = option(None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or "
                                               "in-cluster config)")
    context: str | None = option(None, help="kubeconfig context (default: the current one)")
    api_url: str | None = option(None, help="a plain API server URL instead of a kubeconfig (an API proxy, or an "
                                            "emulator in tests)")
    cache_seconds: float = option(0.5, help="how long one read of the cluster's Jobs and pods serves polls of "
                                            "every rank", min=0, max=60)

    def check(self) -> None:
        """What the declaration cannot check; a ValueError naming the key (a spec error, one line).

        Values that go into the Job verbatim must be what the API server accepts there
        (`diloco_eks.k8s_values`): otherwise a dry run shows a manifest no cluster takes."""
        if self.namespace != dns_label(self.namespace, 63):
            raise ValueError(f"`backend.namespace` {self.namespace!r} is not a valid Kubernetes name "
                             f"(lowercase letters, digits and '-', at most 63)")
        for name, entry in (self.gpu_types or {}).items():
            problem = gpu_type_problem(name, entry)
            if problem:
                raise ValueError(problem)
        instance_types = [t["instance_type"] for t in (self.gpu_types or {}).values()
                          if isinstance(t, dict) and t.get("instance_type") is not None]
        problems = {
            "labels": [k8s_values.labels_problem(self.labels or {})],
            "node_selector": [k8s_values.labels_problem(self.node_selector or {})],
            "gpu_types": [k8s_values.label_value_problem(t) for t in instance_types],  # a node selector value
            "cpu": [self.cpu and k8s_values.quantity_problem(self.cpu)],
            "memory": [self.memory and k8s_values.quantity_problem(self.memory)],
            "service_account": [self.service_account and k8s_values.subdomain_problem(self.service_account)],
            "runtime_class": [self.runtime_class and k8s_values.subdomain_problem(self.runtime_class)],
            "tolerations": [k8s_values.toleration_problem(t) for t in self.tolerations or []],
        }
        for key, found in problems.items():
            problem = next(filter(None, found), None)
            if problem:
                raise ValueError(f"`backend.{key}`: {problem}; Kubernetes would refuse the Job")


def gpu_type_problem(name: str, entry: Any) -> str | None:
    """What is wrong with one `gpu_types` entry, as one line naming `backend.gpu_types.NAME.FIELD`.

    The count becomes the pod's GPU limit as written: a list failed at plan time with a
    TypeError, 1.5 or true became 1 unnoticed, and 10**23 reached the Job. The instance type
    is a node selector value, checked with the other labels."""
    key = f"backend.gpu_types.{name}"
    if not name or ":" in name or not name.isprintable() or any(c.isspace() for c in name):
        return (f"`backend.gpu_types` name {name!r} cannot be asked for with `gpu = \"NAME\"` or \"NAME:N\"; "
                f"use a name without ':' or spaces, e.g. L4")
    if not isinstance(entry, dict):
        return f"`{key}` must be a table, e.g. {{ count = 1, instance_type = \"g6.xlarge\" }}"
    unknown = sorted(set(entry) - set(GPU_TYPE_FIELDS))
    if unknown:
        return f"`{key}.{unknown[0]}` is not a GPU type field (fields: {', '.join(GPU_TYPE_FIELDS)})"
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_GPUS_PER_POD:
        return (f"`{key}.count` must be a whole number of GPUs on one node, from 1 to {MAX_GPUS_PER_POD}, "
                f"got {count!r}")
    instance_type = entry.get("instance_type")
    if instance_type is not None and not isinstance(instance_type, str):
        return f"`{key}.instance_type` must be a string such as \"g6.xlarge\", got {instance_type!r}"
    return None
