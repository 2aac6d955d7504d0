"""GPUs on EKS: a logical GPU name ("H100", "H100:2") as GPUs per pod and the instance type a
node selector asks for. Its own module, read by the manifest and by the options' checks alike.

A pod runs on one node, so what a node has bounds what a pod may ask: `check_layout` refuses, in
one line saying what to write instead, a pod that asks for more GPUs than its node type has (it
would stay Pending forever), more processes than its GPUs, and a bare name whose filled-in count
would leave GPUs idle (`gpu = "H100"` once asked for all 8 GPUs of a p5.48xlarge and started one
process on them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.errors import UserError

# Logical GPU name -> (GPUs on one node, EKS instance type). Extend with the `gpu_types` option.
GPU_TYPES: dict[str, dict[str, Any]] = {
    "A100": {"count": 8, "instance_type": "p4d.24xlarge"},
    "H100": {"count": 8, "instance_type": "p5.48xlarge"},
    "A10G": {"count": 1, "instance_type": "g5.xlarge"},
    "T4": {"count": 1, "instance_type": "g4dn.xlarge"},
}
GPU_TYPE_FIELDS = ("count", "instance_type")
# GPUs one pod may ask for: more than any instance type has (p5: 8), and the bound of
# `processes_per_replica`, which needs a GPU per process. A count past it is a typo, not a node.
MAX_GPUS_PER_POD = 64
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


@dataclass
class GpuRequest:
    name: str
    count: int  # GPUs each pod asks for
    instance_type: str | None
    node_gpus: int = 0  # GPUs one node of `instance_type` has (the table's count)
    bare: bool = False  # the spec named no count ("H100"): `count` was filled in from the table
    text: str = ""  # as the spec wrote it


def resolve_gpu(gpu: str | None, extra_types: Mapping[str, Mapping[str, Any]] | None = None) -> GpuRequest | None:
    """"H100" → 8 GPUs on p5.48xlarge; "H100:2" → 2 of them; the table is extensible."""
    if not gpu:
        return None
    table = {k.upper(): dict(v) for k, v in {**GPU_TYPES, **dict(extra_types or {})}.items()}
    name, _, count_text = gpu.partition(":")
    entry = table.get(name.upper())
    if entry is None:
        raise UserError(f"gpu {gpu!r} is not a known GPU type (known: {', '.join(sorted(table))}); "
                        f"add it under [backend] gpu_types, e.g. gpu_types = {{ {name} = {{ count = 1, "
                        f"instance_type = \"...\" }} }}")
    node_gpus = int(entry.get("count", 1))
    try:
        count = int(count_text) if count_text else node_gpus
    except ValueError:
        raise UserError(f"gpu {gpu!r}: the count after ':' must be a whole number") from None
    if not 1 <= count <= MAX_GPUS_PER_POD:
        raise UserError(f"gpu {gpu!r}: the count must be from 1 to {MAX_GPUS_PER_POD}")
    return GpuRequest(name.upper(), count, entry.get("instance_type"), node_gpus, bare=not count_text, text=gpu)


def check_layout(gpu: GpuRequest | None, processes: int, nodes: int,
                 node_selector: Mapping[str, str] | None = None) -> None:
    """Refuse a pod layout no node runs as asked, in one line naming what to write instead.

    `processes` and the GPU count are per pod (per node of a replica). The node type's GPU count
    bounds a pod only where the pod lands on that type: a `node_selector` naming another
    instance type takes the table's count out of it."""
    if gpu is None:
        return
    name, per = gpu.name, "per node" if nodes > 1 else "per pod"
    if processes > gpu.count:
        raise UserError(f"processes_per_replica = {processes} needs a GPU per process, but gpu {gpu.text!r} "
                        f"gives each pod {gpu.count}; ask for gpu = \"{name}:{processes}\"")
    chosen = (node_selector or {}).get(INSTANCE_TYPE_LABEL, gpu.instance_type)
    if gpu.instance_type and chosen == gpu.instance_type and gpu.count > gpu.node_gpus:
        more = -(-gpu.count // gpu.node_gpus)
        have = f"{gpu.node_gpus} GPU{'s' if gpu.node_gpus > 1 else ''}"
        raise UserError(f"gpu {gpu.text!r}: a pod runs on one node, and {name} nodes ({gpu.instance_type}) have "
                        f"{have}; ask for at most gpu = \"{name}:{gpu.node_gpus}\" {per} with more nodes "
                        f"(nodes = {nodes * more}), or add a bigger node type under [backend] gpu_types")
    if gpu.bare and gpu.count > processes:
        idle = gpu.count - processes
        node = gpu.instance_type or f"{name} node"
        raise UserError(f"gpu = \"{gpu.text}\" asks for all {gpu.count} GPUs of a {node} "
                        f"but starts {processes} process{'es' if processes > 1 else ''} {per} ({idle} GPUs idle); "
                        f"write gpu = \"{name}:{gpu.count}\" (one process per GPU) or gpu = \"{name}:{processes}\"")

