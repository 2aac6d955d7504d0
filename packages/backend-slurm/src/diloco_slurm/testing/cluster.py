"""A real Slurm cluster for tests: slurmctld + slurmd on ports the OS picked, state in a temp dir.

Debian's Slurm 22.05 packages (slurmctld, slurmd, slurm-client) run without systemd or munge with
`auth/none` and `cred/none`; `proctrack/pgid` (linuxproc leaves orphans), `task/none`, and
`cons_tres` with `CR_Core_Memory` + `DefMemPerCPU` (without it each job takes all the memory and jobs
run one at a time). Two partitions: `debug` (the default, no time limit) and `short` (MaxTime 2
minutes, for the plan's limits). No accounting: `sacct` is absent, as on many test clusters, so the backend's
fallbacks (scontrol, then the run directory) are what is tested. Every daemon is stopped by its pid.
Two clusters run side by side, each with its own `SLURM_CONF`. The daemons run as the user running
the tests (root on this project's machines; slurmd needs root to start jobs as other users, which
these tests never do).

A cluster of several nodes (`nodes=2`, for replicas of several nodes) runs one slurmd per node on
this one machine: Slurm's multiple-slurmd mode, which Debian's build has (`slurmd -N NAME`; each
node its own `Port`, all at 127.0.0.1). The nodes are named n1, n2, ... and Slurm reaches each at
its NodeAddr, 127.0.0.1, as a job's first node is reached by the others. One machine is all of
them: what a job on two of them shares (a filesystem, the loopback network) is what a real
cluster's nodes share (the shared filesystem, the cluster network).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_installed() -> bool:
    return all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS) and bool(shutil.which("sbatch"))


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    """One cluster's files and daemons; `env` is what a Slurm client command needs to reach it."""

    root: Path
    name: str
    nodes: int = 1  # slurmd daemons, each a node of `cpus` CPUs and `memory_mb` (several: n1, n2, ...)
    cpus: int = 8
    memory_mb: int = 8192
    min_job_age: int = 300
    pids: dict[str, int] = field(default_factory=dict)
    up_seconds: float | None = None  # from starting slurmctld to the node answering idle
    first_job_seconds: float | None = None  # from the first sbatch to that job running (a cold start)
    # slurmd's spool holds each job step's Unix socket, whose path may not pass 108 bytes: kept short,
    # under the system's temp directory, whatever the depth of `root` (a pytest-xdist worker's is deep)
    spool: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="slurmd-")))

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        r = self.root
        for d in ("state", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        self.conf.write_text(f"""ClusterName={self.name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={getpass.getuser()}
SlurmdUser={getpass.getuser()}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={r}/state
SlurmdSpoolDir={self.spool}/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MinJobAge={self.min_job_age}
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{self._node_lines(host)}
PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes={",".join(self.node_names)} MaxTime=2 State=UP
""")

    @property
    def node_names(self) -> list[str]:
        return [socket.gethostname()] if self.nodes <= 1 else [f"n{i + 1}" for i in range(self.nodes)]

    def _node_lines(self, host: str) -> str:
        size = f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
        if self.nodes <= 1:
            return f"NodeName={host} NodeAddr=127.0.0.1 {size}"
        return "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} {size}"
                         for name in self.node_names)

    def start(self, timeout: float = 60.0) -> None:
        self.write_conf()
        began = time.monotonic()
        env = self.env
        log = open(self.root / "log" / "daemons.out", "ab")  # noqa: SIM115 - kept open by the daemons
        slurmds = [("slurmd", ["-D"])] if self.nodes <= 1 else \
            [(f"slurmd {name}", ["-D", "-N", name]) for name in self.node_names]
        for key, args in (("slurmctld", ["-D", "-i"]), *slurmds):
            proc = subprocess.Popen([_daemon(key.split()[0]), *args], env=env, stdout=log, stderr=log,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.pids[key] = proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%t"], env=env, capture_output=True,
                                 text=True)
            states = out.stdout.split()  # one per node: every slurmd has registered
            if out.returncode == 0 and len(states) == self.nodes and set(states) <= {"idle", "mix", "alloc"}:
                self.up_seconds = time.monotonic() - began
                self.first_job_seconds = self._first_job(deadline)
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Slurm cluster {self.name} did not come up in {timeout}s; see {self.root}/log")

    def _first_job(self, deadline: float) -> float:
        """Run a job that does nothing and time it until it leaves PENDING: the cluster's cold start."""
        began = time.monotonic()
        job = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap=true"], env=self.env, check=True,
                             capture_output=True, text=True).stdout.strip()
        while time.monotonic() < deadline:
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=self.env, capture_output=True,
                                   text=True).stdout.strip()
            if state != "PENDING":
                return time.monotonic() - began
            time.sleep(0.05)
        raise RuntimeError(f"Slurm cluster {self.name}: its first job never started; see {self.root}/log")

    def stop(self) -> None:
        """SIGTERM each daemon by pid (the slurmds first), SIGKILL what outlives a grace period."""
        for name in sorted(self.pids, key=lambda key: key == "slurmctld"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        shutil.rmtree(self.spool, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:  # a cluster that did not come up stops what it started: no daemon outlives it
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def release(self, job_id: str) -> None:
        """End the ~120 s BeginTime hold Slurm puts on a requeued job."""
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=self.env, check=True,
                       capture_output=True)


def job_processes(stem: str) -> list[int]:
    """A replica job's processes on this machine's cluster: the replica (its environment names the
    attempt's result file) and the batch shell that started it, so a test can SIGKILL the job whole
    (or SIGSTOP it)."""
    found: set[int] = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"DILOCO_RESULT_PATH={stem}.result.json".encode() not in f.read():
                    continue
            found.add(int(entry))
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{parent}/cmdline", "rb") as f:
                if b"slurm_script" in f.read():
                    found.add(parent)
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def node_agent(stem: str, node: int) -> int | None:
    """The torchrun agent of node `node` of a replica of several nodes (its environment names the
    node's own result file, `diloco_slurm.multinode`), so a test can kill one node's agent; None
    before it runs."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"diloco_replica.torchrun" not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"DILOCO_RESULT_PATH={stem}.node-{node}.result.json\0".encode() in f.read():
                    return int(entry)
        except OSError:
            continue
    return None
