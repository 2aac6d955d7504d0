"""The containers of one start of a training job: one per instance, as SageMaker runs them.

SageMaker runs a job of InstanceCount K on K instances named algo-1 … algo-K on the job's own
network. Each runs the container (ContainerEntrypoint + ContainerArguments) with the job's
Environment and its own /opt/ml, whose input/config/resourceconfig.json names the instance
(`current_host`) and all of them (`hosts`, written in lexicographic order). Each instance's
output is its own log stream (`<job>/<host>-<epoch ms>`).

Here each container is a process group of this machine (its PID 1 the entrypoint) with its own
/opt/ml directory, interpreter and log stream. The first host keeps the job directory's plain
names (`opt-ml`, `container`, `container.log`); another host's carry its name (`opt-ml-algo-2`).

**Host names on one machine.** On SageMaker every instance has an address of its own and the
host names resolve on the job's network; here nothing resolves "algo-2" and every container
shares one loopback, so two jobs' first nodes would both want the same port. So each container
is told where each host's node port (diloco's NODE_PORT on SageMaker) is reached on this machine:
`DILOCO_SAGEMAKER_HOSTS = {"algo-1": "127.0.0.1:<port>", ...}`, a port free here for every host
of every start, which diloco's bootstrap reads in place of `<host>:NODE_PORT` (its only
stand-in hook besides DILOCO_ML_ROOT). What a test on this machine cannot see: two instances
really being two machines (their own NICs, their own failure of the network between them).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from .jobfiles import write_json
from .logship import LogShipper

HOSTS_ENV = "DILOCO_SAGEMAKER_HOSTS"  # the bootstrap's name for it (diloco_sagemaker.bootstrap.HOSTS_ENV)
GROUP_NAME = "homogeneousCluster"  # SageMaker's name for the instance group of a job of one instance type


def host_names(count: int) -> list[str]:
    """The instances of a job as SageMaker names them, in the order resourceconfig.json lists them."""
    return sorted(f"algo-{i}" for i in range(1, count + 1))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reached_at(hosts: list[str]) -> dict[str, str]:
    """Where each host's node port is reached from this machine, for one start of the job."""
    return {host: f"127.0.0.1:{free_port()}" for host in hosts}


def resource_config(host: str, hosts: list[str], instance_type: str) -> dict[str, Any]:
    """/opt/ml/input/config/resourceconfig.json of instance `host`, as SageMaker writes it."""
    return {"current_host": host, "hosts": list(hosts), "current_group_name": GROUP_NAME,
            "current_instance_type": instance_type, "network_interface_name": "eth0",
            "instance_groups": [{"instance_group_name": GROUP_NAME, "instance_type": instance_type,
                                 "hosts": list(hosts)}]}


class Container:
    """One instance's container: its /opt/ml, its output shipped to its log stream, its process group."""

    def __init__(self, jobdir: Path, host: str, first: bool):
        self.host = host
        suffix = "" if first else f"-{host}"
        self.ml = jobdir / f"opt-ml{suffix}"
        self.venv = jobdir / f"container{suffix}"
        self.local_log = jobdir / f"container{suffix}.log"
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._shipper: LogShipper | None = None

    def start(self, argv: list[str], env: dict[str, str], logs: Any, job: str) -> None:
        stream = f"{job}/{self.host}-{int(time.time() * 1000)}"
        self._shipper = LogShipper(logs, stream, self.local_log)
        self.proc = subprocess.Popen([a.replace("/opt/ml", str(self.ml)) for a in argv], env=env, cwd=str(self.ml),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._shipper.pump, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def end(self, grace_seconds: float) -> None:
        """SIGTERM to PID 1 only, then SIGKILL to the whole container after the grace period."""
        assert self.proc is not None
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_seconds
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill_group()

    def kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self) -> int:
        """Wait for PID 1, then the container goes with all it still ran; its exit code (128+N: signal N)."""
        assert self.proc is not None and self._reader is not None and self._shipper is not None
        code = self.proc.wait()
        self.kill_group()
        self._reader.join(timeout=10)
        self._shipper.close()
        return 128 - code if code < 0 else code

    def failure(self) -> str | None:
        """What the container wrote to /opt/ml/output/failure (SageMaker's FailureReason), if anything."""
        path = self.ml / "output" / "failure"
        return path.read_text()[:1024] if path.exists() else None


def record_pids(state_path: Path, state: dict[str, Any], containers: list[Container]) -> None:
    """The containers' PID 1s in state.json: `container_pid` (the first host's) and all by host."""
    state["container_pid"] = containers[0].pid
    state["container_pids"] = {c.host: c.pid for c in containers}
    write_json(state_path, state)
