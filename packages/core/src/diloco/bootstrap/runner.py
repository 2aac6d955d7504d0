"""The bootstrap that runs inside every replica: `python -m diloco.bootstrap.runner`.

It reads the entrypoint from DILOCO_ENTRYPOINT, marks the replica started, runs it, and writes
a JSON result (status, exit code, traceback, return value) where DILOCO_RESULT_PATH points.
It also enforces DILOCO_TIMEOUT itself, so a hung replica dies on every backend: a watchdog
thread records the timeout and kills the replica's whole process group.

Function entrypoints are called as `fn(**args)`; a parameter named `ctx` receives the
`ReplicaContext`. Command entrypoints run as a child in the same process group, so killing the
group (cancel, timeout) takes the command and everything it started.

Imports are kept to the minimum (subprocess, traceback, inspect load only when needed): this
module's start-up is paid once per replica launch (see bench/launch.py).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time


from ..inputs import envvars as v
from ..inputs.resultline import RESULT_PREFIX
from .context import ReplicaContext
from .failures import CAUSE_PREFIX, PREEMPTED_CAUSE, TIME_LIMIT_CAUSE, USER_ERROR_PREFIX


def write_text_atomic(path: str, text: str) -> None:
    """Write-then-rename, so the launcher never reads half a result; 0600 from the first byte, as
    the state dir's files are (a result holds the entrypoint's return value and traceback). Not
    `diloco.host.statedir.private_file`: importing the state module would slow every replica's start."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _result_json(data: dict[str, object]) -> str:
    import json  # loaded only now: json pulls in re and enum, ~8 ms of every replica's start

    try:
        return json.dumps(data)
    except (TypeError, ValueError):
        return json.dumps({**data, "result": repr(data["result"])})


def load_function(ref: str):
    module_name, _, attr = ref.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"entrypoint {ref!r} is not callable")
    return obj


def _parameters(fn) -> tuple[set[str], bool]:
    """(parameter names, accepts **kwargs) — from the code object when it is a plain function."""
    code = getattr(fn, "__code__", None)
    if code is not None and not hasattr(fn, "__wrapped__"):
        n = code.co_argcount + code.co_kwonlyargcount
        return set(code.co_varnames[:n]), bool(code.co_flags & 0x08)
    import inspect

    params = inspect.signature(fn).parameters
    return set(params), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def call_function(fn, ctx: ReplicaContext) -> object:
    kwargs = dict(ctx.args)
    names, accepts_any = _parameters(fn)
    if "ctx" in names:
        kwargs["ctx"] = ctx
    if not accepts_any:
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"entrypoint does not accept argument(s) {unknown}; it takes {sorted(names)}")
    return fn(**kwargs)


class _Outcome:
    """Writes the result exactly once, whoever finishes first (the entrypoint or the watchdog)."""

    def __init__(self, path: str | None, rank: int, attempt: int):
        self.path, self.rank, self.attempt = path, rank, attempt
        self._lock = threading.Lock()
        self.written = False

    def write(self, status: str, exit_code: int, error: str | None = None, result: object = None) -> bool:
        with self._lock:
            if self.written:
                return False
            self.written = True
        if self.path:
            write_text_atomic(self.path, _result_json({
                "rank": self.rank, "attempt": self.attempt, "status": status, "exit_code": exit_code,
                "error": error, "result": result, "ended_at": time.time()}))
        elif status == "succeeded" and result is not None:  # no shared disk: the result travels in the logs
            print(f"{RESULT_PREFIX}{_result_json({'result': result})}", flush=True)
        return True


def _start_watchdog(timeout: float, outcome: _Outcome) -> None:
    """Stop the replica at the spec's `timeout`: exit 124 with the time-limit cause, its last words
    in the log for backends that only have logs (the group's SIGKILL takes this process too)."""
    def fire() -> None:
        from ..errors import EXIT_TIME_LIMIT

        msg = TIME_LIMIT_CAUSE.format(what=f"replica timed out after {timeout:g}s (spec `timeout`)")
        if outcome.write("failed", EXIT_TIME_LIMIT, msg):
            print(f"{CAUSE_PREFIX}{msg}; killing the replica", file=sys.stderr, flush=True)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()


def _run_command(cmd: list[str], outcome: _Outcome) -> int:
    import subprocess

    if cmd[0] in ("python", "python3"):
        cmd = [sys.executable, *cmd[1:]]  # the interpreter diloco runs in, not whatever PATH finds
    code = subprocess.call(cmd)
    if code == 0:
        outcome.write("succeeded", 0)
        return 0
    outcome.write("failed", code, f"command {' '.join(cmd)!r} exited with code {code}")
    return 1


def failure_cause(exc: BaseException, ctx: ReplicaContext) -> str:
    """The first line of a failed replica's error: the exception, and where training was.

    The global step (set by the DiLoCo runtime as it trains) lets the supervisor tell a bug that
    every rank hits at the same step from infrastructure failures, which never carry one.
    """
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    step = getattr(ctx, "global_step", None)
    return f"{text} (at global step {step})" if step is not None else text


def lane_result_path(path: str, lane: int) -> str:
    """Where process `lane` of a multi-process replica writes its result; `diloco_replica.torchrun`
    turns the lanes' results into the replica's one result at `path`."""
    return f"{path}.lane-{lane}"


def preemption_signal() -> signal.Signals | None:
    """The signal this replica's platform announces a preemption with (DILOCO_PREEMPTION_SIGNAL), if any."""
    name = os.environ.get(v.ENV_PREEMPTION_SIGNAL)
    try:
        return signal.Signals[name] if name else None
    except KeyError:
        return None


def _exit_on_preemption(sig: signal.Signals, outcome: _Outcome) -> None:
    """Turn the platform's preemption notice into exit 75 with a cause that says so, so the
    supervisor relaunches the replica without counting a failure."""
    from ..errors import EXIT_PREEMPTED

    def handler(*_: object) -> None:
        cause = PREEMPTED_CAUSE.format(signal=sig.name)
        if outcome.write("failed", EXIT_PREEMPTED, cause):
            print(f"{CAUSE_PREFIX}{cause}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED)

    signal.signal(sig, handler)


def _die_with_parent() -> None:
    """A process of a multi-process replica dies with its torchrun parent (even SIGKILLed), so no
    orphan keeps training into the store after its replica was stopped or relaunched. Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the line above ran
        os._exit(137)


_IMPORT_NAMES = {"diloco-core": "diloco", "diloco-replica": "diloco_replica"}


def installed_version(dist: str) -> str | None:
    """The version of `dist` this replica holds; from the dist-info beside the package when it is
    there (a listdir: importlib.metadata scans all of sys.path, ~30 ms of every start)."""
    import importlib.util

    spec = importlib.util.find_spec(_IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    if spec is not None and spec.origin:
        site = os.path.dirname(os.path.dirname(spec.origin))
        stem = dist.replace("-", "_") + "-"
        try:
            found = [n for n in os.listdir(site) if n.startswith(stem) and n.endswith(".dist-info")]
        except OSError:
            found = []
        if len(found) == 1:
            return found[0][len(stem):-len(".dist-info")]
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_mismatch(expected: str) -> str | None:
    """Why this replica must not run (its diloco is not the run's, DILOCO_VERSION), or None."""
    for item in expected.split():
        name, _, want = item.partition("==")
        have = installed_version(name)
        if have != want:
            return (f"this replica holds {name} {have or '(not installed)'} but the run was launched with "
                    f"{name} {want}: install the launcher's diloco in the image (images diloco builds do), or "
                    f"launch from the diloco the image holds")
    return None


def main() -> int:
    ctx = ReplicaContext.from_env()
    entrypoint = os.environ[v.ENV_ENTRYPOINT]
    result_path = os.environ.get(v.ENV_RESULT_PATH)
    if ctx.lanes > 1:
        _die_with_parent()
        result_path = lane_result_path(result_path, ctx.lane) if result_path else None
    outcome = _Outcome(result_path, ctx.rank, ctx.attempt)
    mismatch = version_mismatch(os.environ.get(v.ENV_VERSION, ""))
    if mismatch:
        from ..errors import EXIT_CONFIG

        print(f"{USER_ERROR_PREFIX}{mismatch}", file=sys.stderr, flush=True)
        outcome.write("failed", EXIT_CONFIG, mismatch)
        return EXIT_CONFIG
    timeout = float(os.environ.get(v.ENV_TIMEOUT) or 0)
    if timeout > 0:
        _start_watchdog(timeout, outcome)
    if os.environ.get(v.ENV_FAULT_CLOCK_SKEW):  # a test's skewed wall clock (diloco.bootstrap.clockskew)
        from .clockskew import install_from_env

        install_from_env(ctx.rank)
    # SIGTERM (cancel) becomes a clean exit so `finally` blocks in user code run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    preempt = preemption_signal()
    if preempt is not None:  # with several processes torchrun receives it too, and may be second
        _exit_on_preemption(preempt, outcome)  # (Slurm's cgroup signals every process of the step)
    started = os.environ.get(v.ENV_STARTED_PATH)
    if started and ctx.lane == 0:
        write_text_atomic(started, f'{{"pid": {os.getpid()}, "started_at": {time.time()!r}}}')
    try:
        if not entrypoint.startswith("["):  # "module:function"; a command is a JSON array
            result = call_function(load_function(entrypoint), ctx)
            outcome.write("succeeded", 0, result=result)
            return 0
        import json

        return _run_command(json.loads(entrypoint), outcome)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 143:
            return 143  # cancelled: the launcher's marker says so, no result to write
        if code == 0:
            outcome.write("succeeded", 0)
        else:
            outcome.write("failed", code, f"entrypoint exited with code {code}")
        return code
    except BaseException as exc:
        from ..errors import EXIT_CONFIG, UserError

        if isinstance(exc, UserError):  # a mistake in the spec or the store, not in the code: one line
            print(f"{USER_ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
            outcome.write("failed", EXIT_CONFIG, str(exc))
            return EXIT_CONFIG
        from ..store.outage import StoreUnreachable

        if isinstance(exc, StoreUnreachable):  # the store, not the code: one line, no step (not a bug
            cause = f"StoreUnreachable: {exc}"  # every rank hits at one step), relaunched per the policy
            sys.stderr.write(f"{CAUSE_PREFIX}{cause}\n")
            sys.stderr.flush()
            outcome.write("failed", 1, cause)
            return 1
        import traceback

        tb = traceback.format_exc()
        cause = failure_cause(exc, ctx)
        sys.stderr.write(f"{tb}{CAUSE_PREFIX}{cause}\n")  # last line: backends that only have logs read it
        sys.stderr.flush()
        outcome.write("failed", 1, f"{cause}\n{tb}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
