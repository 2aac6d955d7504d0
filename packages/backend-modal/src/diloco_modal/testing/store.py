"""The fake Modal cloud's state on disk: one root directory that every process can open.

The server (`diloco_modal.testing.server`), the containers it starts and the test's control
methods (`FakeModal`) are separate processes; they share nothing but these files, written
atomically (temporary name, rename) and read with a default while another process writes:

    config.json              grace period, call-graph lag, token (what the test configured)
    server.json              the server's URL and pid, once it listens
    rpcs.jsonl               every RPC the server answered, with its request (bytes left out)
    raw/<Name>.bin           the serialized requests of each RPC (length-prefixed), as received
    unimplemented.jsonl      every RPC it refused because it does not implement it
    apps.json                apps by id, and which are deployed under which name
    secrets.json             named secrets (`modal secret create`), volumes.json named volumes
    objects/<id>.json        images, mounts, secrets, volumes and functions the client created
    blobs/<sha256>           the content of every file uploaded into a mount
    containers/<id>/         one sandbox or function call: spec.json, tags.json, logs.jsonl,
                             group.json (its process group, written by the server),
                             container.json (its task and workload, written by the container),
                             exit.json (how it ended, written once), fs/ (its filesystem);
                             a clustered call: nodes/<rank>/ per container instead of fs/
                             (spec.json with its rank, outcome.json, fs/), its leader's
                             container.json listing them (`cluster`)
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from diloco.testing.jsonfiles import read_json, write_json

ROOT_ENV = "DILOCO_FAKE_MODAL"  # where a process finds the fake cloud's root
TOKEN = ("ak-fake-modal", "as-fake-modal")  # the only credentials the fake accepts
GRACE_SECONDS = 5.0  # between the preemption notice (SIGINT) and the kill
_ID_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def new_id(prefix: str, length: int = 22) -> str:
    """An object id shaped like Modal's ('sb-' and 22 base62 characters, ...)."""
    return f"{prefix}-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line appended in one write (O_APPEND), so writers from several processes never interleave."""
    data = (json.dumps(row, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    return out


class Store:
    """Paths and JSON records under the fake cloud's root."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        for sub in ("objects", "blobs", "containers", "raw"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # -- configuration and bookkeeping -----------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        return read_json(self.root / "config.json", {})

    def configure(self, **values: Any) -> None:
        write_json(self.root / "config.json", {**self.config, **values})

    def record_rpc(self, name: str, request: dict[str, Any]) -> None:
        append_jsonl(self.root / "rpcs.jsonl", {"rpc": name, "at": time.time(), "request": request})

    def record_raw(self, name: str, data: bytes) -> None:
        """One request's bytes, appended in one write (8-byte length first) to raw/<name>.bin."""
        fd = os.open(self.root / "raw" / f"{name}.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, len(data).to_bytes(8, "big") + data)
        finally:
            os.close(fd)

    def raw_requests(self, name: str) -> list[bytes]:
        try:
            data = (self.root / "raw" / f"{name}.bin").read_bytes()
        except OSError:
            return []
        out, at = [], 0
        while at + 8 <= len(data):
            size = int.from_bytes(data[at:at + 8], "big")
            out.append(data[at + 8:at + 8 + size])
            at += 8 + size
        return out

    def rpcs(self, name: str | None = None) -> list[dict[str, Any]]:
        rows = read_jsonl(self.root / "rpcs.jsonl")
        return [r for r in rows if name is None or r["rpc"] == name]

    # -- objects (images, mounts, secrets, volumes, functions) -------------------------------------

    def put(self, object_id: str, record: dict[str, Any]) -> str:
        write_json(self.root / "objects" / f"{object_id}.json", record)
        return object_id

    def get(self, object_id: str) -> dict[str, Any] | None:
        return read_json(self.root / "objects" / f"{object_id}.json")

    def named(self, kind: str) -> dict[str, Any]:
        """Named secrets ('secrets') or volumes ('volumes'), as the workspace holds them."""
        return read_json(self.root / f"{kind}.json", {})

    def set_named(self, kind: str, name: str, value: Any) -> None:
        write_json(self.root / f"{kind}.json", {**self.named(kind), name: value})

    def blob_path(self, sha256_hex: str) -> Path:
        return self.root / "blobs" / sha256_hex

    # -- apps --------------------------------------------------------------------------------------

    def apps(self) -> dict[str, Any]:
        return read_json(self.root / "apps.json", {"by_id": {}, "deployed": {}})

    def save_apps(self, apps: dict[str, Any]) -> None:
        write_json(self.root / "apps.json", apps)

    # -- containers (sandboxes and function calls) -------------------------------------------------

    def container_dir(self, object_id: str) -> Path:
        return self.root / "containers" / object_id

    def container_ids(self, prefix: str = "") -> list[str]:
        return sorted(p.name for p in (self.root / "containers").iterdir() if p.name.startswith(prefix))

    def exit_of(self, object_id: str) -> dict[str, Any] | None:
        return read_json(self.container_dir(object_id) / "exit.json")


def write_exit(container_dir: Path, status: str, exitcode: int, **extra: Any) -> bool:
    """Record how a container ended, once: the first writer (the container, terminate, the
    timeout, a cancel) wins; `status` is a GenericResult status name (success, failure,
    terminated, timeout)."""
    try:
        fd = os.open(container_dir / "exit.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"status": status, "exitcode": exitcode, "ended_at": time.time(), **extra}, f)
    return True


__all__ = ["GRACE_SECONDS", "ROOT_ENV", "TOKEN", "Store", "append_jsonl", "new_id", "read_json", "read_jsonl",
           "write_exit", "write_json"]
