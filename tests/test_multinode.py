"""Islands of several nodes on the local backend: a replica of K torchrun agents on loopback.

Real processes throughout, through `diloco run`: the local backend starts a replica of
`nodes = 2` as two torchrun agents (`diloco.local.island`), joined by torch's static rendezvous
on the first node, whose processes are one gloo group; every process of the replica exchanges
its own lane with the store. What a user would notice is checked: a replica of 2 nodes × 2
processes and one of 1 process hold the same model, bit for bit, on every process after every
round; a node lost is the replica's loss, counted once, and the replica rejoins bit-identical
while the other trains on; `diloco scale` adds a replica of two nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_elastic import events, scale, start, wait_for

from diloco.runrecord.state import RunRecord
from diloco.store.metrics import read_rounds

pytest.importorskip("torch")

HERE = Path(__file__).parent
EXAMPLE = HERE.parent / "examples" / "tiny-lm"


@pytest.fixture
def lanes_env(monkeypatch):
    """Replicas import the test jobs (tests/) and the example's model (examples/tiny-lm)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))


def island_groups(processes: int) -> str:
    """Replica 0: one process on one node; replica 1: two nodes of `processes` processes."""
    return f"""
[[group]]
name = "single"
replicas = 1
[group.backend]
name = "local"
[[group]]
name = "island"
replicas = 1
nodes = 2
processes_per_replica = {processes}
[group.backend]
name = "local"
"""


def spec_text(tmp_path: Path, name: str, trace: Path, *, steps: int, processes: int, extra: str = "",
              diloco: str = "") -> Path:
    spec = tmp_path / "diloco.toml"
    spec.write_text(f"""
name = "{name}"
entrypoint = "lane_jobs:train_traced"
workdir = "{HERE}"
timeout = 600
[args]
trace_dir = "{trace}"
steps = {steps}
parallel = "fsdp"
{extra}
[diloco]
sync_every = 10
round_timeout = 60
checkpoint_every = 2
outer_lr = 1.0
outer_momentum = 0.7
{diloco}
[restart]
monitor_interval = 0.2
backoff = 0.2
{island_groups(processes)}""")
    return spec


def traces_of(trace: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(trace.glob("*.json"))]


def test_a_replica_of_two_nodes_and_one_of_one_process_hold_the_same_model_after_every_round(
        tmp_path, lanes_env, state_dir):
    """2 nodes × 2 processes (FSDP2 across both nodes, the rounds in sync processes that meet at
    lane 0's store on node 0) beside a replica of one process: the same θ on all five processes."""
    trace = tmp_path / "trace"
    trace.mkdir()
    spec = spec_text(tmp_path, "mn-mixed", trace, steps=30, processes=2, diloco='exchange = "process"')
    dry = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    shown = dry.stdout + dry.stderr
    assert "1–4 processes on 1–2 nodes" in shown and "group island: 1 × local (2 nodes)" in shown, shown
    assert '"diloco.local.island"' in shown and '"--nnodes"' in shown
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", str(spec)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    traces = traces_of(trace)
    assert sorted((t["rank"], t["lane"]) for t in traces) == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]
    for r in ("1", "2", "3"):  # all five processes, the whole model, bit for bit
        assert len({t["hashes"][r] for t in traces}) == 1, (r, [t["hashes"][r] for t in traces])
    assert len({t["final"] for t in traces}) == 1
    run_id = proc.stdout.split()[1].rstrip(":")
    rows = read_rounds(RunRecord.load(run_id, state_dir).rendezvous, run_id)
    assert [r.members for r in rows] == [[0, 1]] * 3
    for row in rows:  # one digest of the whole state, the same for a replica of one lane and of four
        assert len({x.state_digest for x in row.rows}) == 1 and row.diverged is None


def agent_of_node(node: int, run_marker: str) -> int | None:
    """The pid of the torchrun agent of `node` in a replica whose environment holds `run_marker`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"diloco_replica.torchrun" in cmd and f"PET_NODE_RANK={node}".encode() in env \
                and any(run_marker.encode() in e for e in env):
            return int(entry.name)
    return None


def test_a_node_lost_is_the_replicas_loss_counted_once_it_rejoins_and_diloco_scale_adds_another_island(
        tmp_path, cli, lanes_env, state_dir):
    """SIGKILL the torchrun agent of node 1 of the two-node replica mid-round: the island stops
    node 0, the replica fails once and is relaunched as one attempt (both nodes), rejoining from
    the store while replica 0 trains on; then `diloco scale` adds a second two-node replica from
    another shell, which loads the global state and is admitted at a round. Every round's members
    hold the same θ_global and momentum (their state digests) throughout; then the run is cancelled."""
    phases, trace = tmp_path / "phases", tmp_path / "trace"
    phases.mkdir()
    trace.mkdir()
    spec = spec_text(tmp_path, "mn-kill", trace, steps=100_000, processes=1,
                     extra=f'[env]\nDILOCO_FAULT_PHASE_FILE = "{phases}/phase-{{rank}}-{{lane}}"\n'
                           f'DILOCO_FAULT_PHASE_DELAY = "0.2"\n')
    spec.write_text(spec.read_text().replace('parallel = "fsdp"', 'parallel = "ddp"'))
    proc, run_id = start(spec)
    marker, killed = phases / "phase-1-1", None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                phase, r, _pid = marker.read_text().split()
            except (FileNotFoundError, ValueError):
                time.sleep(0.02)
                continue
            if phase == "gather" and int(r) >= 2:
                agent = agent_of_node(1, str(phases))
                if agent is not None:
                    os.kill(agent, signal.SIGKILL)
                    killed = int(r)
            time.sleep(0.01)
        assert killed is not None
        back = wait_for(state_dir, run_id, lambda e: e["event"] == "running" and e.get("attempt") == 1)
        wait_for(state_dir, run_id, lambda e: e["event"] == "round" and e["members"] == [0, 1] and e["t"] > back["t"])
        scale(cli, run_id, 2, "--group", "island")  # the island group: 1 → 2 replicas of two nodes
        grown = wait_for(state_dir, run_id, lambda e: e["event"] == "round" and len(e["members"]) == 3)
        wait_for(state_dir, run_id, lambda e: e["event"] == "round" and e["round"] >= grown["round"] + 1)
    finally:
        cancelled = cli("cancel", run_id)
        out, _ = proc.communicate(timeout=120)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert re.search(r"failed attempt=0 (group=island )?rank=1", out) and "node 1 of 2" in out, out
    assert out.count("relaunch_scheduled") == 1, out  # one node lost: one failure seen, one relaunch
    record = RunRecord.load(run_id, state_dir)
    assert record.data["restarts_used"] == 1 and [r["restarts"] for r in record.data["ranks"]] == [0, 1, 0]
    relaunched = (state_dir / "local" / run_id / "rank-1.attempt-1.log").read_text()
    assert "[rank 1 process 0 attempt 1]" in relaunched and "[rank 1 process 1 attempt 1]" in relaunched
    added = (state_dir / "local" / run_id / "rank-2.attempt-0.log").read_text()
    assert "[rank 2 process 1 attempt 0]" in added  # the new island's second node exchanged its lane
    scaled = [e for e in events(state_dir, run_id) if e["event"] == "scaled"]
    assert [(e["replicas_from"], e["replicas_to"], e["added"]) for e in scaled] == [(2, 3, [2])], out
    rows = read_rounds(record.rendezvous, run_id)
    assert any(r.members == [0] for r in rows)  # rounds went on without the lost replica
    assert sum(r.members == [0, 1, 2] for r in rows) >= 2
    for row in rows:  # every round's members, old, relaunched and new, on the same state
        assert len({x.state_digest for x in row.rows}) == 1 and row.diverged is None, row.round


def test_the_nodes_example_dry_runs_as_the_readme_shows(tmp_path, state_dir):
    dry = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(EXAMPLE / "diloco-nodes.toml")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "2 replicas × 2 processes on 2 nodes" in dry.stderr and "per node per round" in dry.stderr
    first = json.loads(dry.stdout)["processes"][0]["argv"]
    assert first[first.index("--nnodes") + 1] == "2" and first[first.index("--nproc-per-node") + 1] == "1"
