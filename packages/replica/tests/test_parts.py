"""A round's shards sent as parts (P > 1): the same means, the objects the estimate counts, the
parts pipelined through the round, and a reducer that dies between parts.

`part_mb` is tiny here so a 12,000-element round is cut into several parts per replica.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from test_streaming import at_once

from diloco.spec.estimate import exchange
from diloco.store.objectstore import open_store
from diloco.store.wiresize import parts_per_shard
from diloco_replica.round.steps import reduce as reduce_module
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.round.errors import RoundFailed
from diloco_replica.round.state import Round
from diloco_replica.round.storeaccess import reducer_of

NUMEL = 12_000
PART_MB = 4_000 * 4 / 2**20  # 4,000 fp32 values a part


def deltas(n: int) -> list[torch.Tensor]:
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]


def run(n: int, ds: list[torch.Tensor], *, part_mb: float, codec: str = "fp32", timeout: float = 10,
        hook=None, members: list[int] | None = None) -> tuple[dict, dict, dict]:
    """Round 1 on n replicas (threads, one memory store): (means, results, errors) by rank.
    `hook(i, ar)` may patch replica i before its round; `members`: the ranks that take part."""
    store, run_id = open_store(f"memory://{uuid.uuid4().hex}"), "run-parts"
    means, results = {}, {}
    taking_part = members if members is not None else list(range(n))

    def go(k: int) -> None:
        i = taking_part[k]
        ar = StoreAllReduce(store, run_id, i, n, codec=codec, round_timeout=timeout, poll_interval=0.002,
                            poll_max=0.02, part_mb=part_mb)
        if hook is not None:
            hook(i, ar)
        try:
            res = ar.run_round(1, ds[i].clone())
            means[i], results[i] = res.mean, res
        finally:
            ar.close()

    errors = {taking_part[k]: exc for k, exc in at_once(len(taking_part), go).items()}
    return means, results, errors


def test_the_parts_formula_is_the_same_on_every_replica_and_one_part_while_a_shard_fits():
    assert parts_per_shard(NUMEL, 3, PART_MB) == 1  # 4,000 values a shard: one part
    assert parts_per_shard(NUMEL, 1, PART_MB) == 3
    assert parts_per_shard(NUMEL + 1, 1, PART_MB) == 4  # a part never exceeds part_mb
    assert parts_per_shard(85_800_000, 2, 32) == 6      # the GPU bench's model: 172 MB shards
    assert parts_per_shard(10, 2, 32) == 1


@pytest.mark.parametrize("shard, members, roster, reducer", [
    (0, [0, 1, 2], [0, 1, 2], 0), (3, [0, 1, 2], [0, 1, 2], 0), (4, [0, 1, 2], [0, 1, 2], 1),  # part j: rank j mod N
    (8, [0, 1, 2], [0, 1, 2], 2), (2, [0, 1, 2], [2, 0, 1], 1),  # by the roster's order
    (1, [0, 2], [0, 1, 2], 2),   # owner 1 is gone: its parts 1, 4, 7 go to members[(j // N + 1) mod 2]: 2, 0, 2
    (4, [0, 2], [0, 1, 2], 0),
    (7, [0, 2], [0, 1, 2], 2),
    (1, [0, 3], [0, 1, 2, 3], 3), (2, [0, 3], [0, 1, 2, 3], 0),  # two owners gone: their first parts split
    (1, [1], None, 1),           # no roster: the members are it
])
def test_a_part_is_reduced_by_its_owner_or_spread_over_the_members(shard, members, roster, reducer):
    assert reducer_of(shard, members, roster) == reducer


def test_every_lane_of_a_replica_reduces_its_share_of_the_parts():
    """Parts are owned in turn (j mod N), so a replica's parts lie all along the vector: with as
    many parts per shard as lanes, every lane of every replica reduces some (bench/nodes.py)."""
    from diloco_replica.round.layout import Cut
    from diloco_replica.round.storeaccess import owner_of

    cut = Cut(4096 * 64, 0, 4096 * 64, n=2, parts=4)
    for rank in (0, 1):
        lanes = {cut.lead(j, 4) for j in range(cut.count) if owner_of(j, [0, 1]) == rank}
        assert lanes == {0, 1, 2, 3}, (rank, lanes)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_parts_give_every_replica_the_same_mean_and_fp32_the_bits_of_whole_shards(codec):
    n = 3
    ds = deltas(n)
    whole, _, errors = run(n, ds, part_mb=32, codec=codec)
    assert not errors, errors
    parted, results, errors = run(n, ds, part_mb=PART_MB / 4, codec=codec)  # 1,000 values a part: P = 4
    assert not errors, errors
    for i in range(n):
        assert torch.equal(parted[i], parted[0])
    if codec == "fp32":  # an elementwise mean: where the parts are cut changes no bit
        assert torch.equal(parted[0], whole[0])
        assert torch.equal(parted[0], sum(ds) / n)  # Σ in rank order, then ÷ N: the reducer's order


def test_a_round_of_parts_moves_what_the_estimate_predicts():
    n = 3
    part_mb = PART_MB / 4
    _, results, errors = run(n, deltas(n), part_mb=part_mb)
    assert not errors, errors
    want = exchange(n, 1, NUMEL, "fp32", 0.01, part_mb=part_mb, first=True)
    assert parts_per_shard(NUMEL, n, part_mb) == 4
    for i, res in results.items():
        got = res.traffic
        # members.json: a replica that finds the round decided at its first look (it came late, on a
        # loaded machine) reads the record instead of trying to write it: one PUT fewer
        assert want.puts - 1 <= got.puts <= want.puts, (i, got, want)
        # the estimate's members.json GET is (N−1)/N of one; polls (waiting) it leaves out
        assert want.gets - 1 <= got.gets <= want.gets + got.polls, (i, got, want)
        assert want.lists <= got.lists <= want.lists + got.polls, (i, got, want)  # ready, roster (`roster`), reduced
        assert abs(got.bytes_up - want.bytes_up) / want.bytes_up < 0.01
        assert abs(got.bytes_down - want.bytes_down) / want.bytes_down < 0.01


def test_a_peers_parts_are_gathered_while_this_replica_still_reduces_its_own(monkeypatch):
    """Replica 0's last own part is slow to fold; replica 1's parts reach replica 0's sink before
    that reduction ends — the gather runs beside the reducing, not after it."""
    n, part_mb = 2, PART_MB / 2  # 2,000 values a part: P = 3 at N = 2
    ds = deltas(n)
    seen, slow_done = [], {}
    original = reduce_module.ShardReducer.reduce

    def hook(i, ar):
        if i != 0:
            return

        def reduce(self, rnd, j, *, takeover):
            out = original(self, rnd, j, takeover=takeover)
            if j == rnd.cut.parts - 1:  # its last own part: published, then the thread lingers
                time.sleep(1.0)
                slow_done["at"] = time.monotonic()
            return out

        ar.reducer.reduce = reduce.__get__(ar.reducer)

    deliver = Round.deliver

    def recording(rnd, sink, j, mean):  # when each part reaches replica 0's sink
        if rnd.rank == 0:
            seen.append((j, time.monotonic()))
        deliver(rnd, sink, j, mean)

    monkeypatch.setattr(Round, "deliver", recording)
    means, _, errors = run(n, ds, part_mb=part_mb, hook=hook)
    assert not errors, errors
    assert torch.equal(means[0], means[1])
    peers = [t for j, t in seen if j >= 3]
    assert len(peers) == 3 and all(t < slow_done["at"] for t in peers), (seen, slow_done)


def test_a_reducer_that_dies_between_parts_leaves_the_rest_to_the_others():
    """Replica 1 publishes its first part and dies; the others take over its other parts after
    the round timeout and end the round with the same bytes."""
    n, part_mb = 3, PART_MB / 4  # P = 4
    ds = deltas(n)
    original = reduce_module.ShardReducer.reduce

    def hook(i, ar):
        if i != 1:
            return

        def reduce(self, rnd, j, *, takeover):
            if j > 1:  # its first part is part 1 (parts are owned in turn: 1, 4, 7, 10 are its)
                raise SystemExit("replica 1 died mid-round")
            return original(self, rnd, j, takeover=takeover)

        ar.reducer.reduce = reduce.__get__(ar.reducer)

    means, results, errors = run(n, ds, part_mb=part_mb, hook=hook, timeout=1.0)
    assert set(errors) == {1}, errors
    assert torch.equal(means[0], means[2])
    taken = sorted(results[0].takeovers + results[2].takeovers)
    assert taken == [4, 7, 10], taken
    expected_first = sum(d[1_000:2_000] for d in ds) / n  # part 1: published by its owner with all three
    assert torch.equal(means[0][1_000:2_000], expected_first)
    # the taken-over parts lost the dead owner's own part (never uploaded): the mean of the other two
    for j in taken:
        lo, hi = j * 1_000, (j + 1) * 1_000
        assert torch.equal(means[0][lo:hi], (ds[0][lo:hi] + ds[2][lo:hi]) / 2)


def test_a_failed_own_reduction_fails_the_round_at_once_not_after_the_timeout():
    n, part_mb = 2, PART_MB / 2
    original = reduce_module.ShardReducer.reduce

    def hook(i, ar):
        def reduce(self, rnd, j, *, takeover):
            if j == i + rnd.cut.n:  # its second part (parts are owned in turn)
                raise RoundFailed(f"replica {i} could not reduce part {j}")
            return original(self, rnd, j, takeover=takeover)

        ar.reducer.reduce = reduce.__get__(ar.reducer)

    started = time.monotonic()
    _, _, errors = run(n, deltas(n), part_mb=part_mb, hook=hook, timeout=30)
    assert time.monotonic() - started < 10, "the gather waited for parts nobody would publish"
    assert {i: str(e) for i, e in errors.items()} == {0: "replica 0 could not reduce part 2",
                                                      1: "replica 1 could not reduce part 3"}


def test_a_peer_whose_parts_keep_coming_is_not_taken_over_however_long_its_round():
    """Replica 1 publishes a part every second, three in all, against a 2 s round timeout: the
    gather's timeout runs from the last part that arrived, so nothing is taken over."""
    n, part_mb = 2, PART_MB / 2  # P = 3
    original = reduce_module.ShardReducer.reduce
    one_at_a_time = threading.Lock()

    def hook(i, ar):
        if i != 1:
            return

        def reduce(self, rnd, j, *, takeover):
            with one_at_a_time:
                time.sleep(1.0)
                return original(self, rnd, j, takeover=takeover)

        ar.reducer.reduce = reduce.__get__(ar.reducer)

    started = time.monotonic()
    means, results, errors = run(n, deltas(n), part_mb=part_mb, hook=hook, timeout=2.0)
    assert not errors, errors
    assert time.monotonic() - started >= 3.0
    assert results[0].takeovers == [] and results[1].takeovers == []
    assert torch.equal(means[0], means[1])


def test_error_feedback_quantises_by_the_shards_the_all_reduce_uploads():
    ar = StoreAllReduce(open_store(f"memory://{uuid.uuid4().hex}"), "run-layout", 1, 3, part_mb=PART_MB / 4)
    try:
        pieces, uploaded = ar.upload_layout(1, ar.cut(NUMEL, 0, NUMEL, 1))
    finally:
        ar.close()
    assert sorted(pieces) == list(range(12)) and pieces[0] == (0, 1_000) and pieces[11] == (11_000, 12_000)
    assert uploaded == set(range(12)) - {1, 4, 7, 10}  # replica 1 owns parts 1, 4, 7, 10 and uploads the rest
