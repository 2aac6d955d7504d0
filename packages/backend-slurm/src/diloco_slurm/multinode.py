"""A replica of K nodes (`nodes = K`) as one Slurm job: K machines, one torchrun agent on each.

Why one job and not K: Slurm places a job's nodes together (one allocation, one `--time`, one
requeue) and ends the job as a whole, which is what a replica whose processes form one torch group
needs: a node lost is the replica lost, and the replica comes back as one attempt. So the job asks
for `--nodes=K --ntasks-per-node=1` and its batch shell, on the first node of the allocation,
starts the replica with one `srun` step of K tasks, one per node, each running the node command
(`diloco.procgroup.replica_command(P, K)`) with what `diloco.procgroup.node_env` names:

- PET_NODE_RANK: the node's place in the job (SLURM_NODEID, 0 for the first node);
- PET_MASTER_ADDR: the first node of the job's node list (`scontrol show hostnames`), as Slurm
  itself reaches it (its NodeAddr, which defaults to the name), where node 0 hosts torch's store;
- PET_MASTER_PORT: a port derived from the job id (`PORT_BASE`, below).

`--kill-on-bad-exit=1` makes one task's failure end the step: Slurm sends the other nodes SIGTERM
(their agents stop their processes) and SIGKILL after KillWait. Each node's wrapper writes its own
result (`<stem>.node-R.result.json`, by `diloco_replica.torchrun`) and exit code beside it, and the
first node to fail claims `<stem>.first-failed-node` (an O_EXCL create, atomic on NFS too). The
batch shell then writes the replica's one result where the executor reads it: node 0's on success,
else the first failed node's (or, when its agent died without one, a line naming the node and how
it died), and the replica's `.exit` as a one-node job does. The run directory is on the cluster's
shared filesystem (`state_dir`), so every node writes there.

A node failure Slurm sees (NODE_FAIL) ends the whole job: it is requeued (`--requeue`, the same job
id, pending, no budget spent) or reads failed (137) and is relaunched as a new job; a task's death
ends the job with that node's exit code. Either way the replica is relaunched as one unit, once.
"""

from __future__ import annotations

import shlex

from diloco.errors import UserError
from diloco.procgroup import gpu_count
from diloco.request import LaunchRequest

# The port of torch's store on node 0: PORT_BASE + job id % PORT_SPAN. Jobs of several users may
# share a node (a partition that is not exclusive, 4-GPU replicas on 8-GPU nodes), so a fixed port
# (diloco's NODE_PORT, torchrun's 29500) would make the second replica whose first node is that
# node fail to bind. Job ids are unique and increase, so two jobs running on one node at once get
# the same port only when their ids are a multiple of 10000 apart, and even then the cost is one
# failed attempt: its relaunch is a new job, with a new id and so a new port. The range stays
# below Linux's ephemeral ports (32768 and up, where outgoing connections take theirs) and needs no
# process to find a free port first (which another could take before torch binds it).
PORT_BASE = 20000
PORT_SPAN = 10000
FIRST_FAILED = "first-failed-node"  # <stem>.first-failed-node: the node that failed first


def node_task(preemption_signal: str) -> str:
    """Each node's task: its node rank and result path, then the node command ("$@"). It records
    how its node ended and, on a failure, claims FIRST_FAILED if no node has. A trap keeps this
    shell alive through the preemption signal (srun passes it to every task; the agent acts on it);
    SIGTERM (a cancel, or srun stopping the step after another node failed) ends it unrecorded."""
    return ('stem=$1; shift; node=$SLURM_NODEID; '
            'export PET_NODE_RANK="$node" DILOCO_RESULT_PATH="$stem.node-$node.result.json"; '
            f'trap : {preemption_signal.removeprefix("SIG")}; "$@"; code=$?; echo "$code" > "$stem.node-$node.exit"; '
            f'[ "$code" = 0 ] || (set -C; echo "$node" > "$stem.{FIRST_FAILED}") 2>/dev/null; exit "$code"')


def sbatch_lines(nodes: int) -> list[str]:
    """The job's shape: one node and one task, or K nodes with one task (a torchrun agent) on each."""
    return ["--nodes=1", "--ntasks=1"] if nodes <= 1 else [f"--nodes={nodes}", "--ntasks-per-node=1"]


def check(request: LaunchRequest, max_nodes: int | None, partition: str | None) -> None:
    """Refuse in one line what Slurm would refuse late or never run: more nodes than the partition
    has or lets a job use (`max_nodes`, from `scontrol show partition`; None: not known here), or
    more processes on a node than the node's GPUs."""
    where = f"partition {partition!r}" if partition else "the cluster's default partition"
    if max_nodes is not None and request.nodes > max_nodes:
        raise UserError(f"nodes = {request.nodes} is more than {where} gives one job ({max_nodes}): Slurm would "
                        f"refuse the jobs or keep them pending for ever; use nodes <= {max_nodes} or another partition")
    gpus = gpu_count(request.gpu)
    if gpus is not None and request.processes_per_replica > gpus:
        raise UserError(f"processes_per_replica = {request.processes_per_replica} is per node, but gpu = "
                        f"{request.gpu!r} asks for {gpus} GPU{'s' if gpus > 1 else ''} per node "
                        f"(--gpus-per-node); use processes_per_replica <= {gpus}, or more nodes")


def start_lines(nodes: int, cpus: int | None, preemption_signal: str) -> list[str]:
    """Shell lines that put the node command ("$@") on every node of the job (after the traps,
    before `"$@" &`): node 0's address and port for every node, and `set --` to the srun that
    starts one task per node."""
    # The step gets the job's whole node: its GPUs (a step has all of the job's by default), all
    # its memory (--mem=0; without it a partition's DefMemPerCPU may size, and cgroups cap, the step
    # below the job's --mem) and its CPUs (Slurm 22.05's srun no longer takes --cpus-per-task from
    # the job: said again).
    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--mem=0"]
    if cpus is not None:
        srun.append(f"--cpus-per-task={cpus}")
    return [
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)  # where this batch shell runs',
        '[ -n "$first_node" ] || first_node=$(hostname)  # (no scontrol on the node: this one is the first)',
        'first_addr=$(scontrol show node -o "$first_node" 2>/dev/null | grep -o " NodeAddr=[^ ]*" | cut -d= -f2)',
        f'export PET_MASTER_ADDR="${{first_addr:-$first_node}}" '
        f'PET_MASTER_PORT=$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))',
        f'rm -f -- "$stem".node-* "$stem.{FIRST_FAILED}"  # left by this job\'s run before a requeue',
        f'echo "diloco: {nodes} nodes ($SLURM_JOB_NODELIST); node 0 ($first_node) holds the replica\'s store at '
        f'$PET_MASTER_ADDR:$PET_MASTER_PORT"',
        f'set -- {shlex.join(srun)} bash -c {shlex.quote(node_task(preemption_signal))} node "$stem" "$@"',
    ]


def result_lines(nodes: int, rank: int, attempt: int) -> list[str]:
    """Shell lines run once the step has ended ($code: srun's exit): the replica's exit code and
    result file from its nodes', as `diloco.local.island` does on one machine."""
    error = (f"node %s of {nodes} %s (its torchrun agent reported no result); Slurm stopped the replica's "
             f"other nodes")
    record = ('{"rank": %s, "attempt": %s, "status": "failed", "exit_code": %s, "error": "' + error + '"}')
    return [
        f'step=$code node=; failed=$(cat "$stem.{FIRST_FAILED}" 2>/dev/null)',
        'if [ -n "$failed" ]; then node=$failed; code=$(cat "$stem.node-$node.exit" 2>/dev/null)',
        'elif [ "$code" = 0 ]; then node=0; fi',
        'case $code in ""|*[!0-9]*) code=$step ;; esac  # its exit file not readable (yet): srun\'s',
        'if [ -n "$node" ] && [ -s "$stem.node-$node.result.json" ]; then',
        '  cp -- "$stem.node-$node.result.json" "$stem.result.json.tmp" && mv -f -- "$stem.result.json.tmp" '
        '"$stem.result.json"',
        'elif [ -n "$failed" ]; then',
        '  how="exited with code $code"',
        '  [ "$code" -gt 128 ] && sig=$(kill -l $((code - 128)) 2>/dev/null) && how="killed by SIG$sig"',
        f'  printf {shlex.quote(record)} {rank} {attempt} "$code" "$node" "$how" > "$stem.result.json.tmp" && '
        f'mv -f -- "$stem.result.json.tmp" "$stem.result.json"',
        'fi',
    ]
