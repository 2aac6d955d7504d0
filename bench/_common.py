"""What every bench shares: its quick mode, and the main job's spec rewritten as data.

`BENCH_QUICK=1` makes every bench a smoke run (seconds to a few minutes on 2 cores) that CI runs
and whose JSON `tests/test_benches.py` checks, so no bench rots unseen again: `sync_modes.py`
and `tiny_lm.py` once edited the example's TOML as text and broke, unnoticed, when the example
moved `steps` into `[diloco] total_steps`. They now load it, change the data and write it back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

QUICK = os.environ.get("BENCH_QUICK") == "1"
ROOT = Path(__file__).resolve().parents[1]
TINY_LM = ROOT / "examples" / "tiny-lm"


def knob(name: str, full: str, quick: str) -> str:
    """The environment's `name`, else the quick or the full default."""
    return os.environ.get(name, quick if QUICK else full)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r} in a bench spec")


def toml_text(spec: dict[str, Any]) -> str:
    """A spec of scalars and one level of tables as TOML (all the example specs need)."""
    top = [f"{k} = {_value(v)}" for k, v in spec.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "\n".join(f"{kk} = {_value(vv)}" for kk, vv in v.items())
              for k, v in spec.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


# A smoke run proves the bench still runs and reports, not the numbers: in quick mode the main
# job's model is a sixth of its size (dim 64, 1 layer) and trains on less text.
QUICK_MODEL = {"batch_size": 8, "context": 32, "dim": 64, "layers": 1, "max_bytes": 500_000}
QUICK_PARAMETERS = 84928  # that TinyLM's parameter count
QUICK_REPLICAS = 2  # a smoke run's replicas: every path of a run (a round, its members, the report) with half the processes


def tiny_lm_spec(*, args: dict[str, Any] | None = None, diloco: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """The main job's spec (examples/tiny-lm/diloco.toml) with these keys changed (in quick mode
    its model shrunk first, `QUICK_MODEL`, and its replicas, `QUICK_REPLICAS`)."""
    spec = tomllib.loads((TINY_LM / "diloco.toml").read_text())
    spec["workdir"] = str(TINY_LM)
    if QUICK:
        spec["args"].update(QUICK_MODEL)
        spec["diloco"]["parameters"] = QUICK_PARAMETERS
        spec["replicas"] = QUICK_REPLICAS
    spec.setdefault("args", {}).update(args or {})
    spec.setdefault("diloco", {}).update(diloco or {})
    if env:
        spec.setdefault("env", {}).update(env)
    return spec


def run_spec(spec: Path, state: Path, label: str) -> tuple[Path, float]:
    """`diloco run spec` as a user runs it, with its own state dir: the run's directory (its record,
    events and artifacts) and the wall time. Exits the bench with the run's output if it failed."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "cancel"],
                          capture_output=True, text=True, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"diloco run ({label}) failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    run_id = proc.stdout.split()[1].rstrip(":")
    return state / "runs" / run_id, wall


def rss_kb() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_kb(pid: int | str = "self") -> int:
    """A process's peak RSS (VmHWM; this one's by default). Not getrusage's ru_maxrss: Linux carries
    that across fork and exec, so a spawned worker would report the launching process's size (moto's
    objects) as its own."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


class HostMemory:
    """The host memory a process tree holds, sampled on a thread every `every` seconds: the sum of
    each process's proportional set size (Pss: a page shared by k processes counts 1/k in each),
    so memory a training process shares with its sync process counts once, which summed RSS
    peaks count twice. `mark()` gives the peak since the previous mark (or the start) over the
    given `base`, and starts the next window: a bench takes its base just before `DiLoCo(...)`,
    marks once it is built (the join's peak: checkpoint loads, θ_0) and once training ends (the
    rounds' peak), so each phase is measured over the same process without DiLoCo."""

    def __init__(self, every: float = 0.1):
        import threading

        import psutil

        self._me, self._every = psutil.Process(), every
        self._lock, self._stop = threading.Lock(), threading.Event()
        self.base = self._pss()
        self._peak = self.base
        self._thread = threading.Thread(target=self._sample, name="bench-host-memory", daemon=True)
        self._thread.start()

    def _pss(self) -> int:
        total = 0
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                total += proc.memory_full_info().pss
            except Exception:  # noqa: BLE001 - a child that ended between the listing and the read
                continue
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self._every):
            now = self._pss()
            with self._lock:
                self._peak = max(self._peak, now)

    def mark(self) -> int:
        """Bytes: the window's peak over `base` (a last sample is taken first)."""
        now = self._pss()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return max(0, peak - self.base)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def baseline_sources(stack: ExitStack, rev: str) -> list[str]:
    """A `git worktree` of `rev` (removed when `stack` closes); its core and replica source folders,
    for workers that put them first on sys.path to run that revision's code in the same bench run."""
    where = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True,
                   capture_output=True)
    stack.callback(subprocess.run, ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                   capture_output=True)
    return [str(where / "packages" / p / "src") for p in ("core", "replica")]
