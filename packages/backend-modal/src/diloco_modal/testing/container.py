"""`python -m diloco_modal.testing.container DIR`: one container of the fake Modal cloud.

The leader of its own process group (so terminate and cancel kill everything it started). It
runs the sandbox's command, or one function input (`diloco_modal.testing.call`), with only what
a Modal container would hold: the image's basics (PATH, HOME, locale), the definition's
environment and secrets, its mounts' files under DIR/fs (a path in the container, such as
/root/diloco-workdir, is mapped there); never the test's own AWS_* or DILOCO_* variables.

As Modal does:
- output is captured as log entries of raw chunks that do not respect line ends (a line may be
  split over several entries, an entry may hold the end of one line and the start of the next),
  each with its source (stdout/stderr), time and task, in DIR/logs.jsonl;
- the sandbox's or function's timeout kills it (status timeout, exit 124);
- a preemption (`FakeModal.preempt`) sends SIGINT to the workload, waits the grace period, then
  kills it. A sandbox then ends with whatever its workload exited with; a function input is
  restarted in a new container (a new task) if it was interrupted, that is if it raised
  KeyboardInterrupt or was still running at the kill; any other exception fails the input.
"""

from __future__ import annotations

import codecs
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .store import ROOT_ENV, Store, append_jsonl, new_id, read_json, write_exit, write_json

NODE_VARS = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")
_CHUNK = (1, 40)  # sizes of log entries, in characters: small, so lines are split often


def mapper(fs: Path):
    """A path in the container → where this machine holds it (only paths the mounts created)."""
    def one(value: str) -> str:
        if value.startswith("/") and (fs / value.lstrip("/")).exists():
            return str(fs / value.lstrip("/"))
        return value
    return lambda value: os.pathsep.join(one(v) for v in value.split(os.pathsep))


def pump(stream, fd: int, log: Path, task: dict, seed: int) -> None:
    """Copy one output stream into log entries of random sizes, cut without regard to lines."""
    rng = random.Random(seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        data = os.read(stream.fileno(), 65536)
        text = decoder.decode(data, final=not data)
        while text:
            size = rng.randint(*_CHUNK)
            append_jsonl(log, {"t": time.time_ns(), "fd": fd, "data": text[:size], "task_id": task["task_id"],
                               "input_id": task.get("input_id", "")})
            text = text[size:]
        if not data:
            return


def _run(obj: Path, cmd: list[str], env: dict[str, str], cwd: str, info: dict, deadline: float | None,
         grace: float) -> tuple[int, bool]:
    """One workload to its end: (exit code, whether it was preempted)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    write_json(obj / "container.json", {**info, "workload_pid": proc.pid})
    pumps = [threading.Thread(target=pump, args=(s, fd, obj / "logs.jsonl", info, hash((info["task_id"], fd))))
             for s, fd in ((proc.stdout, 1), (proc.stderr, 2))]
    for t in pumps:
        t.start()
    if (obj / "exit.json").exists():  # terminated while it started
        os.killpg(0, signal.SIGKILL)
    noticed = None
    while proc.poll() is None:
        time.sleep(0.05)
        if (deadline is not None and time.monotonic() > deadline) or (obj / "expire").exists():
            write_exit(obj, "timeout", 124)
            os.killpg(0, signal.SIGKILL)
        if (obj / "preempting").exists():
            noticed = noticed or time.monotonic()
            if time.monotonic() - noticed > grace:
                proc.kill()  # the grace period is over: the machine goes away
    for t in pumps:
        t.join(timeout=5)
    preempted = (obj / "preempting").exists()
    if preempted:
        (obj / "preempting").unlink()
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return code, preempted


def container_env(spec: dict, fs: Path) -> dict[str, str]:
    """A container's environment (here, and in each of a cluster's, `cluster`): the image's basics and the definition's variables (paths in
    the container mapped to `fs`); the "image" is this machine's Python, with its own path. A
    function input also has /root (where the function's module is mounted) on sys.path."""
    to_local = mapper(fs)
    env = {**{k: os.environ[k] for k in NODE_VARS if k in os.environ},
           **{k: to_local(str(v)) for k, v in (spec.get("env") or {}).items()}}
    parts = [env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]
    if spec["kind"] != "sandbox":
        parts.insert(0, str(fs / "root"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, parts))
    return env


def main(obj: Path) -> int:
    store = Store(os.environ[ROOT_ENV])
    spec = read_json(obj / "spec.json")
    grace = float(store.config.get("grace_seconds", 5.0))
    fs = obj / "fs"
    to_local = mapper(fs)
    env = container_env(spec, fs)
    if spec["kind"] == "sandbox":
        cmd = list(spec["command"])
        if cmd and cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable  # the image's Python
        cwd = to_local(spec["workdir"]) if spec.get("workdir") else str(fs)
    else:  # a function input
        cmd = [sys.executable, "-m", "diloco_modal.testing.call", str(obj)]
        cwd = str(fs / "root") if (fs / "root").is_dir() else str(fs)
    timeout = spec.get("timeout")
    deadline = time.monotonic() + float(timeout) if timeout else None
    info = {"pid": os.getpid(), "input_id": spec.get("input_id", "")}
    while True:
        if (obj / "exit.json").exists():  # terminated before it started
            return 137
        info["task_id"] = new_id("ta")
        (obj / "outcome.json").unlink(missing_ok=True)
        code, preempted = _run(obj, cmd, env, cwd, info, deadline, grace)
        if spec["kind"] == "sandbox":
            write_exit(obj, "success" if code == 0 else "failure", code)
            return code
        outcome = read_json(obj / "outcome.json") or {"status": "interrupted" if preempted else "failure",
                                                      "exception": f"container exited with code {code}"}
        if preempted and outcome["status"] == "interrupted":  # Modal restarts the input in a new container
            append_jsonl(obj / "logs.jsonl", {"t": time.time_ns(), "fd": 3, "task_id": info["task_id"],
                                              "input_id": info["input_id"],
                                              "data": "Runner interrupted due to worker preemption: input restarted\n"})
            append_jsonl(obj / "restarts.jsonl", {"at": time.time(), "task_id": info["task_id"]})
            continue
        status = "success" if outcome["status"] == "success" else "failure"
        write_exit(obj, status, code, exception=outcome.get("exception", ""), traceback=outcome.get("traceback", ""))
        return code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notice is for the workload
    sys.exit(main(Path(sys.argv[1])))
