"""A replica as a process group: how many nodes and processes it runs, and the command that starts them.

On every real GPU backend a replica is an island: one machine with several GPUs, or K machines
(`nodes = K`) on the platform's fast network, run with DDP or FSDP inside and DiLoCo across
replicas. Its K × P processes (P = `processes_per_replica`, per node) are started by torch's own
elastic launcher (`torch.distributed.run`, i.e. torchrun, one agent per node), which owns the
in-replica rendezvous, signal forwarding and group teardown. Its own restarts stay off
(`--max-restarts 0`): the supervisor owns the restart policy, so each failure is seen and counted
once. Every backend builds its command here.

Across nodes the rendezvous is torch's static one: the replica's first node (node rank 0) hosts
torch's TCP store and every node joins it knowing its own node rank, so node r runs the
replica's processes r·P … r·P + P − 1 and lane k always lives on node k // P. The platform says
which node is which: each backend gives every node `node_env(node_rank, first_node)` (torchrun
reads PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT as its own flags), from what the
platform tells it (Slurm's node list, SageMaker's resourceconfig.json, a Job's completion index,
Modal's cluster info, loopback locally). No rendezvous service of diloco's own.

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
MAX_NODES = 64
NODE_PORT = 29400  # torch's store on a replica's first node (torchrun's own default 29500 is left to users)
NODE_JOIN_TIMEOUT_S = 600  # how long the nodes of a replica wait for each other before the replica fails


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


def resolve_nodes(value: int | None, *, source: str = "<spec>") -> int:
    """`nodes` (machines per replica): as given, else 1."""
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_NODES:
        raise SpecError(f"{source}: `nodes` must be a whole number from 1 to {MAX_NODES}, got {value!r}")
    return value


def check_layout(processes: int, gpu: str | None, *, source: str = "<spec>") -> None:
    """Refuse more processes on a node than the node has GPUs: `gpu` and `processes_per_replica`
    are both per node, and a process without its own GPU would share one (or fail to find one)."""
    gpus = gpu_count(gpu)
    if gpus is not None and processes > gpus:
        raise SpecError(f"{source}: processes_per_replica = {processes} is per node, but gpu = {gpu!r} gives each "
                        f"node {gpus} GPU{'s' if gpus > 1 else ''}; for more processes use more nodes "
                        f"(nodes = {-(-processes // gpus)} with processes_per_replica = {gpus}), or drop "
                        f"processes_per_replica (default: one process per GPU)")


def node_env(node_rank: int, first_node: str, port: int = NODE_PORT) -> dict[str, str]:
    """What node `node_rank` of a multi-node replica needs beside the replica's environment: its
    rank and where the first node's store listens, as torchrun's own variables."""
    return {"PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": first_node, "PET_MASTER_PORT": str(port)}


def replica_command(processes: int, nodes: int = 1, *, python: str = "python") -> list[str]:
    """argv that starts one replica's node: the runner itself, or torchrun over `processes`
    runners; with `nodes` > 1 every node runs it, given `node_env` by its platform."""
    if processes <= 1 and nodes <= 1:
        return [python, "-m", RUNNER]
    tail = ["--max-restarts", "0", "--monitor-interval", "0.5", "-m", RUNNER]
    if nodes <= 1:
        return [python, "-m", TORCHRUN_WRAPPER, "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes),
                *tail]
    return [python, "-m", TORCHRUN_WRAPPER, "--nnodes", str(nodes), "--nproc-per-node", str(processes),
            "--rdzv-backend", "static", "--rdzv-conf", f"timeout={NODE_JOIN_TIMEOUT_S}", *tail]

