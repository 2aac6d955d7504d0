"""`python -m diloco.local.island K <node command>`: one local replica of K "nodes".

The local backend's stand-in for a platform that places K machines together as one replica: it
starts the replica's node command K times on loopback, each with its node rank and the first
node's address (`diloco.procgroup.node_env`: torch's own static rendezvous, node 0 hosting its
store on a port free here), and does what Slurm's `srun --kill-on-bad-exit`, a failed
SageMaker instance or a lost pod does to the others: when one node ends with a failure, the
other nodes are stopped, so the replica ends as one attempt and is relaunched as one.

The executor sees one process (this one, the leader of the replica's process group: cancel
and timeouts reach every node through it) and one result: node 0's on success, else the first
failed node's (or, when a node's agent died without writing one, a line naming the node and
how it died). Each node writes its own result beside the replica's (`<result>.node-<r>`).

No torch import: the nodes' commands are torchrun (`diloco.procgroup.replica_command`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from ..errors import EXIT_CONFIG
from ..inputs import envvars
from ..procgroup import node_env

STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL, for the nodes left when one has failed
POLL_S = 0.1


def node_result_path(path: str, node: int) -> str:
    """Where node `node` of a local multi-node replica writes its own result."""
    return f"{path}.node-{node}"


def free_port() -> int:
    """A port free on loopback now, for node 0's store (torch binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_environments(env: Mapping[str, str], nodes: int, port: int) -> list[dict[str, str]]:
    """Each node's environment: the replica's, its node rank and node 0's address, its own
    result file, and its share of the replica's devices (node r: the r-th block)."""
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    out = []
    for r in range(nodes):
        node = {**env, **node_env(r, "127.0.0.1", port)}
        if env.get(envvars.ENV_RESULT_PATH):
            node[envvars.ENV_RESULT_PATH] = node_result_path(env[envvars.ENV_RESULT_PATH], r)
        if devices and len(devices) % nodes == 0:
            per = len(devices) // nodes
            node["CUDA_VISIBLE_DEVICES"] = ",".join(devices[r * per:(r + 1) * per])
        out.append(node)
    return out


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def replica_result(result_path: str | None, nodes: int, failed: tuple[int, int] | None, *,
                   rank: int, attempt: int) -> tuple[dict, int]:
    """The replica's result and exit code from its nodes': node 0's when every node succeeded,
    else the first failed node's, named."""
    parts = {r: _read(node_result_path(result_path, r)) for r in range(nodes)} if result_path else {}
    if failed is None:
        return parts.get(0) or {"rank": rank, "attempt": attempt, "status": "succeeded", "exit_code": 0}, 0
    node, code = failed
    mine = parts.get(node)
    if mine and mine.get("status") == "failed":
        result = dict(mine)
        result["error"] = f"{mine.get('error') or ''}\n(node {node} of {nodes})".lstrip()
        return result, int(mine.get("exit_code") or 1)
    exit_code = 128 - code if code < 0 else code
    return {"rank": rank, "attempt": attempt, "status": "failed", "exit_code": exit_code,
            "error": f"node {node} of {nodes} {_how(code)} (its torchrun agent reported no result); "
                     f"the replica's other nodes were stopped"}, exit_code


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def run(nodes: int, argv: Sequence[str]) -> int:
    env = dict(os.environ)
    result_path = env.get(envvars.ENV_RESULT_PATH)
    rank, attempt = int(env.get(envvars.ENV_RANK, "0")), int(env.get(envvars.ENV_ATTEMPT, "0"))
    if result_path:
        for r in range(nodes):  # an earlier attempt's node results must not be read as this one's
            if os.path.exists(node_result_path(result_path, r)):
                os.unlink(node_result_path(result_path, r))
    procs = [subprocess.Popen(list(argv), env=node, stdin=subprocess.DEVNULL)
             for node in node_environments(env, nodes, free_port())]
    cancelled: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:  # a cancel: every node is stopped, none failed
        cancelled.append(signum)
        _stop(procs)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    failed: tuple[int, int] | None = None
    while failed is None and not cancelled:
        codes = [p.poll() for p in procs]  # every node each time: the first to fail is the one to name
        failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is None and all(c == 0 for c in codes):
            break
        if failed is None:
            time.sleep(POLL_S)
    if cancelled:
        return 128 + cancelled[0]
    if failed is not None:
        _stop(procs)
    result, code = replica_result(result_path, nodes, failed, rank=rank, attempt=attempt)
    if result_path:
        tmp = f"{result_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, result_path)
    return code


def main(args: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if args is None else args)
    if len(args) < 2 or not args[0].isdigit() or int(args[0]) < 2:
        print("usage: python -m diloco.local.island NODES(>=2) COMMAND...", file=sys.stderr)
        return EXIT_CONFIG
    return run(int(args[0]), args[1:])


if __name__ == "__main__":
    sys.exit(main())
