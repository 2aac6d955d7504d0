"""Replicas forked from a warm template instead of started from a fresh interpreter.

A replica's start is mostly imports: torch (about a second of a CPU core), torch._dynamo, which
torch's optimizers import at their first step (about another), and the replica runtime. Every
relaunch pays them again, and a machine starting many replicas at once pays them many times
over. So the local backend keeps a template process per launch environment that has imported
the replica runtime once (`diloco_replica.preload`), and forks each replica from it: the
replica starts in milliseconds, and shares the imported modules' memory with the others until
it writes to it.

A forked replica sees what a fresh one would. Its template was started by the same Python, in
the same directory, with the replica's environment except the variables that differ between
replicas and launches (diloco's own `DILOCO_*`, the rank under its names, the devices:
`PER_REPLICA`), which nothing the template imports reads at import time (tests check it).
After the fork the replica takes its own session, log file, environment and argv, runs
`diloco.bootstrap.runner.main()` as `python -m diloco.bootstrap.runner` would, and ends through the interpreter's
own exit (its threads joined, its atexit handlers run).

Where a fork is not safe the replica starts fresh: off Linux, a command entrypoint (it execs a
program anyway), a replica of several processes (torchrun starts them), no replica runtime to
preload, or a template whose imports initialised CUDA (a CUDA context does not survive a fork:
the preload refuses, and so does the template).

The template reaps the replicas it forks and writes each one's exit status where the launcher
reads it (`exit_path`: what `Popen.returncode` would say), as the launcher is not their
parent. It exits when the launcher does (its stdin closes), or after `IDLE_EXIT_S` with nothing to do;
the replicas it forked live on, as a launcher's own children do.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..inputs import envvars

# What differs between replicas and launches: diloco's own variables (read when the replica runs,
# never at import), the rank and the devices. The rest of the environment picks the template.
PER_REPLICA = frozenset({envvars.ENV_RANK, "CUDA_VISIBLE_DEVICES"})
PER_REPLICA_PREFIX = "DILOCO_"
PRELOAD = "diloco_replica.preload"  # the module a template imports before it forks anything
READY_TIMEOUT_S = 120.0             # a template's imports, on a loaded machine
IDLE_EXIT_S = 300.0                 # a template with no request and no replica running this long ends


def exit_path(stem: str) -> str:
    """Where the template writes the exit status of the replica whose files start with `stem`."""
    return f"{stem}.exit.json"


def read_returncode(stem: str) -> int | None:
    """A forked replica's exit status as `Popen.returncode` gives it (negative: killed by that
    signal), once its template has reaped it; None before, or if nobody did."""
    try:
        code = json.loads(Path(exit_path(stem)).read_text()).get("returncode")
    except (OSError, ValueError, AttributeError):
        return None
    return code if type(code) is int else None


def supported(*, function_entrypoint: bool, processes: int) -> bool:
    """Whether a replica of this launch can be forked from a template on this machine."""
    if sys.platform != "linux" or not function_entrypoint or processes != 1:
        return False
    from importlib.util import find_spec

    return find_spec("diloco_replica") is not None


class Template:
    """(The launcher's side) One template process and its request pipe."""

    def __init__(self, env: Mapping[str, str], cwd: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "diloco.local.warmstart"], cwd=cwd, env=dict(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self._unread = b""
        self.usable = self._answer(READY_TIMEOUT_S).get("ready") is True

    def _answer(self, timeout: float) -> dict[str, Any]:
        """The template's next line, or {} if it ended or said nothing in `timeout` seconds."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._unread:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return {}
            chunk = os.read(fd, 65536)
            if not chunk:
                return {}
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

    def fork(self, env: Mapping[str, str], cwd: str, log: str, exits: str) -> int | None:
        """A replica forked with this environment, directory and log; its pid, or None if the
        template is gone (the caller starts the replica fresh)."""
        line = json.dumps({"env": dict(env), "cwd": cwd, "log": log, "exit": exits}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.usable = False
            return None
        pid = self._answer(30.0).get("pid")
        if type(pid) is not int:
            self.usable = False
            return None
        return pid

    def close(self) -> None:
        """End the template (the replicas it forked go on)."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Templates:
    """(The launcher's side) The templates of one executor, one per launch environment and
    directory, each started at its first replica."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, tuple[tuple[str, str], ...]], Template] = {}
        self._lock = threading.Lock()

    def fork(self, env: Mapping[str, str], cwd: str, log: str, exits: str, *, per_replica: frozenset[str] = frozenset()
             ) -> int | None:
        """A replica forked from the template of its environment; None where there is none to
        fork from (it did not come up, or ended): the caller starts the replica fresh."""
        varying = PER_REPLICA | per_replica
        shared = {k: v for k, v in env.items() if k not in varying and not k.startswith(PER_REPLICA_PREFIX)}
        key = (cwd, tuple(sorted(shared.items())))
        with self._lock:
            template = self._by_key.get(key)
            if template is not None and template.usable and template.proc.poll() is not None:
                template = None  # it ended (idle for a while): another one
            if template is None:
                template = self._by_key[key] = Template(shared, cwd)
            if not template.usable:
                return None
            return template.fork(env, cwd, log, exits)

    def close(self) -> None:
        with self._lock:
            templates, self._by_key = list(self._by_key.values()), {}
        for template in templates:
            template.close()


# -- the template ------------------------------------------------------------------------------


def _say(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def serve() -> dict[str, Any] | None:
    """(The template) Import the replica runtime, then fork a replica for each request on stdin
    until it closes. Returns, in a forked replica, its request; in the template, None at the end."""
    from ..bootstrap.runner import write_text_atomic

    try:
        import importlib

        importlib.import_module(PRELOAD)
        if threading.active_count() > 1:
            raise RuntimeError("the preload started a thread, which a fork would not take along")
        import gc

        gc.freeze()  # what was imported is shared: the replicas' collections must not write to it
    except BaseException as exc:  # noqa: BLE001 - any failure means: start replicas fresh
        _say({"ready": False, "why": f"{type(exc).__name__}: {exc}"})
        return None
    exits: dict[int, str] = {}

    def reap(*_: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = exits.pop(pid, None)
            if path:
                write_text_atomic(path, json.dumps({"returncode": os.waitstatus_to_exitcode(status)}))

    signal.signal(signal.SIGCHLD, reap)
    _say({"ready": True})
    unread = b""
    while True:
        while b"\n" not in unread:
            if not select.select([0], [], [], IDLE_EXIT_S)[0]:
                if not exits:
                    return None  # idle, none of its replicas running: the launcher starts another if need be
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return None  # the launcher ended
            unread += chunk
        line, unread = unread.split(b"\n", 1)
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # its exit is reaped once recorded
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            return request
        exits[pid] = request["exit"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        _say({"pid": pid})


def become(request: dict[str, Any]) -> None:
    """(A forked replica) Take the place of a fresh `python -m diloco.bootstrap.runner`: its own session
    (its pid is its process group's, which cancel and timeouts kill), stdin from /dev/null,
    stdout and stderr to its log, its environment, directory and argv."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from ..bootstrap import runner

    sys.argv = [runner.__file__]


def main() -> int:
    request = serve()
    if request is None:
        return 0
    try:
        become(request)
    except BaseException as exc:  # noqa: BLE001 - a replica that could not take its place: no result
        sys.stderr.write(f"diloco: could not start this replica from its template: {exc}\n")
        os._exit(127)
    from ..bootstrap.runner import main as run_replica

    return run_replica()  # then the interpreter's own exit: its threads joined, its atexit handlers run


if __name__ == "__main__":
    sys.exit(main())
