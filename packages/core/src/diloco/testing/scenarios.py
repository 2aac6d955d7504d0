"""End-to-end scenarios every remote backend's tests run the same way, through the real CLI.

A backend's test double (a Kubernetes emulator, a Modal double, a SageMaker control plane) is
wrapped in a `StandIn`: how a shell reaches it (environment, CLI module) and which replica
processes still run on it. The scenarios then do what a user does from several shells — start a
run, kill or detach the launcher, `status`, `resume`, `cancel` — and check what a user would
notice. Each backend package's e2e tests call them instead of writing them again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def record_of(state: Path, run_id: str) -> dict[str, Any]:
    """A run's record as the launcher saved it (run.json)."""
    return json.loads((Path(state) / "runs" / run_id / "run.json").read_text())


def events_of(state: Path, run_id: str) -> list[dict[str, Any]]:
    """The run's events as a test reads them: a line that is not a JSON object (torn by a crash
    mid-write, or garbage a test put there) is skipped, as the launcher's readers skip it."""
    path = Path(state) / "runs" / run_id / "events.jsonl"
    events = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def wait_for_round(state: Path, run_id: str, n: int, timeout: float = 300) -> None:
    """Until the launcher has recorded round `n`; fails at once if the run ends without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = events_of(state, run_id)
        if any(e.get("event") == "round" and e["round"] >= n for e in events):
            return
        if any(e.get("event") in ("run_succeeded", "run_failed") for e in events):
            raise AssertionError(f"the run ended with no round {n} event: {events[-5:]}")
        time.sleep(0.2)
    raise AssertionError(f"round {n} never completed: {events_of(state, run_id)[-5:]}")


def one_global_model(record: dict[str, Any]) -> None:
    """Every rank succeeded holding the same global θ: the digest each entrypoint returned (`DiLoCo.theta_digest`), which remote
    backends read back from the replica's log as JSON (nothing is unpickled)."""
    ranks = record["ranks"]
    assert all(r["status"] == "succeeded" for r in ranks), [(r["rank"], r["status"], r["last_error"]) for r in ranks]
    crcs = {r["result"]["theta_digest"] for r in ranks}
    assert len(crcs) == 1, f"replicas disagree on the global model: {crcs}"


def wait_until_nothing_runs(live_processes: Callable[[], list], timeout: float) -> list:
    """Wait for a stand-in's replica processes to end; what still runs after `timeout`."""
    deadline = time.monotonic() + timeout
    while live_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    return live_processes()


@dataclass
class StandIn:
    """How the scenarios reach a backend's test double from a new shell."""

    live_processes: Callable[[], list]           # replica processes still running on the double
    env: Mapping[str, str] = field(default_factory=dict)  # what a shell needs to reach the double
    module: str = "diloco"                       # `python -m MODULE` is the CLI (a wrapper may install the double)

    def shell_env(self, state: Path) -> dict[str, str]:
        return {**os.environ, "DILOCO_STATE_DIR": str(state), **self.env}

    def cli(self, state: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """One command from a new shell, to its end."""
        return subprocess.run([sys.executable, "-m", self.module, *args], capture_output=True, text=True,
                              timeout=timeout, env=self.shell_env(state))

    def start(self, state: Path, *args: str) -> tuple[subprocess.Popen, str]:
        """A launcher left running (`diloco run SPEC`), and its run id from its first line."""
        proc = subprocess.Popen([sys.executable, "-m", self.module, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=self.shell_env(state))
        return proc, proc.stdout.readline().split()[1].rstrip(":")


def killed_launcher_is_resumed(cloud: StandIn, state: Path, spec: Path,
                               while_detached: Callable[[str], None] | None = None) -> dict[str, Any]:
    """SIGKILL the launcher after round 1; another shell sees the replicas through the durable
    handles, and `resume` reattaches and finishes the run without relaunching anything."""
    launcher, run_id = cloud.start(state, "run", str(spec))
    wait_for_round(state, run_id, 1)
    launcher.send_signal(9)
    launcher.wait()
    status = cloud.cli(state, "status", run_id, "--json")
    assert status.returncode == 0, status.stderr
    assert set(json.loads(status.stdout)["live"].values()) <= {"running", "succeeded"}
    if while_detached:
        while_detached(run_id)
    resumed = cloud.cli(state, "resume", run_id)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    record = record_of(state, run_id)
    one_global_model(record)
    assert all(r["restarts"] == 0 for r in record["ranks"])  # reattached, nothing relaunched
    return record
