"""`python -m diloco_modal.testing.cluster DIR`: one call of a clustered function in the fake
Modal cloud, K containers and one input.

What Modal documents for `@modal.clustered(size=K)` (`modal.experimental.clustered` before 1.6):
the K containers are scheduled together, all or nothing; the input is broadcast to every
container; only rank 0's output is returned. Each container learns its rank and the cluster's
addresses, ordered by rank, from its cluster info, which Modal's runtime sets in the SDK before the
function's body runs (`call` does it here, from the container's spec).

A lost container, as the fake plays it (the strictest reading: the call is one unit): a container
whose input fails (the body raised) or that dies (killed, OOM-killed) fails the call with that
container's exception, and the other containers are ended at once; the call succeeds when rank
0's input returns, and the other containers then have the grace period to end by themselves.
Restarting a clustered input (a preemption) is not modelled: `FakeModal.preempt` refuses a
cluster, and a container whose input asks for a restart (KeyboardInterrupt) fails the call and is
written to unimplemented.jsonl, so the test fails loudly.

This process leads the cluster: its K containers run in its process group, so terminate, cancel
and a timeout end them all with it; `FakeModal.kill(call, node=r)` kills container r's whole
process tree. Every container here shares this machine's loopback, where the first containers of
two clusters cannot both listen on one port: each cluster gets a free port of its own, in
`diloco_modal.cluster.SHARED_HOST_PORT_ENV` (on Modal each container has its own address).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cluster import SHARED_HOST_PORT_ENV
from .container import container_env, pump
from .store import ROOT_ENV, Store, append_jsonl, new_id, read_json, write_exit, write_json

POLL_S = 0.05


@dataclass
class Member:
    rank: int
    home: Path  # DIR/nodes/<rank>: its spec, outcome and filesystem
    proc: subprocess.Popen
    task_id: str
    pumps: list[threading.Thread] = field(default_factory=list)

    def outcome(self) -> dict[str, Any]:
        """How its input ended: what `call` wrote, or, for a container that died, its exit code."""
        code = self.proc.returncode if self.proc.returncode >= 0 else 128 - self.proc.returncode
        return read_json(self.home / "outcome.json") or {"status": "failure", "died": code,
                                                         "exception": f"container exited with code {code}"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (what dies with a container)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _start(obj: Path, spec: dict[str, Any], rank: int, port: int) -> Member:
    node = obj / "nodes" / str(rank)
    fs = node / "fs"
    write_json(node / "spec.json", {**spec, "cluster": {**spec["cluster"], "rank": rank}})
    env = {**container_env(spec, fs), SHARED_HOST_PORT_ENV: str(port)}
    cwd = str(fs / "root") if (fs / "root").is_dir() else str(fs)
    proc = subprocess.Popen([sys.executable, "-m", "diloco_modal.testing.call", str(node)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    member = Member(rank, node, proc, new_id("ta"))
    task = {"task_id": member.task_id, "input_id": spec.get("input_id", "")}
    member.pumps = [threading.Thread(target=pump, args=(s, fd, obj / "logs.jsonl", task, hash((member.task_id, fd))))
                    for s, fd in ((proc.stdout, 1), (proc.stderr, 2))]
    for t in member.pumps:
        t.start()
    return member


def _end_all(members: list[Member]) -> None:
    """The cluster is over: its output flushed, every container's processes killed (this one's too)."""
    for m in members:
        for t in m.pumps:
            t.join(timeout=2 if m.proc.poll() is not None else 0)
    os.killpg(0, signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL to its own group ends this process too


def run_cluster(obj: Path, spec: dict[str, Any], grace: float) -> int:
    """Run the call's K containers to the call's end (see the module docstring)."""
    size = int(spec["cluster_size"])
    port = free_port()
    members = [_start(obj, spec, rank, port) for rank in range(size)]
    write_json(obj / "container.json", {
        "pid": os.getpid(), "task_id": members[0].task_id, "input_id": spec.get("input_id", ""),
        "workload_pid": members[0].proc.pid,
        "members": [{"rank": m.rank, "task_id": m.task_id, "address": spec["cluster"]["container_ips"][m.rank],
                     "workload_pid": m.proc.pid} for m in members]})
    timeout = spec.get("timeout")
    deadline = time.monotonic() + float(timeout) if timeout else None
    ended: list[Member] = []  # in the order they were seen to end
    while True:
        if (obj / "exit.json").exists():  # terminated or cancelled (the server killed this group too)
            _end_all(members)
        if (deadline is not None and time.monotonic() > deadline) or (obj / "expire").exists():
            write_exit(obj, "timeout", 124)
            _end_all(members)
        ended += [m for m in members if m not in ended and m.proc.poll() is not None]
        failed = [m for m in ended if m.outcome()["status"] != "success"]
        if failed:
            return _fail(obj, members, failed[0], size)
        if members[0] in ended:
            for t in members[0].pumps:
                t.join(timeout=2)
            write_exit(obj, "success", 0)  # rank 0's output is the call's
            stop = time.monotonic() + grace
            while time.monotonic() < stop and any(m.proc.poll() is None for m in members):
                time.sleep(POLL_S)
            _end_all(members)
        time.sleep(POLL_S)


def _fail(obj: Path, members: list[Member], failed: Member, size: int) -> int:
    """One container's input failed or the container died: the call fails with its exception,
    and the cluster's other containers are ended."""
    outcome = failed.outcome()
    for t in failed.pumps:
        t.join(timeout=2)
    if outcome["status"] == "interrupted":
        append_jsonl(Path(os.environ[ROOT_ENV]) / "unimplemented.jsonl", {"rpc": "restarting a clustered input"})
    code = outcome.get("died", 1)
    exception = outcome.get("exception", "")
    if "died" in outcome:
        exception = (f"container {failed.rank} of the cluster's {size} (task {failed.task_id}) exited with code "
                     f"{code}; the cluster's other containers were stopped")
    write_exit(obj, "failure", code, exception=exception, traceback=outcome.get("traceback", ""), node=failed.rank)
    _end_all(members)
    return code


def main(obj: Path) -> int:
    grace = float(Store(os.environ[ROOT_ENV]).config.get("grace_seconds", 5.0))
    return run_cluster(obj, read_json(obj / "spec.json"), grace)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notice is for the containers' workloads
    sys.exit(main(Path(sys.argv[1])))
