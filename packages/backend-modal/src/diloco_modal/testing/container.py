"""`python -m diloco_modal.testing.container DIR`: one container of the Modal double.

The session leader of its own process group (so terminate kills everything it started); runs
the sandbox's command, or the function's body, with a container's environment; writes the
output to DIR/output.log and how it ended to DIR/exit.json. See `diloco_modal.testing`.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from .files import ROOT_ENV, _node_env, _read_json, _write_json, write_exit


def _mapper(image_paths: dict[str, str]):
    """Paths inside the 'image' → where this machine holds them."""
    def one(value: str) -> str:
        for remote, local in image_paths.items():
            if value == remote or value.startswith(remote.rstrip("/") + "/"):
                return local + value[len(remote):]
        return value

    return lambda value: os.pathsep.join(one(v) for v in value.split(os.pathsep))


def main(obj_dir: Path) -> int:
    config = _read_json(Path(os.environ[ROOT_ENV]) / "config.json", {})
    spec = _read_json(obj_dir / "spec.json")
    to_local = _mapper(config.get("image_paths") or {})
    env = {**_node_env(), **{k: to_local(str(v)) for k, v in (spec.get("env") or {}).items()}, ROOT_ENV: os.environ[ROOT_ENV]}
    env["PYTHONPATH"] = os.pathsep.join([*config.get("pythonpath", []), *filter(None, [env.get("PYTHONPATH")])])
    if spec["kind"] == "sandbox":
        cmd = list(spec["command"])
        if cmd and cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable  # the image's Python
        cwd = to_local(spec["workdir"]) if spec.get("workdir") else str(obj_dir)
    else:
        cmd = [sys.executable, "-m", "diloco_modal.testing.call", str(obj_dir)]
        cwd = str(obj_dir)
    timeout = spec.get("timeout")
    deadline = time.monotonic() + float(timeout) if timeout else None
    grace = float(config.get("grace_seconds", 5.0))
    info = {"pid": os.getpid(), "task_id": f"ta-{secrets.token_hex(8)}"}
    log = obj_dir / "output.log"
    while True:
        if (obj_dir / "exit.json").exists():  # terminated before it started
            return 137
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        _write_json(obj_dir / "container.json", {**info, "workload_pid": proc.pid})
        if (obj_dir / "exit.json").exists():  # terminated while it started
            os.killpg(0, signal.SIGKILL)
        noticed = None
        while proc.poll() is None:
            time.sleep(0.05)
            if deadline is not None and time.monotonic() > deadline:
                write_exit(obj_dir, "timeout", 124)
                os.killpg(0, signal.SIGKILL)
            if (obj_dir / "preempting").exists():
                noticed = noticed or time.monotonic()
                if time.monotonic() - noticed > grace:
                    proc.kill()  # the grace period is over: the machine goes away
        preempted = (obj_dir / "preempting").exists()
        if preempted:
            (obj_dir / "preempting").unlink()
            if spec["kind"] == "function":  # Modal restarts a preempted input in a new container
                with open(log, "a") as out:
                    out.write("[modal] the container was preempted; input restarted\n")
                info["task_id"] = f"ta-{secrets.token_hex(8)}"
                continue
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        write_exit(obj_dir, "success" if code == 0 else "failure", code)
        return code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notice is for the workload
    sys.exit(main(Path(sys.argv[1])))
