"""The sync process beside each training process: same bytes whatever runs the rounds, and loud deaths."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
import torch

SETTINGS = {"sync_every": 2, "checkpoint_every": 4, "round_timeout": 30, "exchange": "process"}


def sync_children(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if "diloco_replica.exchange.syncproc" in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


def syncprocs_of(parent: int) -> list[psutil.Process]:
    """Sync processes anywhere whose training process was `parent` (orphans included)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "diloco_replica.exchange.syncproc" in cmd and cmd[-1] == str(parent):
            found.append(p)
    return found


def assert_identical_every_round(results: list[dict], rounds: int) -> None:
    seen = set.intersection(*(set(r["hashes"]) for r in results))
    assert len(seen) >= rounds, seen
    for rnd in seen:
        assert len({r["hashes"][rnd] for r in results}) == 1, f"replicas diverge after round {rnd}"
    assert len({r["final"] for r in results}) == 1


def test_replicas_with_different_thread_counts_hold_the_same_bytes_every_round(replicas, store_uri):
    """The training processes' and the sync processes' torch threads differ (1 and 2); overlap and
    int4 with error feedback, so the merge, the quantisation and the outer step all take part."""
    handles = replicas.launch("mlp_rounds", 2, rendezvous=store_uri,
                              settings={**SETTINGS, "overlap": True, "transport": "int4"},
                              args={"steps": 10, "dim": 64, "threads": {"0": 1, "1": 2}})
    assert_identical_every_round(replicas.results(handles), 4)


# CI has no GPU, so this is skipped there; `bash scripts/gpu-check` runs every `cuda` test on a machine with one.
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU; CI has none (bash scripts/gpu-check runs it)")
@pytest.mark.parametrize("mode", [{}, {"overlap": True, "transport": "int4"}], ids=["fp32", "overlap+int4"])
def test_a_cuda_replica_and_a_cpu_replica_hold_the_same_bytes_every_round(replicas, store_uri, mode):
    handles = replicas.launch("mlp_rounds", 2, rendezvous=store_uri, settings={**SETTINGS, **mode},
                              args={"steps": 12, "dim": 64, "cuda_ranks": [0]})
    assert_identical_every_round(replicas.results(handles), 5)


@pytest.mark.parametrize("transport", ["fp32", "int4"])
def test_the_rounds_on_a_thread_give_the_bytes_of_the_sync_process(replicas, store_uri, transport):
    """`exchange = "thread"` (stores only the training process reaches) runs the same Exchanger, from
    Δ read a piece at a time (int4: quantised with error feedback per piece) where the sync process
    reads its snapshot whole."""
    runs = []
    for exchange in ("process", "thread"):
        replicas.run_id = f"{replicas.run_id}-{exchange}"
        handles = replicas.launch("mlp_rounds", 2, rendezvous=store_uri,
                                  settings={**SETTINGS, "exchange": exchange, "transport": transport},
                                  args={"steps": 8, "dim": 32})
        runs.append(replicas.results(handles))
    assert {r["final"] for r in runs[0]} == {r["final"] for r in runs[1]}


def started_sync_process(pid: int) -> psutil.Process:
    deadline = time.monotonic() + 120
    while not (children := sync_children(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children, "no sync process started"
    return children[0]


def test_a_sync_process_that_dies_fails_its_replica_in_one_line(replicas, store_uri):
    [handle] = replicas.launch("mlp_rounds", 1, rendezvous=store_uri, settings=SETTINGS,
                               args={"steps": 2000, "dim": 16, "slow_ranks": [0], "step_sleep": 0.01})
    child = started_sync_process(handle.metadata["pid"])
    time.sleep(1.0)
    child.send_signal(signal.SIGKILL)
    [res] = replicas.executor.collect([handle], timeout=300)
    assert res.status == "failed", res
    cause = res.error.splitlines()[0]  # the line the launcher shows (the training process's trace follows, for the log)
    # the global step the runner appends once training has begun (the kill may land before or after)
    assert re.fullmatch(rf"RoundFailed: the sync process \(pid {child.pid}\) was killed by signal 9; this replica "
                        rf"stops rather than train without it( \(at global step \d+\))?", cause), cause


def test_no_sync_process_outlives_its_replica(replicas, store_uri):
    """Neither after close() (a finished run) nor after a SIGKILL of the training process."""
    [done] = replicas.launch("mlp_rounds", 1, rendezvous=store_uri, settings=SETTINGS, args={"steps": 4, "dim": 16})
    pid = done.metadata["pid"]
    replicas.results([done])
    assert not syncprocs_of(pid)
    replicas.run_id += "-killed"
    [victim] = replicas.launch("mlp_rounds", 1, rendezvous=store_uri, settings=SETTINGS,
                               args={"steps": 2000, "dim": 16, "slow_ranks": [0], "step_sleep": 0.01})
    orphan = started_sync_process(victim.metadata["pid"])
    os.kill(victim.metadata["pid"], signal.SIGKILL)
    orphan.wait(timeout=30)  # the kernel ends it with its parent (PR_SET_PDEATHSIG)
    assert not syncprocs_of(victim.metadata["pid"])
