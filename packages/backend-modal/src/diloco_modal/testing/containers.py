"""Starting and stopping containers of the fake Modal cloud, from the server's side.

A container (a sandbox, or one function call's input) is a detached local process,
`python -m diloco_modal.testing.container DIR`, the leader of its own process group (for a
clustered function's call, `python -m diloco_modal.testing.cluster DIR` leads its K containers). Its
filesystem holds what Modal would put there: the files of its mounts (the workdir shipped with
`add_local_dir`, a function's module) are written under DIR/fs from the blobs the client
uploaded, so the code that runs is exactly the code that was shipped. The "image" is this
machine's Python (the fake builds no image; `images` checks the definition instead).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .store import ROOT_ENV, Store, new_id, read_json, write_exit, write_json

_STATUS = {"success": api_pb2.GenericResult.GENERIC_STATUS_SUCCESS,
           "failure": api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
           "terminated": api_pb2.GenericResult.GENERIC_STATUS_TERMINATED,
           "timeout": api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT}


def materialize(store: Store, mount_ids: list[str], fs: Path) -> list[str]:
    """Write the mounts' files under `fs` (a path inside the container → fs/path); the
    container paths written, for the record."""
    written = []
    for mount_id in mount_ids:
        mount = store.get(mount_id)
        if mount is None or mount.get("kind") != "mount":
            raise GRPCError(Status.NOT_FOUND, f"Mount {mount_id} not found")
        for f in mount["files"]:
            target = fs / f["filename"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(store.blob_path(f["sha256_hex"]).read_bytes())
            if f.get("mode"):
                os.chmod(target, f["mode"] & 0o777)
            written.append(f["filename"])
    return written


def start(store: Store, object_id: str, spec: dict[str, Any]) -> Path:
    """Create the container's directory and start it; returns the directory. A clustered call's
    K containers each get a filesystem of their own (DIR/nodes/<rank>/fs) and an address on
    loopback (127.0.0.<rank + 1>), as Modal gives each its own; one process leads them all."""
    obj = store.container_dir(object_id)
    obj.mkdir(parents=True)
    size = int(spec.get("cluster_size", 1))
    filesystems = [obj / "nodes" / str(r) / "fs" for r in range(size)] if size > 1 else [obj / "fs"]
    for fs in filesystems:
        fs.mkdir(parents=True)
        files = materialize(store, spec.get("mount_ids", []), fs)
    spec = {**spec, "files": files}
    if size > 1:
        spec["cluster"] = {"cluster_id": new_id("cu"), "container_ips": [f"127.0.0.{r + 1}" for r in range(size)]}
    write_json(obj / "spec.json", spec)
    write_json(obj / "tags.json", dict(spec.get("tags") or {}))
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH")
           if k in os.environ}
    leader = "diloco_modal.testing.cluster" if size > 1 else "diloco_modal.testing.container"
    proc = subprocess.Popen([sys.executable, "-m", leader, str(obj)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**env, ROOT_ENV: str(store.root)})
    write_json(obj / "group.json", {"pid": proc.pid})  # its process group, from the first moment
    return obj


def kill(store: Store, object_id: str, status: str, exitcode: int) -> bool:
    """End a container now (terminate, cancel): record how, then SIGKILL its process group."""
    obj = store.container_dir(object_id)
    recorded = write_exit(obj, status, exitcode)
    pid = read_json(obj / "group.json", {}).get("pid")
    if pid and recorded:  # an ended container keeps how it ended (and its pid may be another's now)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return recorded


def result_of(store: Store, object_id: str) -> api_pb2.GenericResult | None:
    """How a container ended, as Modal reports it (None while it runs)."""
    ended = store.exit_of(object_id)
    if ended is None:
        return None
    return api_pb2.GenericResult(status=_STATUS[ended["status"]], exitcode=int(ended["exitcode"]),
                                 exception=ended.get("exception", ""), traceback=ended.get("traceback", ""))


def task_id_of(store: Store, object_id: str) -> str:
    """The container's current task (a restarted input gets a new one); '' before it started."""
    return read_json(store.container_dir(object_id) / "container.json", {}).get("task_id", "")
