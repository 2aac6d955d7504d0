"""bench/peers.py's torchft side: its own venv, a lighthouse, N replica processes, a kill and a restart.

torchft is never imported here, nor installed into diloco's environments: it lives in a venv of
its own (`BENCH_TORCHFT_VENV`, default ~/.cache/diloco-bench/torchft-0.2.0), made on first use
(~40 s here from the local wheels) and reused while its marker names the same pins. torch is
pinned exactly: a looser spec pulls the CUDA build. The replicas are `_torchft_worker.py`
processes in that venv, reading the same spec the diloco side runs.

torchft leaves relaunching a dead replica to the user's scheduler; here the bench plays that
scheduler, restarting the killed replica the moment it has reaped it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

PINS = ["torchft==0.2.0", "torch==2.13.0", "numpy"]
VENV = Path(os.environ.get("BENCH_TORCHFT_VENV", Path.home() / ".cache" / "diloco-bench" / "torchft-0.2.0"))
WORKER = Path(__file__).with_name("_torchft_worker.py")
TIMEOUT_S = 30.0  # the Manager's and gloo's timeout: how long a survivor waits on a dead peer at most
LISTENING = re.compile(r"listening on: http://[^:]+:(\d+)")


def torchft_python() -> Path:
    """The torchft venv's interpreter, made first if the venv is missing or was made for other pins."""
    python, marker = VENV / "bin" / "python", VENV / "diloco-bench-pins.txt"
    if python.exists() and marker.exists() and marker.read_text() == "\n".join(PINS):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"installing {' '.join(PINS)} into {VENV} failed:\n{proc.stderr[-3000:]}")
    marker.write_text("\n".join(PINS))
    return python


def start_lighthouse(stack: ExitStack, log: Path) -> str:
    """torchft's lighthouse on a free loopback port, min_replicas 1 (survivors of a kill go on), the
    rest torchft's defaults; its address once it says it is listening."""
    out = stack.enter_context(log.open("w"))
    proc = subprocess.Popen([str(VENV / "bin" / "torchft_lighthouse"), "--bind", "127.0.0.1:0", "--min_replicas", "1"],
                            stdout=out, stderr=subprocess.STDOUT)
    stack.callback(lambda: (proc.kill(), proc.wait()))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if match := LISTENING.search(log.read_text()):
            return f"http://127.0.0.1:{match.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"torchft's lighthouse did not start:\n{log.read_text()[-2000:]}")


def events_of(path: Path) -> list[dict]:
    """A worker's JSON lines so far (a line still being written is left for the next read)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def run(spec: Path, replicas: int, tmp: Path, kill_after_round: int | None = None,
        kill_delay: Callable[[], float] = lambda: 0.0) -> dict:
    """One torchft DiLoCo run of `spec` at N = `replicas`. With `kill_after_round`, the last
    replica is SIGKILLed `kill_delay()` seconds after it reports that round, restarted at once,
    and the seconds until its first committed round are measured."""
    python = torchft_python()
    tmp.mkdir(parents=True)
    go, victim = tmp / "go", replicas - 1
    with ExitStack() as stack:
        lighthouse = start_lighthouse(stack, tmp / "lighthouse.log")

        def launch(rank: int, attempt: int) -> subprocess.Popen:
            cmd = [str(python), str(WORKER), "--spec", str(spec), "--replica", str(rank), "--timeout-s", str(TIMEOUT_S),
                   "--lighthouse", lighthouse, "--events", str(tmp / f"events-{rank}-{attempt}.jsonl"),
                   "--go", str(go), *(["--rejoin"] if attempt else [])]
            log = stack.enter_context((tmp / f"worker-{rank}-{attempt}.log").open("w"))
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
            return proc

        t0 = time.monotonic()
        procs = {rank: launch(rank, 0) for rank in range(replicas)}
        # imports alone took 5-45 s on the loaded 2-core development machine
        wait_for(lambda: all(events_of(tmp / f"events-{r}-0.jsonl") for r in procs), procs, tmp, 300)
        startup_s = time.monotonic() - t0
        go.touch()
        killed_at = None
        if kill_after_round is not None:
            wait_for(lambda: any(e.get("round", 0) >= kill_after_round for e in events_of(tmp / f"events-{victim}-0.jsonl")),
                     procs, tmp, 300)
            time.sleep(kill_delay())
            killed_at = time.time()
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait()
            procs[victim] = launch(victim, 1)  # the scheduler's part: relaunch at once
        for rank, proc in procs.items():
            if proc.wait(timeout=900) != 0:
                log = tmp / f"worker-{rank}-{1 if rank == victim and killed_at else 0}.log"
                raise SystemExit(f"torchft replica {rank} failed:\n{log.read_text()[-3000:]}")
    return summarise(tmp, replicas, killed_at, startup_s)


def wait_for(ready: Callable[[], bool], procs: dict[int, subprocess.Popen], tmp: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [r for r, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            log = tmp / f"worker-{dead[0] if dead else 0}-0.log"
            raise SystemExit(f"torchft side stuck or failed ({'replica ' + str(dead) + ' exited' if dead else 'timeout'})"
                             f":\n{log.read_text()[-3000:]}")
        time.sleep(0.02)


def summarise(tmp: Path, replicas: int, killed_at: float | None, startup_s: float) -> dict:
    """The workers' events as bench/peers.py compares them: the median inner step, each committed
    round's sync seconds per replica (the time in DiLoCo's post-step hook), eval loss, and after a kill the seconds until the restarted replica's first committed
    round."""
    finals, inner, syncs = [], [], {}
    for rank in range(replicas):
        attempts = [events_of(p) for p in sorted(tmp.glob(f"events-{rank}-*.jsonl"))]
        done = next(e for e in attempts[-1] if e["event"] == "done")
        finals.append(done)
        inner.append(done["inner_step_s"])
        for e in (e for events in attempts for e in events if e["event"] == "round" and e["committed"]):
            syncs.setdefault(e["round"], []).append(e["sync_s"])
    if len({d["theta_crc32"] for d in finals}) != 1:
        raise SystemExit("torchft replicas disagree on the global model")
    result = {"system": "torchft", "replicas": replicas, "startup_s": round(startup_s, 2),
              "inner_step_s": statistics.median(inner), "sync_s_by_round": syncs,
              "eval_loss": finals[0]["eval_loss"], "train_s": max(d["wall_s"] for d in finals)}
    if killed_at is not None:
        restart = events_of(tmp / f"events-{replicas - 1}-1.jsonl")
        up = next(e for e in restart if e["event"] == "up")
        back = next(e["t"] for e in restart
                    if e["event"] == "round" and e["committed"] and e["participants"] == replicas)
        discarded = sum(1 for r in range(replicas - 1) for e in events_of(tmp / f"events-{r}-0.jsonl")
                        if e["event"] == "round" and not e["committed"])
        result.update(rejoin_s=round(back - killed_at, 2), restarted_up_s=round(up["t"] - killed_at, 2),
                      restart_imports_s=round(up["imports_s"], 2),
                      survivor_rounds_discarded=discarded)
    return result
