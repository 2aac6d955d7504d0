"""The slurm backend's `[backend]` options: declared once (`SlurmOptions`), each value checked here.

Types, bounds and choices are checked by core from the declaration (`diloco.options`); each
`check=` below refuses what Slurm or the shell would read differently from what was meant. Every
value lands in a batch script or a command line, so names are held to the characters Slurm's own
names use (partition, account, QOS and cluster names are plain words in slurm.conf and sacctmgr;
job names are built here from the run id), paths must be absolute, and nothing may hold a newline,
which would start a new `#SBATCH` directive or shell command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from diloco.options import option

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # slurm.conf / sacctmgr entity names
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # never a leading "-"
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.&|,:*()\[\]!-]+$")  # sbatch --constraint's feature expressions
_MEMORY = re.compile(r"^[1-9][0-9]*[KMGT]?$")  # sbatch --mem: a size with Slurm's unit suffixes
_SBATCH_FLAG = re.compile(r"^(--[a-z][a-z-]*)(?:=([^\s'\"\\;`$]+))?$")

# Extra `#SBATCH` lines a spec may add (`sbatch_options`): the ones that place or label a job.
# Everything diloco sets itself (output, job name, nodes, tasks, time, signal, requeue, export,
# chdir, array, dependency) is refused: the backend's status and relaunch depend on those values.
EXTRA_SBATCH = ("--exclusive", "--nodelist", "--exclude", "--reservation", "--gres", "--gpus-per-task",
                "--mem-per-gpu", "--cpus-per-gpu", "--licenses", "--comment", "--wckey", "--mail-type",
                "--mail-user", "--nice", "--hint", "--tmp", "--core-spec", "--switches", "--network")
PREEMPTION_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT")  # SIGTERM is Slurm's cancel and requeue
MAX_NOTICE = 65535  # sbatch --signal's largest sig_time


def _name(value: str | None) -> str | None:
    return None if value is None or _NAME.match(value) else \
        "must be a Slurm name: letters, digits, '_', '.', '-' (up to 64, not starting with a symbol)"


def _path(value: str | None) -> str | None:
    if value is None:
        return None
    return None if value.startswith("/") and not any(c in value for c in "\n\r\0") else \
        "must be an absolute path (on the cluster) without newlines"


def _host(value: str | None) -> str | None:
    return None if value is None or _HOST.match(value) else \
        "must read 'user@login.example.edu' or an ssh config Host alias"


def _constraint(value: str | None) -> str | None:
    return None if value is None or _CONSTRAINT.match(value) else \
        "must be a Slurm feature expression such as 'a100&ib' (no spaces or quotes)"


def _memory(value: str | None) -> str | None:
    return None if value is None or _MEMORY.match(value) else "must be a size such as '64G' or '8000M'"


def _lines(value: list[str]) -> str | None:
    bad = [line for line in value if any(c in line for c in "\n\r\0")]
    return f"lines must not hold newlines: {bad[0]!r}; give one list item per line" if bad else None


def _sbatch_options(value: list[str]) -> str | None:
    for item in value:
        m = _SBATCH_FLAG.match(item)
        if not m or m.group(1) not in EXTRA_SBATCH:
            return (f"{item!r} is not an allowed #SBATCH option; allowed: {', '.join(EXTRA_SBATCH)} "
                    f"as '--flag' or '--flag=value' (no spaces or quotes)")
    return None


def _gres_type(value: str | None) -> str | None:
    return None if value is None or re.match(r"^[a-z0-9][a-z0-9_.-]{0,31}$", value) else \
        "must be the site's GPU type as its gres.conf names it, e.g. 'h100' (lowercase, digits, '_', '.', '-')"


@dataclass(frozen=True)
class SlurmOptions:
    """The slurm backend's `[backend]` options (the README's "On Slurm" says what each maps to)."""

    partition: str | None = option(None, help="sbatch --partition (default: the cluster's default)", check=_name)
    account: str | None = option(None, help="sbatch --account", check=_name)
    qos: str | None = option(None, help="sbatch --qos", check=_name)
    time_limit: int | None = option(None, help="sbatch --time in minutes (default: the spec's timeout plus the "
                                               "preemption notice and a minute)", min=1, max=525_600)
    constraint: str | None = option(None, help="sbatch --constraint (node features, e.g. 'a100&ib')",
                                    check=_constraint)
    cpus: int | None = option(None, help="sbatch --cpus-per-task (default: 4 per GPU asked for, at least one per process "
                                                "and one more; without GPUs the partition's)", min=1, max=4096)
    memory: str | None = option(None, help="sbatch --mem per node, e.g. '64G' (default: the partition's)",
                                check=_memory)
    gres_type: str | None = option(None, help="the GPU type in --gpus-per-node=TYPE:N as the site names it "
                                              "(default: any GPU)", check=_gres_type)
    sbatch_options: list[str] = option([], help="extra #SBATCH lines, only from the allowed list "
                                                "(--exclusive, --reservation, --gres, ...)", check=_sbatch_options)
    setup: list[str] = option([], help="shell lines run in the job before the replica starts "
                                       "('module load cuda/12.4', 'source ~/venv/bin/activate')", check=_lines)
    python: str | None = option(None, help="the Python the job runs diloco with (default: this one's path "
                                           "without `host`, python3 with it)", check=lambda v: _lines([v or ""]))
    workdir: str | None = option(None, help="the directory the job starts in and puts first on PYTHONPATH "
                                            "(default: the spec's directory without `host`)", check=_path)
    state_dir: str | None = option(None, help="a directory on the cluster's shared filesystem for the jobs' "
                                              "logs, result files and the run's 0600 secrets file (default: "
                                              "diloco's state dir; required with `host`)", check=_path)
    slurm_conf: str | None = option(None, help="SLURM_CONF for every Slurm command (a second cluster's config)",
                                    check=_path)
    cluster: str | None = option(None, help="sbatch/squeue/scontrol/scancel -M: a cluster of a multi-cluster "
                                            "(slurmdbd) site", check=_name)
    host: str | None = option(None, help="run every Slurm command and file read over your own ssh on this "
                                         "login host ('user@login.example.edu'); nothing is stored", check=_host)
    ssh_config: str | None = option(None, help="an ssh config file (ssh -F) for `host`: port, key, known hosts",
                                    check=_path)
    preemption_signal: str = option("SIGUSR1", help="the signal Slurm sends before preempting or ending a job "
                                                    "(sbatch --signal=B:SIG@notice); the replica exits 75 on it",
                                    choices=PREEMPTION_SIGNALS)
    preemption_notice: int = option(120, help="seconds of notice the signal comes with (sbatch --signal @N)",
                                    min=1, max=MAX_NOTICE)
