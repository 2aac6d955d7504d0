"""A replica of several processes (torchrun): lanes, their agreement, and what the replica reports.

Real processes: the local executor starts each replica as `diloco_replica.torchrun` over L
runners, and the lanes talk over a real gloo group.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from diloco_replica.round.lanes import Lanes, Retry
from diloco_replica.round.layout import BLOCK
from diloco_replica.round.errors import FellBehind, RoundFailed


def lane_results(executor, handles) -> list[dict]:
    out = []
    for h in handles:
        for line in executor.stream_logs(h, n_lines=2000).splitlines():
            if line.startswith("LANE-RESULT "):
                out.append(json.loads(line[len("LANE-RESULT "):]))
    return out


def test_a_plain_module_in_every_process_holds_the_global_model_after_every_round(replicas, store_uri):
    handles = replicas.launch("plain_lanes", 2, rendezvous=store_uri, processes=2,
                              settings={"sync_every": 2, "checkpoint_every": 2}, args={"steps": 8, "dim": 48})
    replicas.results(handles)
    lanes = lane_results(replicas.executor, handles)
    assert sorted((x["rank"], x["lane"]) for x in lanes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ("1", "2", "3", "4"):
        assert len({x["hashes"][r] for x in lanes}) == 1, r
    sizes = {x["lane"]: x["numel"] for x in lanes}
    total = 4 * 48 * 48 + 8 * 48 + 1  # 9,601 values: three blocks of 4,096, two for lane 0
    assert sizes == {0: 2 * BLOCK, 1: total - 2 * BLOCK}  # lane k: its whole blocks of θ


def test_time_based_rounds_close_in_every_process_of_a_replica_at_the_same_step(replicas, store_uri):
    """round_seconds with 2 processes per replica, one of them slower: the processes agree when a
    round is due (each would read its own clock otherwise and wait forever in different rounds)."""
    handles = replicas.launch("plain_lanes", 2, rendezvous=store_uri, processes=2,
                              settings={"sync_every": 50, "round_seconds": 0.3, "round_timeout": 20},
                              args={"steps": 200, "dim": 16, "slow_lane": 1, "step_sleep": 0.01})
    replicas.results(handles)
    lanes = lane_results(replicas.executor, handles)
    assert sorted((x["rank"], x["lane"]) for x in lanes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {x["rounds"] for x in lanes} == {4} and len({x["final"] for x in lanes}) == 1
    for r in ("1", "2", "3", "4"):
        assert len({x["hashes"][r] for x in lanes}) == 1, r


def test_a_config_error_in_one_process_is_the_replicas_config_error(replicas, store_uri):
    handles = replicas.launch("plain_lanes", 1, rendezvous=store_uri, processes=2, settings={"sync_every": 2},
                              args={"steps": 8, "fail_lane": 1, "fail_kind": "config", "fail_step": 3})
    (r,) = replicas.executor.collect(handles, timeout=180)
    # exit 78 survives torchrun, so the supervisor stops the run instead of relaunching it
    assert r.status == "failed" and r.exit_code == 78, r
    assert r.error.startswith("dataset path 'gs://nowhere' does not exist") and "process 1 of 2" in r.error
    log = replicas.executor.stream_logs(handles[0], n_lines=400)
    assert "diloco: error: dataset path" in log and "Traceback" not in log
    assert "Unable to shutdown" not in log  # the other process ended on torchrun's SIGTERM, not its SIGKILL


def test_a_bug_in_one_process_names_its_cause_step_and_process(replicas, store_uri):
    handles = replicas.launch("plain_lanes", 1, rendezvous=store_uri, processes=2, settings={"sync_every": 2},
                              args={"steps": 8, "fail_lane": 1, "fail_kind": "bug", "fail_step": 5})
    (res,) = replicas.executor.collect(handles, timeout=180)
    assert res.status == "failed" and res.exit_code == 1
    first = res.error.splitlines()[0]
    assert first == "ValueError: loss is NaN (at global step 5)", res.error  # the fail-fast signature, as for L = 1
    assert "(process 1 of 2)" in res.error


# -- agreement between lanes, over a real gloo group ------------------------------------------

def _agree_worker(lane: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=lane, world_size=2)
    lanes = Lanes(lane, 2, dist.new_group(backend="gloo"))
    seen = []

    def fell_behind_in_lane_1():
        if lane == 1:
            raise FellBehind("round 3 was collected")
        return "ok"

    for fn in (fell_behind_in_lane_1, lambda: (_ for _ in ()).throw(Retry("moved")) if lane == 0 else 1):
        try:
            seen.append(("value", lanes.agree(fn)))
        except (FellBehind, Retry, RoundFailed) as exc:
            seen.append((type(exc).__name__, str(exc)))
    seen.append(("leader", lanes.on_leader(lambda: [lane, "from 0"])))
    try:
        lanes.on_leader(lambda: (_ for _ in ()).throw(RoundFailed("only 1 of 4 ready")))
    except RoundFailed as exc:
        seen.append(("RoundFailed", str(exc)))
    seen.append(("total", lanes.total({"bytes": 10 + lane, "tokens": 3})))
    out.put((lane, seen))
    dist.destroy_process_group()


def test_one_lane_falling_behind_takes_the_whole_replica_into_the_rejoin():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(k, port, out)) for k in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    for lane in (0, 1):
        assert got[lane][0] == ("FellBehind", "round 3 was collected")  # lane 0 succeeded, yet rejoins too
        assert got[lane][1] == ("Retry", "moved")
        assert got[lane][2] == ("leader", [0, "from 0"])  # lane 0's answer, everywhere
        assert got[lane][3] == ("RoundFailed", "only 1 of 4 ready")
        assert got[lane][4] == ("total", {"bytes": 21, "tokens": 6})


def test_a_single_lane_is_plain_calls():
    lanes = Lanes()
    assert lanes.agree(lambda: 3) == 3 and lanes.on_leader(lambda: 4) == 4 and lanes.exchange("x") == ["x"]
    with pytest.raises(FellBehind):
        lanes.agree(lambda: (_ for _ in ()).throw(FellBehind("gone")))


# -- stopping a replica stops all of its processes --------------------------------------------

def processes_of(run_id: str) -> list[int]:
    """Pids of live processes started for `run_id` (their environment names it)."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"DILOCO_RUN_ID={run_id}".encode() in env.split(b"\0") and state != "Z":
            found.append(int(pid))
    return found


def wait_for(cond, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.mark.parametrize("how", ["cancel", "sigkill"])
def test_stopping_a_replica_stops_every_process_in_it(replicas, store_uri, how):
    """cancel (SIGTERM to the group) and a SIGKILL of torchrun itself both leave no process behind:
    none keeps training into the store after its replica was stopped or relaunched."""
    import os
    import signal

    handles = replicas.launch("plain_lanes", 1, rendezvous=store_uri, processes=2,
                              settings={"sync_every": 1000}, args={"steps": 10**9, "dim": 16})
    run_id = replicas.run_id
    assert wait_for(lambda: len(processes_of(run_id)) >= 3, 60), "torchrun and its 2 processes never started"
    if how == "cancel":
        replicas.executor.cancel(handles[0])
        assert replicas.executor.poll(handles[0]) == "cancelled"
    else:
        os.kill(handles[0].metadata["pid"], signal.SIGKILL)
    assert wait_for(lambda: not processes_of(run_id), 20), processes_of(run_id)
