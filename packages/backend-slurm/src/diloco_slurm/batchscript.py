"""One replica attempt as one Slurm batch job: the script and the sbatch command, built in one place.

`batch_jobs` is what `plan` puts in the dry run and what `submit` sends, byte for byte: the script
(listed line by line, so a dry run reads as the file) goes to `sbatch --parsable` on stdin. The job is one node and one task; a replica of L processes
(`gpu = "H100:8"` → 8) is torchrun over L runners inside it (`diloco.procgroup.replica_command`),
with `--gpus-per-node` asking for the GPUs. A replica of K nodes is one job of K nodes, one
torchrun agent on each, started by `srun` (`diloco_slurm.multinode`).

The script (bash) keeps the replica's story in the run directory, which outlives Slurm's memory
of the job (MinJobAge; `sacct` only where slurmdbd runs): the runner's result file, and `.exit`
holding the replica's exit code (written 143 as soon as a SIGTERM arrives, in case SIGKILL
follows). It runs the replica in the background so that its traps run at once: SIGTERM (a cancel,
a requeue, a preemption, the time limit) is passed on; the preemption signal (`--signal=B:SIG@N`,
delivered to the batch shell up to a minute early) is passed on as a preemption, which the runner
turns into exit 75, unless the job's own time limit is that close: then it is Slurm's time-limit
warning, and the time limit ends the job as TIMEOUT (failed, 124).
"""

from __future__ import annotations

import shlex
from typing import Any

from diloco.inputs import envvars
from diloco.errors import UserError
from diloco.procgroup import gpu_count, replica_command
from diloco.request import LaunchRequest

from . import multinode
from .access import ClusterAccess
from .limits import time_limit
from .options import SlurmOptions

SECRETS_FILE = "secrets.env"
MAX_TIMEOUT = 365 * 86_400  # sbatch --time's range (time_limit's bound): a year


def job_name(run_id: str, rank: int, attempt: int) -> str:
    """The job's name (squeue's NAME): the run, rank and attempt; run ids are [a-z0-9-]."""
    return f"diloco-{run_id}-r{rank}-a{attempt}"


def run_dir(state_dir: str, run_id: str) -> str:
    return f"{state_dir.rstrip('/')}/slurm/{run_id}"


# CPUs a job asks for per GPU when `cpus` is not set: a partition's default is often one CPU per
# job, which leaves torchrun's one process per GPU (and each one's data loading) on a single core.
# Four per GPU fits the common nodes (8 GPUs beside 32 to 128 cores); `cpus` sets it outright.
CPUS_PER_GPU = 4


def default_cpus(options: SlurmOptions, request: LaunchRequest) -> int | None:
    """`--cpus-per-task`: the `cpus` option; with GPUs and no `cpus`, CPUS_PER_GPU per GPU (and at
    least one per process, plus one for the sync beside them); else the partition's (None)."""
    if options.cpus is not None or not request.gpu:
        return options.cpus
    gpus = gpu_count(request.gpu) or 1
    return max(CPUS_PER_GPU * gpus, request.processes_per_replica + 1)


def directives(options: SlurmOptions, request: LaunchRequest, rank: int, stem: str, workdir: str | None,
               minutes: int) -> list[str]:
    signal = options.preemption_signal.removeprefix("SIG")
    lines = [f"--job-name={job_name(request.run_id, rank, request.attempt)}", f"--output={stem}.log",
             *multinode.sbatch_lines(request.nodes), f"--time={minutes}",
             f"--signal=B:{signal}@{options.preemption_notice}", "--requeue", "--open-mode=append"]
    for flag, value in (("partition", options.partition), ("account", options.account), ("qos", options.qos),
                        ("constraint", options.constraint), ("cpus-per-task", default_cpus(options, request)),
                        ("mem", options.memory), ("chdir", workdir)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if request.gpu:
        count = gpu_count(request.gpu) or 1
        lines.append(f"--gpus-per-node={options.gres_type + ':' if options.gres_type else ''}{count}")
    lines.extend(options.sbatch_options)
    return [f"#SBATCH {line}" for line in lines]


# The part of the script after the variables; $stem, $notice_floor and the replica's argv ("$@") are set above it.
# A replica of several nodes puts `multinode.start_lines` between _SUPERVISE and _WAIT and
# `multinode.result_lines` between _WAIT and _END.
_SUPERVISE = r'''
time_left() {  # seconds before the job's time limit (squeue %L: [d-][hh:]mm:ss), large when unlimited
  local left days=0 total=0 part IFS=:
  left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null) || { echo 999999999; return; }
  case $left in ""|*[!0-9:-]*) echo 999999999; return ;; esac
  case $left in *-*) days=${left%%-*}; left=${left#*-} ;; esac
  for part in $left; do total=$((total * 60 + 10#$part)); done
  echo $((days * 86400 + total))
}
on_notice() {
  if [ "$(time_left)" -gt "$notice_floor" ]; then
    echo "diloco: $preempt_signal from Slurm: a preemption; the replica stops and rejoins when relaunched"
    kill -s "${preempt_signal#SIG}" "$child" 2>/dev/null
  else
    echo "diloco: $preempt_signal from Slurm: the job's time limit is near (not a preemption)"
  fi
}
on_term() { echo 143 > "$stem.exit"; kill -TERM "$child" 2>/dev/null; }
trap on_notice "${preempt_signal#SIG}"
trap on_term TERM
rm -f -- "$stem.result.json" "$stem.exit"  # left by this job's run before a requeue
echo "diloco: job $SLURM_JOB_ID on $(hostname) (restart ${SLURM_RESTART_COUNT:-0})"
export DILOCO_RERUN="${SLURM_RESTART_COUNT:-0}"  # a requeued job's run: a new incarnation (diloco.store.presence)
'''
_WAIT = r'''
"$@" &
child=$!
while kill -0 "$child" 2>/dev/null; do wait "$child"; done
wait "$child"
code=$?
'''
_END = r'''
echo "$code" > "$stem.exit"
exit "$code"
'''


def _lines(text: str) -> list[str]:
    return text.strip("\n").splitlines()


def script(options: SlurmOptions, request: LaunchRequest, rank: int, stem: str, secrets_path: str | None,
           workdir: str | None, python: str, minutes: int) -> list[str]:
    """The batch script of one rank (its time limit `minutes`): #SBATCH lines, the setup lines, the
    replica's variables, the replica."""
    env = request.replica_env(rank)
    env.update({envvars.ENV_RESULT_PATH: f"{stem}.result.json", envvars.ENV_STARTED_PATH: f"{stem}.started.json",
                envvars.ENV_PREEMPTION_SIGNAL: options.preemption_signal})
    lines = ["#!/bin/bash", *directives(options, request, rank, stem, workdir, minutes),
             f"# diloco run {request.run_id}, rank {rank}, attempt {request.attempt}"
             + (f", {request.nodes} nodes" if request.nodes > 1 else ""), *options.setup]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    if workdir:
        lines.append(f'export PYTHONPATH={shlex.quote(workdir)}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    if secrets_path:  # the values stay in a 0600 file: a batch script is kept by slurmctld and shown to admins
        lines.append(f"set -a; . {shlex.quote(secrets_path)}; set +a")
    argv = replica_command(request.processes_per_replica, request.nodes, python=python)
    lines += [f"stem={shlex.quote(stem)}", f"preempt_signal={options.preemption_signal}",
              f"notice_floor={options.preemption_notice + 60}", f"set -- {shlex.join(argv)}", *_lines(_SUPERVISE)]
    if request.nodes <= 1:
        return lines + _lines(_WAIT) + _lines(_END)
    start = multinode.start_lines(request.nodes, default_cpus(options, request), options.preemption_signal)
    return lines + start + _lines(_WAIT) + multinode.result_lines(request.nodes, rank, request.attempt) + _lines(_END)


def script_text(lines: list[str]) -> str:
    """The batch script as sbatch reads it from the plan's lines."""
    return "\n".join(lines) + "\n"


def secrets_file(values: dict[str, str]) -> str:
    """The run's secrets as `NAME='value'` lines for the script to source (names are checked by `Secrets`)."""
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in sorted(values.items()))


def batch_jobs(options: SlurmOptions, access: ClusterAccess, request: LaunchRequest, *, default_state_dir: str,
               default_python: str, max_minutes: int | None = None, max_nodes: int | None = None) -> dict[str, Any]:
    """The plan body: the run directory, the secrets file (names only), the jobs' time limit inside
    the partition's MaxTime `max_minutes` (`diloco_slurm.limits`) and, per rank, the exact sbatch
    command and the script it reads on stdin. A replica's nodes must fit the partition's `max_nodes`."""
    if options.host and not options.state_dir:
        raise UserError("[backend] state_dir is needed with host: an absolute directory on the cluster's shared "
                        "filesystem (e.g. /home/you/diloco) for the jobs' logs and result files")
    if request.timeout > MAX_TIMEOUT:
        raise UserError(f"timeout = {request.timeout:g} s is longer than a Slurm job can run here (a year at most); "
                        f"set a shorter timeout (the job's --time is derived from it)")
    if options.ssh_config and not options.host:
        raise UserError("[backend] ssh_config only applies with host = \"user@login\"; set host or drop ssh_config")
    multinode.check(request, max_nodes, options.partition)
    limit = time_limit(options.time_limit, request.timeout, options.preemption_notice, max_minutes, options.partition)
    directory = run_dir(options.state_dir or default_state_dir, request.run_id)
    workdir = options.workdir or (None if options.host else request.workdir)
    python = options.python or (default_python if not options.host else "python3")
    secrets_path = f"{directory}/{SECRETS_FILE}" if request.secrets else None
    command = access.argv(access.slurm("sbatch", "--parsable"))
    jobs = []
    for rank in request.ranks:
        stem = f"{directory}/rank-{rank}.attempt-{request.attempt}"
        jobs.append({"rank": rank, "job_name": job_name(request.run_id, rank, request.attempt), "stem": stem,
                     "command": command,
                     "script": script(options, request, rank, stem, secrets_path, workdir, python, limit.minutes)})
    return {"cluster": access.where, "run_dir": directory,
            "time_limit": {"minutes": limit.minutes, "partition_max": max_minutes,
                           **({"note": limit.note} if limit.note else {})},
            "secrets_file": {"path": secrets_path, "names": sorted(request.secrets)} if secrets_path else None,
            "jobs": jobs}
