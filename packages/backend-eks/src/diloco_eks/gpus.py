"""GPUs on EKS: a logical GPU name ("H100", "H100:2") as GPUs per pod and the instance type a
node selector asks for. Its own module, read by the manifest and by the options' checks alike."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.errors import UserError

# Logical GPU name -> (GPUs per node, EKS instance type). Extend with the `gpu_types` option.
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


@dataclass
class GpuRequest:
    name: str
    count: int
    instance_type: str | None


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
    try:
        count = int(count_text) if count_text else int(entry.get("count", 1))
    except ValueError:
        raise UserError(f"gpu {gpu!r}: the count after ':' must be a whole number") from None
    if not 1 <= count <= MAX_GPUS_PER_POD:
        raise UserError(f"gpu {gpu!r}: the count must be from 1 to {MAX_GPUS_PER_POD}")
    return GpuRequest(name.upper(), count, entry.get("instance_type"))
