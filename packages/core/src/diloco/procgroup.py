"""A replica as a process group: how many processes it runs, and the one command that starts them.

On every real GPU backend a replica is a machine with several GPUs, run with DDP or FSDP inside
and DiLoCo across replicas. The L processes of a replica are started by torch's own elastic
launcher (`torch.distributed.run`, i.e. torchrun: single node, `--nproc-per-node L`), which owns
the in-replica rendezvous, signal forwarding and group teardown. Its own restarts stay off
(`--max-restarts 0`): the supervisor owns the restart policy, so each failure is seen and counted
once. Every backend (local, EKS, Modal, SageMaker) builds its command here.

torchrun itself exits 1 whatever killed a worker; `diloco_replica.torchrun` runs torch's launcher
unchanged and exits with the first failed worker's own code instead (78 for a spec or store
mistake, 128+N for signal N), so the supervisor reads the same exit codes with L = 1 or L = 8.

No torch import here: core never imports torch; the command runs inside the replica.
"""

from __future__ import annotations

from .errors import SpecError

TORCHRUN_WRAPPER = "diloco_replica.torchrun"
RUNNER = "diloco.bootstrap.runner"
MAX_PROCESSES = 64


def gpu_count(gpu: str | None) -> int | None:
    """The count in a logical GPU name ("H100:8" → 8; "H100" → None)."""
    if not gpu or ":" not in gpu:
        return None
    text = gpu.partition(":")[2].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def resolve_processes(value: int | None, gpu: str | None, *, source: str = "<spec>") -> int:
    """`processes_per_replica`: as given, else the GPU count of `gpu`, else 1."""
    if value is None:
        return min(gpu_count(gpu) or 1, MAX_PROCESSES)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_PROCESSES:
        raise SpecError(f"{source}: `processes_per_replica` must be a whole number from 1 to {MAX_PROCESSES}, "
                        f"got {value!r}")
    return value


def replica_command(processes: int, *, python: str = "python") -> list[str]:
    """argv that starts one replica: the runner itself, or torchrun over `processes` runners."""
    if processes <= 1:
        return [python, "-m", RUNNER]
    return [python, "-m", TORCHRUN_WRAPPER, "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes),
            "--max-restarts", "0", "--monitor-interval", "0.5", "-m", RUNNER]

