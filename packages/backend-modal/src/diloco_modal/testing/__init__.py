"""A fake Modal cloud the real modal client talks to, for diloco's tests.

`FakeModal(root).start()` runs the fake control plane (`python -m diloco_modal.testing.server
ROOT`, a gRPC servicer of modal_proto's `ModalClient` service on 127.0.0.1) in its own process,
so the launcher, a second shell's `diloco status` and a `diloco resume` (each another process)
all reach the same cloud; `FakeModal.env` is what a process needs to reach it
(`MODAL_SERVER_URL`, a token, the root). Nothing of modal is patched: every call diloco makes
goes through the real client, with its own checks, retries and error mapping, into a server
that checks requests as Modal does (`validate`, `images`) and answers an RPC it does not
implement with UNIMPLEMENTED (`unimplemented()` lists them; the fixtures assert it is empty).

Sandboxes and function inputs run as detached local processes that hold only what a Modal
container holds (`container`, `call`); a clustered function's call runs in K of them, started
together (`cluster`). The methods below are the cloud's side, for tests: add a
named secret or volume, kill or preempt a container, make creations fail, read what the client
sent (`rpcs`, `uploaded_files`, `images`) and which processes still run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .store import GRACE_SECONDS, ROOT_ENV, TOKEN, Store, read_json, read_jsonl, write_json

__all__ = ["ROOT_ENV", "FakeModal", "forget_modal_client"]


def forget_modal_client() -> None:
    """modal caches its client, made with the server URL of the moment, per process: after
    pointing this process at another cloud, the next call must make a new one."""
    from modal.client import _Client

    _Client._client_from_env = None


class FakeModal:
    """The fake cloud: a root directory and the server process that serves it."""

    def __init__(self, root: str | Path, *, grace_seconds: float = GRACE_SECONDS, call_graph_lag: float = 2.0):
        self.root = Path(root)
        self.store = Store(self.root)
        if not (self.root / "config.json").exists():
            self.store.configure(grace_seconds=grace_seconds, call_graph_lag=call_graph_lag, token=list(TOKEN))
        self._server: subprocess.Popen | None = None

    @classmethod
    def from_env(cls) -> FakeModal:
        return cls(os.environ[ROOT_ENV])

    # -- the server --------------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> FakeModal:
        (self.root / "server.json").unlink(missing_ok=True)
        log = open(self.root / "server.log", "ab")
        self._server = subprocess.Popen([sys.executable, "-m", "diloco_modal.testing.server", str(self.root)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while read_json(self.root / "server.json") is None:
            if self._server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake Modal server did not start: {(self.root / 'server.log').read_text()}")
            time.sleep(0.05)
        return self

    @property
    def url(self) -> str:
        return read_json(self.root / "server.json")["url"]

    @property
    def env(self) -> dict[str, str]:
        """What a process needs for its modal client to reach this cloud."""
        token_id, token_secret = self.store.config.get("token") or TOKEN
        return {"MODAL_SERVER_URL": self.url, "MODAL_TOKEN_ID": token_id, "MODAL_TOKEN_SECRET": token_secret,
                ROOT_ENV: str(self.root)}

    def stop(self) -> None:
        """Terminate every container still running (as Modal does when its app stops), then the server."""
        from .containers import kill

        for object_id in self.objects():
            if self.store.exit_of(object_id) is None:
                kill(self.store, object_id, "terminated", 137)
        if self._server is not None and self._server.poll() is None:
            self._server.send_signal(signal.SIGTERM)
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()

    def __enter__(self) -> FakeModal:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the workspace -----------------------------------------------------------------------------

    def add_secret(self, name: str, values: dict[str, str]) -> None:
        """A named secret, as `modal secret create NAME K=V` leaves it."""
        self.store.set_named("secrets", name, dict(values))

    def add_volume(self, name: str) -> None:
        self.store.set_named("volumes", name, {})

    def fail_creates_after(self, n: int, message: str = "No GPU capacity in the requested region") -> None:
        """The next `n` sandbox creations succeed, then creation fails (RESOURCE_EXHAUSTED)."""
        write_json(self.root / "fail-creates.json", {"left": n, "message": message})

    # -- containers --------------------------------------------------------------------------------

    def objects(self, prefix: str = "") -> list[str]:
        """Ids of every sandbox ('sb-') and function call ('fc-') the cloud ran."""
        return self.store.container_ids(prefix)

    def spec(self, object_id: str) -> dict[str, Any]:
        """What the container was started with (command, env with secrets, resources, mounts)."""
        return read_json(self.store.container_dir(object_id) / "spec.json", {})

    def tags(self, object_id: str) -> dict[str, str]:
        return read_json(self.store.container_dir(object_id) / "tags.json", {})

    def exit(self, object_id: str) -> dict[str, Any] | None:
        return self.store.exit_of(object_id)

    def restarts(self, object_id: str) -> list[dict[str, Any]]:
        """The times a function call's input was restarted after a preemption."""
        return read_jsonl(self.store.container_dir(object_id) / "restarts.jsonl")

    def _container(self, object_id: str) -> dict[str, Any]:
        return read_json(self.store.container_dir(object_id) / "container.json", {})

    def live_processes(self) -> list[int]:
        """Pids of every process still running in any container (for 'nothing left running' checks)."""
        groups = {read_json(self.store.container_dir(oid) / "group.json", {}).get("pid") for oid in self.objects()}
        groups -= {None}
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[2]) in groups and stat[0] not in ("Z", "X"):
                    pids.append(int(proc.name))
        return pids

    def members(self, object_id: str) -> list[dict[str, Any]]:
        """A clustered call's containers, by rank: task id, address and workload pid ([] before
        they started, and for a call of one container)."""
        return list(self._container(object_id).get("members", []))

    def kill(self, object_id: str, sig: int = signal.SIGKILL, *, node: int | None = None) -> bool:
        """Send `sig` to the container's workload (a crashed or OOM-killed replica); in a clustered
        call, to container `node`'s whole process tree (the machine is gone, with all it ran)."""
        size = int(self.spec(object_id).get("cluster_size", 1))
        if (size > 1) != (node is not None):
            raise ValueError(f"{object_id} runs on {size} container(s): name one with node=0..{size - 1}"
                             if size > 1 else f"{object_id} is not a clustered call: it has no node={node}")
        if self.exit(object_id):
            return False
        if node is None:
            pid = self._container(object_id).get("workload_pid")
            if not pid:
                return False
            os.kill(pid, sig)
            return True
        from .cluster import process_tree

        members = self.members(object_id)
        if node >= len(members):
            return False
        for pid in process_tree(members[node]["workload_pid"]):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return True

    def preempt(self, object_id: str) -> bool:
        """What Modal does to a preempted container: SIGINT to its workload, the grace period, then
        the kill; a function input interrupted so is restarted in a new container. Not modelled for
        a clustered call's containers (what Modal does to the others is not documented)."""
        if int(self.spec(object_id).get("cluster_size", 1)) > 1:
            raise NotImplementedError(f"{object_id} is a clustered call: diloco's fake Modal cloud does not model "
                                      f"preempting one of its containers")
        (self.store.container_dir(object_id) / "preempting").write_text(str(time.time()))
        return self.kill(object_id, signal.SIGINT)

    def expire(self, object_id: str) -> None:
        """The container reaches its timeout now (Modal's limit on its life): exit 124."""
        (self.store.container_dir(object_id) / "expire").write_text(str(time.time()))

    # -- what the client sent ----------------------------------------------------------------------

    def rpcs(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every RPC the server answered (or those named `name`), with its request as JSON."""
        return self.store.rpcs(name)

    def raw_requests(self, name: str | None = None) -> dict[str, list[bytes]]:
        """The serialized requests the server received, by RPC name (all, or those named `name`):
        where a test looks for a value that must never have left the machine in that RPC."""
        names = [name] if name else sorted(p.stem for p in (self.root / "raw").glob("*.bin"))
        return {n: self.store.raw_requests(n) for n in names}

    def unimplemented(self) -> list[str]:
        """RPCs the client called that the fake does not implement (each failed loudly)."""
        return [r["rpc"] for r in read_jsonl(self.root / "unimplemented.jsonl")]

    def server_errors(self) -> list[str]:
        """Bugs of the fake server itself (each answered INTERNAL): tracebacks."""
        return [r["error"] for r in read_jsonl(self.root / "errors.jsonl")]

    def uploaded_files(self) -> set[str]:
        """Every path (in the container) of a file the client uploaded into a mount."""
        out = set()
        for path in (self.root / "objects").glob("mo-*.json"):
            out |= {f["filename"] for f in read_json(path, {}).get("files", [])}
        return out

    def images(self) -> list[dict[str, Any]]:
        """Every image definition the client sent, with the outcome its build had."""
        return [read_json(p, {}) for p in sorted((self.root / "objects").glob("im-*.json"))]

    def client_versions(self) -> list[str]:
        return self.store.config.get("client_versions", [])
