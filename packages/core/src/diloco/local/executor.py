"""LocalProcessExecutor: replicas as real subprocesses on this machine.

Every replica attempt is `python -m diloco.bootstrap.runner` in its own session (so its pid is its
process-group id and cancel/timeout kill the whole tree) with stdout+stderr in its own log file.
With `processes_per_replica` L > 1 it is torchrun over L runners (`diloco.procgroup`): cancel's
SIGTERM reaches torchrun, which stops its processes; they also die with it if it is SIGKILLed.
With `nodes` K > 1 it is K torchrun agents on loopback under `diloco.local.island`, which stops
the other nodes when one fails, as a platform ends a multi-node job.
All state lives in files under the run's work directory — pid and process start time, a
"started" marker, the runner's result JSON, a "cancelled" marker — so any process holding a
handle (a second shell, a resumed launcher) can poll, stream logs and cancel. The start time
guards against a recycled pid being mistaken for the replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..inputs import envvars
from . import warmstart
from ..errors import UserError
from ..options import option, options_from
from ..procgroup import replica_command
from ..protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from ..request import LaunchPlan, LaunchRequest
from ..host.procinfo import is_running, started_at
from ..host.statedir import private_dir, private_file, state_dir
from ..waiting import poll_until_terminal


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tail_text(path: Path, n_lines: int) -> str:
    """Last `n_lines` lines of a file without reading all of it."""
    try:
        return tail_and_size(path, n_lines)[0]
    except FileNotFoundError:
        return ""


def tail_and_size(path: Path, n_lines: int) -> tuple[str, int]:
    """A file's last `n_lines` lines and its size as they were read, from one open: a follower
    that reads on from that size loses no line written in between."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start, block, data = size, 8192, b""
        while start > 0 and data.count(b"\n") <= n_lines:
            step = min(block, start)
            start -= step
            f.seek(start)
            data = f.read(step) + data
            block *= 2
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-n_lines:]) + ("\n" if lines else ""), size


def check_function_exists(ref: str, search_path: list[str]) -> None:
    """Fail fast, before any process starts, if "module:function" cannot be found.

    Finds the module's source without executing it (importing user code in the launcher could
    be slow or have side effects) and looks for a top-level definition of the function's name.
    """
    import ast
    from importlib.machinery import PathFinder

    module, _, func = ref.partition(":")
    path: list[str] | None = search_path
    spec = None
    for part in module.split("."):
        spec = PathFinder.find_spec(part, path)
        if spec is None:
            raise UserError(f"entrypoint {ref!r}: no module named {module!r} in the workdir "
                            f"({search_path[0]}) or the installed packages")
        path = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec else None
    if not origin or not origin.endswith(".py"):
        return  # a compiled or namespace module: trust it, the replica reports any error
    try:
        tree = ast.parse(Path(origin).read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        raise UserError(f"entrypoint {ref!r}: cannot read {origin}: {exc}") from None
    top = func.split(".")[0]
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif not isinstance(node, (ast.Expr,)):
            return  # conditional definitions etc.: too dynamic to judge statically
    if top not in names:
        raise UserError(f"entrypoint {ref!r}: {origin} defines no top-level {top!r}")


@dataclass(frozen=True)
class LocalOptions:
    """The local backend's `[backend]` options."""

    grace_period: float = option(5.0, help="seconds between SIGTERM and SIGKILL when a replica is cancelled", min=0,
                                 max=3600)
    devices: list[int | str] = option([], help="GPU ids to spread ranks over (rank r gets CUDA_VISIBLE_DEVICES="
                                          "devices[r % len]; with K nodes of L processes, K × L of them)")
    state_dir: str | None = option(None, help="where logs and result files live (default: diloco's state dir)")
    warm_start: bool = option(True, help="fork each one-process replica with a function entrypoint from a process "
                                         "that imported torch and the replica runtime once (Linux; "
                                         "diloco.local.warmstart): it starts in milliseconds, not seconds; false: a "
                                         "fresh interpreter each")


class LocalProcessExecutor:
    """Runs each replica as a local subprocess, in its own process group, started in the
    request's workdir (prepended to PYTHONPATH so `module:function` entrypoints next to the spec
    import; the current directory if the request has none).

    Every replica starts with the launcher's environment as it was when the executor was made,
    plus its own: what the launcher's process sets later (tensorboardX, imported when the first
    round reaches the metric sink, sets CRC32C_SW_MODE) reaches no relaunch, so a relaunch is
    what attempt 0 was and forks from attempt 0's warm template instead of warming another."""

    backend_name = "local"
    Options = LocalOptions
    capabilities = Capabilities(shares_launcher_filesystem=True, relaunches_one_rank=True, process_groups=True,
                                multi_node=True, inter_replica_network=True, log_files=True)

    def __init__(self, options: LocalOptions | None = None, /, **overrides: Any):
        self.options = options_from(type(self), options, overrides)
        self.grace_period = float(self.options.grace_period)
        self.devices = [str(d) for d in self.options.devices]
        self._state_dir = Path(self.options.state_dir) if self.options.state_dir else None
        self._procs: dict[tuple[str, int, int], subprocess.Popen] = {}
        self._launcher_env = dict(os.environ)  # see the class's docstring
        # Whether torchrun can start here, looked up once: a relaunch is planned on the supervisor's
        # launch thread while its sink thread may be importing tensorboardX with torch hidden from
        # sys.modules (diloco.plugins.sinks), where find_spec("torch") says None.
        from importlib.util import find_spec

        self._torchrun_here = find_spec("torch") is not None and find_spec("diloco_replica") is not None
        self._templates = warmstart.Templates()
        weakref.finalize(self, self._templates.close)  # the templates end with the executor

    def close(self) -> None:
        """End the warm templates (`diloco.local.warmstart`) now rather than when this executor is
        collected; the replicas they forked go on."""
        self._templates.close()

    # -- launching -------------------------------------------------------------------------

    def _run_dir(self, run_id: str) -> Path:
        return (self._state_dir or state_dir()) / "local" / run_id

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """One process per rank: its argv, directory, log file and environment (secrets REDACTED)."""
        ep, processes = request.entrypoint, request.replica_processes
        workdir = str(Path(request.workdir or os.getcwd()).resolve())
        if processes > 1 and not self._torchrun_here:
            raise UserError(f"{processes} processes per replica start with torchrun, which needs "
                            f"torch and diloco-replica in this environment: pip install diloco-replica")
        if ep.function:
            check_function_exists(ep.function, [workdir, *sys.path])
        run_dir = self._run_dir(request.run_id)
        pythonpath = os.pathsep.join(x for x in [workdir, self._launcher_env.get("PYTHONPATH", "")] if x)
        warm = bool(self.options.warm_start) and warmstart.supported(function_entrypoint=bool(ep.function),
                                                                       processes=processes)
        rows = []
        for rank in request.ranks:
            stem = run_dir / f"rank-{rank}.attempt-{request.attempt}"
            env = request.replica_env(rank)
            env.update({envvars.ENV_RESULT_PATH: f"{stem}.result.json", envvars.ENV_STARTED_PATH: f"{stem}.started.json",
                        "PYTHONPATH": pythonpath})
            if self.devices:  # a replica of L processes gets L devices: rank r takes the r-th block of L
                # (with K nodes, L = K × processes per node, node k the k-th part: diloco.local.island)
                picked = [self.devices[(rank * processes + k) % len(self.devices)] for k in range(processes)]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(picked)
            env.update(request.secrets.redacted())
            rows.append({"rank": rank, "argv": self._argv(request), "cwd": workdir, "log": f"{stem}.log", "env": env,
                         "warm": warm})
        return LaunchPlan(self.backend_name, request, {"run_id": request.run_id, "processes": rows})

    @staticmethod
    def _argv(request: LaunchRequest) -> list[str]:
        """One replica's command: its node command, or K of them on loopback (`diloco.local.island`)."""
        node = replica_command(request.processes_per_replica, request.nodes, python=sys.executable)
        if request.nodes <= 1:
            return node
        return [sys.executable, "-m", "diloco.local.island", str(request.nodes), *node]

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        request = plan.request
        private_dir(self._run_dir(request.run_id))  # logs may hold what the user alone should read
        secrets = request.secrets.reveal()
        handles = []
        rank_env = request.args.get("rank_env")
        per_replica = frozenset({rank_env} if isinstance(rank_env, str) else ())
        for row in plan.body["processes"]:
            stem = row["log"].removesuffix(".log")
            for path in (stem + ".result.json", stem + ".started.json", stem + ".cancelled", warmstart.exit_path(stem)):
                Path(path).unlink(missing_ok=True)
            env = {**self._launcher_env, **row["env"], **secrets}
            with private_file(Path(row["log"]), "ab") as log:  # all the replica prints, 0600
                pid = self._templates.fork(env, row["cwd"], row["log"], warmstart.exit_path(stem),
                                           per_replica=per_replica) if row.get("warm") else None
                forked = pid is not None
                if pid is None:  # a fresh interpreter (asked for, or no template came up)
                    proc = subprocess.Popen(row["argv"], cwd=row["cwd"], env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                    self._procs[(request.run_id, row["rank"], request.attempt)] = proc
                    pid = proc.pid
            handles.append(ReplicaHandle.of(request, row["rank"], self.backend_name, pid=pid,
                                            started=started_at(pid), stem=stem, launched_at=time.time(),
                                            forked=forked))
        return handles

    # -- observing -------------------------------------------------------------------------

    def _paths(self, handle: ReplicaHandle) -> tuple[Path, Path, Path, Path]:
        stem = handle.metadata["stem"]
        return (Path(stem + ".result.json"), Path(stem + ".started.json"),
                Path(stem + ".cancelled"), Path(stem + ".log"))

    def _alive(self, handle: ReplicaHandle) -> bool:
        md = handle.metadata
        proc = self._procs.get((md["run_id"], handle.rank, handle.attempt))
        if proc is not None and proc.poll() is not None:
            return False
        return is_running(int(md["pid"]), md.get("started"))

    def _read_result(self, path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        result_path, started_path, cancelled_path, _ = self._paths(handle)
        result = self._read_result(result_path)
        if result is not None:
            return ReplicaStatus(result["status"])
        if cancelled_path.exists():
            return ReplicaStatus.CANCELLED
        if self._alive(handle):
            return ReplicaStatus.RUNNING if started_path.exists() else ReplicaStatus.PENDING
        return ReplicaStatus.FAILED

    def _result(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        result_path, _, _, log_path = self._paths(handle)
        data = self._read_result(result_path) or {}
        if status is ReplicaStatus.CANCELLED:
            return ReplicaResult(handle.rank, status, None, "cancelled", None, handle.attempt)
        if data:
            return ReplicaResult(handle.rank, status, data.get("exit_code"), data.get("error"),
                                 data.get("result"), handle.attempt)
        if not status.is_terminal:
            return ReplicaResult(handle.rank, status, None, None, None, handle.attempt)
        self._reap(handle, wait=True)  # it may be a zombie that poll() saw before it was reaped
        proc = self._procs.get((handle.metadata["run_id"], handle.rank, handle.attempt))
        code = proc.returncode if proc is not None else self._forked_returncode(handle)
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "died")
        tail = tail_text(log_path, 5).strip()
        error = f"{how} (the replica process reported no result)" + (f"\nlast output:\n{tail}" if tail else "")
        return ReplicaResult(handle.rank, status, code, error, None, handle.attempt)

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        log_path = self._paths(handle)[3]
        if not log_path.exists():
            return f"(no output yet from rank {handle.rank} attempt {handle.attempt})\n"
        return tail_text(log_path, n_lines)

    def log_path(self, handle: ReplicaHandle) -> Path:
        """The log file itself, for `diloco logs --follow`."""
        return self._paths(handle)[3]

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        statuses = poll_until_terminal(self, handles, timeout=timeout, interval=0.05)
        return [self._result(h, s) for h, s in zip(handles, statuses)]

    # -- stopping --------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        result_path, _, cancelled_path, _ = self._paths(handle)
        if result_path.exists() or not self._alive(handle):
            return  # already ended on its own: nothing to stop, and its real status stays
        cancelled_path.touch(mode=0o600)
        pgid = int(handle.metadata["pid"])
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.grace_period
        while time.monotonic() < deadline:
            self._reap(handle)
            if not _group_alive(pgid):
                return
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap(handle, wait=True)

    def _forked_returncode(self, handle: ReplicaHandle) -> int | None:
        """The exit status of a replica a template forked, once the template has reaped it (a
        moment after it ended); None if it was not forked, or its template ended first."""
        if not handle.metadata.get("forked"):
            return None
        stem, deadline = handle.metadata["stem"], time.monotonic() + 2.0
        while (code := warmstart.read_returncode(stem)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return code

    def _reap(self, handle: ReplicaHandle, wait: bool = False) -> None:
        proc = self._procs.get((handle.metadata["run_id"], handle.rank, handle.attempt))
        if proc is not None:
            try:
                proc.wait(timeout=2) if wait else proc.poll()
            except subprocess.TimeoutExpired:
                pass
