"""The Modal double's state on disk, which any process can open, and what every container sees.

JSON files written atomically, an object's exit recorded once (the first writer wins), the
image's basic environment, and the token check modal's client makes before reaching the cloud.
See `diloco_modal.testing`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from diloco.testing.jsonfiles import read_json as _read_json, write_json as _write_json  # noqa: F401 (re-exported)

ROOT_ENV = "DILOCO_FAKE_MODAL"
GRACE_SECONDS = 5.0  # between the preemption notice and the kill
_NODE_VARS = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")




def write_exit(obj_dir: Path, status: str, exitcode: int) -> bool:
    """Record how a container ended, once: the first writer (container, terminate, timeout) wins."""
    try:
        fd = os.open(obj_dir / "exit.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"status": status, "exitcode": exitcode, "ended_at": time.time()}, f)
    return True


def _modal():
    import modal

    return modal


def _check_token() -> None:
    """Modal's client refuses to start without a token; so does the double."""
    modal = _modal()
    if not (modal.config.config.get("token_id") and modal.config.config.get("token_secret")):
        raise modal.exception.AuthError(
            "Token missing. Could not authenticate client. If you have token credentials, see "
            "modal.com/docs/reference/modal.config for setup help. If you are a new user, register an account at "
            "modal.com, then run `modal token new`.")


def _node_env() -> dict[str, str]:
    return {k: os.environ[k] for k in _NODE_VARS if k in os.environ}
