"""From the spec's logical GPU ("H100", "A10G:4") to a SageMaker training instance type.

One node of a replica is one instance (a replica of `nodes = K` is one job of K instances of
that type), so the GPU count, which is per node, picks the instance size: a bare name picks the
smallest training instance with that GPU, a count picks the instance with exactly that many.
`[backend] instance_type` overrides the mapping (a new instance family, a CPU instance, a bigger
host for the same GPUs); `processes_fit` refuses more processes on a node than its instance has
GPUs, where the table knows the instance.
"""

from __future__ import annotations

import re

from diloco.errors import UserError

# GPU → {GPUs per instance: training instance type}. SageMaker's training instance list:
# https://aws.amazon.com/sagemaker/pricing/ (the "Training" tab); checked 2026-11.
INSTANCES: dict[str, dict[int, str]] = {
    "H100": {1: "ml.p5.4xlarge", 8: "ml.p5.48xlarge"},
    "H200": {8: "ml.p5en.48xlarge"},
    "A100": {8: "ml.p4d.24xlarge"},
    "A100-80GB": {8: "ml.p4de.24xlarge"},
    "A10G": {1: "ml.g5.xlarge", 4: "ml.g5.12xlarge", 8: "ml.g5.48xlarge"},
    "L4": {1: "ml.g6.xlarge", 4: "ml.g6.12xlarge", 8: "ml.g6.48xlarge"},
    "L40S": {1: "ml.g6e.xlarge", 4: "ml.g6e.12xlarge", 8: "ml.g6e.48xlarge"},
    "T4": {1: "ml.g4dn.xlarge", 4: "ml.g4dn.12xlarge"},
    "V100": {1: "ml.p3.2xlarge", 4: "ml.p3.8xlarge", 8: "ml.p3.16xlarge"},
}
# A bare name whose smallest instance came later than the name's meaning here: `H100` stayed
# ml.p5.48xlarge (one process on it, as the README says) when ml.p5.4xlarge appeared; `H100:1` is that one.
BARE = {"H100": 8}
CPU_INSTANCE = "ml.m5.xlarge"  # a replica with no `gpu` (small models, smoke tests)
_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9-]+\.[a-z0-9-]+$")


def instance_type(gpu: str | None, override: str | None = None) -> str:
    """The training instance for one replica, or a one-line error naming the choices."""
    if override:
        if not _INSTANCE_TYPE.match(override):
            raise UserError(f"[backend] instance_type {override!r} is not a SageMaker instance type "
                            f"(like 'ml.p5.48xlarge')")
        return override
    if not gpu:
        return CPU_INSTANCE
    name, _, count_text = gpu.partition(":")
    sizes = INSTANCES.get(name.strip().upper()) or INSTANCES.get(name.strip())
    if sizes is None:
        raise UserError(f"unknown GPU type {name!r} for SageMaker; use one of {', '.join(INSTANCES)}, or set "
                        f"[backend] instance_type (e.g. 'ml.p5.48xlarge')")
    if not count_text:
        return sizes[BARE.get(name.strip().upper(), min(sizes))]
    if not count_text.strip().isdigit() or int(count_text) not in sizes:
        gpu_name, largest = name.strip().upper(), max(sizes)
        counts = ", ".join(f"{gpu_name}:{n} ({t})" for n, t in sorted(sizes.items()))
        wanted = int(count_text) if count_text.strip().isdigit() else 0
        nodes = (f" (`gpu` is per node: {wanted} × {gpu_name} are nodes = {wanted // largest} of "
                 f"gpu = \"{gpu_name}:{largest}\")") if wanted > largest and wanted % largest == 0 else ""
        raise UserError(f"no SageMaker training instance has {count_text.strip()} × {gpu_name}{nodes}; "
                        f"choose {counts}, or set [backend] instance_type")
    return sizes[int(count_text)]


def processes_fit(instance: str, processes: int) -> None:
    """One line if a node's `processes` outnumber its instance's GPUs (an instance the table
    knows): a process without a GPU of its own would share one, or find none."""
    gpus = gpus_on(instance)
    if gpus is not None and processes > gpus:
        raise UserError(f"processes_per_replica = {processes} is per node, but {instance} has {gpus} "
                        f"GPU{'s' if gpus > 1 else ''}: use at most {gpus} (nodes = K for more processes), or a "
                        f"[backend] instance_type with more GPUs")


def gpus_on(instance: str) -> int | None:
    """How many GPUs an instance type from the table has (None if it is not in the table)."""
    for sizes in INSTANCES.values():
        for n, t in sizes.items():
            if t == instance:
                return n
    return None
