"""A round's own bookkeeping (`roundstate.Round`) as tables of cases: no store, no threads."""

from __future__ import annotations

import pytest
import torch

from diloco.store.wiresize import Traffic
from diloco_replica.transport.codecs import sparsify
from diloco_replica.round.layout import Cut
from diloco_replica.round.state import Round
from diloco_replica.round.streaming import WholeDelta
from diloco_replica.transport.wire import decode_tensor, encode_tensor

DELTA = torch.arange(10, dtype=torch.float32)


def a_round(**fields) -> Round:
    """Round 3 of 10 values over 3 replicas, seen by rank 1."""
    return Round(3, Cut(10, 0, 10, 3), 1, **fields)


@pytest.mark.parametrize("numel, n, bounds", [
    (10, 3, [(0, 4), (4, 7), (7, 10)]),
    (9, 3, [(0, 3), (3, 6), (6, 9)]),
    (2, 3, [(0, 1), (1, 2), (2, 2)]),   # more shards than values: the last is empty
    (5, 1, [(0, 5)]),
])
def test_bounds_cut_the_vector_into_n_near_equal_shards(numel, n, bounds):
    rnd = Round(1, Cut(numel, 0, numel, n), 0)
    assert rnd.cut.bounds == bounds
    assert [rnd.size(j) for j in range(n)] == [b - a for a, b in bounds]


@pytest.mark.parametrize("source, members, member", [
    (WholeDelta(DELTA), [0, 1, 2], True),
    (WholeDelta(DELTA), [0, 2], False),   # decided without it: its update is left out
    (None, [0, 1, 2], False),             # a replay: it contributes nothing, whoever the members are
    (WholeDelta(DELTA), [], False),       # members not decided yet
])
def test_a_replica_is_a_member_when_it_contributes_and_was_let_in(source, members, member):
    assert a_round(source=source, members=members).member is member


def test_own_part_is_the_shard_of_delta_or_what_topk_sent():
    rnd = a_round(source=WholeDelta(DELTA.clone()), members=[0, 1, 2], codec="topk")
    assert torch.equal(rnd.own(1), DELTA[4:7])
    sent = encode_tensor(sparsify(DELTA[7:10].clone(), 0.5), "topk")
    rnd.sent = {2: sent}  # topk: shard 2 as the others decode it, not Δ itself
    assert torch.equal(rnd.own(2), decode_tensor(b"".join(sent), "topk", 3))
    assert torch.equal(rnd.own(0), DELTA[0:4])


@pytest.mark.parametrize("nonfinite, extra", [
    (False, {}),
    (True, {"replica": 2, "action": "left out of shard 0's mean by rank 1; rank 2 resets to θ_global"}),
])
def test_left_out_records_one_incident_naming_who_and_why(nonfinite, extra):
    rnd = a_round()
    got = rnd.left_out(0, "run/r00000003/scatter/0/2", 2, "checksum mismatch", nonfinite=nonfinite)
    want = {"round": 3, "object": "run/r00000003/scatter/0/2", "writer": 2, "problem": "checksum mismatch",
            "action": "left out of shard 0's mean by rank 1", **extra}
    assert got == want and rnd.incidents == [want]


@pytest.mark.parametrize("replay, phases, nonfinite", [
    (False, {"upload", "wait", "reduce", "download"}, [0, 2]),
    (True, set(), []),  # a replay reports no phases and no NaN/Inf senders: the members learnt them
])
def test_result_carries_the_rounds_record(replay, phases, nonfinite):
    source = None if replay else WholeDelta(DELTA)
    rnd = a_round(source=source, replay=replay, members=[0, 1, 2], traffic_before=Traffic(gets=5, puts=1))
    if not replay:
        for name in ("wait", "reduce", "download"):
            rnd.laps.lap(name)
    rnd.nonfinite.update({2, 0})
    rnd.takeovers.append(1)
    rnd.left_out(1, "k", 0, "missing")
    mean = torch.zeros(10)
    res = rnd.result(mean, Traffic(gets=12, puts=4, lists=2))
    assert (res.round, res.members, res.mean, res.member) == (3, [0, 1, 2], mean, not replay)
    assert (res.traffic.gets, res.traffic.puts, res.traffic.lists) == (7, 3, 2)  # this round's share only
    assert res.takeovers == [1] and [i["writer"] for i in res.incidents] == [0]
    assert set(res.phases) == phases
    assert res.nonfinite == nonfinite and res.seconds >= 0


def test_a_round_of_parts_has_n_times_p_shards_owned_in_turn():
    rnd = Round(1, Cut(14, 0, 14, 2, 3), 0, members=[0, 1])
    assert rnd.cut.count == 6 and rnd.cut.bounds == [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12), (12, 14)]
    assert [rnd.owner(j) for j in range(6)] == [0, 1, 0, 1, 0, 1]  # all along the vector: every lane reduces
    assert [rnd.reducer(j) for j in range(6)] == [(0, 0), (1, 0)] * 3
    rnd.members = [0]  # replica 1 is gone: its parts fall to the members left
    assert [rnd.reducer(j) for j in range(6)] == [(0, 0)] * 6
