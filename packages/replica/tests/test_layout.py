"""One layout for every replica (`layout`): replicas of 1, 2 and 3 processes in one round.

The lanes here are threads with an agreement of their own (`ThreadLanes`), so a round of three
replicas of different lane counts runs in one process against a real store interface, and the
means every lane receives can be compared bit for bit with the mean computed directly.
"""

from __future__ import annotations

import json
import threading
import uuid

import pytest
import torch

from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.round import checkpoints as checkpoints_module
from diloco_replica.round.checkpoints import Checkpoints
from diloco_replica.round.lanes import Lanes
from diloco_replica.round.layout import BLOCK, Cut, cover, lane_fragment, lane_range, piece_cuts
from diloco_replica.outer.step import digest_of, state_digest


class Hub:
    """What torch.distributed's all-gather is to real lanes: every lane's object, in lane order."""

    def __init__(self, count: int):
        self.barrier, self.slots = threading.Barrier(count, timeout=60), [None] * count

    def exchange(self, lane: int, obj):
        self.slots[lane] = json.loads(json.dumps(obj))  # JSON, as the real lanes send
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadLanes(Lanes):
    def __init__(self, index: int, count: int, hub: Hub):
        super().__init__(index, count)
        self.hub = hub

    def exchange(self, obj):
        return self.hub.exchange(self.index, obj)


# -- the layout, as tables ----------------------------------------------------------------------

@pytest.mark.parametrize("total, lanes, ranges", [
    (3 * BLOCK + 5, 1, [(0, 3 * BLOCK + 5)]),
    (3 * BLOCK + 5, 2, [(0, 2 * BLOCK), (2 * BLOCK, 3 * BLOCK + 5)]),
    (3 * BLOCK + 5, 4, [(0, BLOCK), (BLOCK, 2 * BLOCK), (2 * BLOCK, 3 * BLOCK), (3 * BLOCK, 3 * BLOCK + 5)]),
    (BLOCK + 1, 3, [(0, BLOCK), (BLOCK, BLOCK + 1), (BLOCK + 1, BLOCK + 1)]),  # fewer blocks than lanes: one is empty
])
def test_lanes_hold_whole_blocks_of_the_model(total, lanes, ranges):
    assert [lane_range(total, lanes, k) for k in range(lanes)] == ranges


@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
@pytest.mark.parametrize("start, stop", [(0, 20_000), (5_000, 17_001), (12_000, 12_500)])
def test_each_shard_is_tiled_by_one_piece_per_lane_that_holds_part_of_it(lanes, start, stop):
    cut = Cut(20_000, start, stop, n=3, parts=2)
    for j, (a, b) in enumerate(cut.bounds):
        pieces = cut.pieces(j, lanes)
        assert [(p, q) for _, p, q in pieces] == sorted((p, q) for _, p, q in pieces)
        assert pieces[0][1] == a and pieces[-1][2] == b and all(x[2] == y[1] for x, y in zip(pieces, pieces[1:]))
        lead = [x for x in pieces if x[0] == cut.lead(j, lanes)]
        assert lead and all(lead[0][2] - lead[0][1] >= q - p for _, p, q in pieces)  # the lane holding most of it
    for k in range(lanes):  # a lane's part of the fragment is the same range the model view syncs
        held = cut.held(lanes, k)
        x, y = lane_fragment(20_000, lanes, k, 0, 1)
        assert held[1] - held[0] <= y - x


@pytest.mark.parametrize("pieces, lo, hi, chain", [
    ([(0, 10), (10, 20)], 0, 20, [(0, 10), (10, 20)]),
    ([(0, 10), (5, 20), (0, 6)], 0, 20, [(0, 10), (5, 20)]),   # cut by two lane counts: overlaps do
    ([(0, 10), (11, 20)], 0, 20, None),                        # a gap: not complete
    ([(0, 10), (10, 20)], 12, 15, [(10, 20)]),                 # one lane's part only
    ([], 3, 3, []),
])
def test_a_checkpoint_covers_a_range_with_any_chain_of_its_pieces(pieces, lo, hi, chain):
    assert cover(pieces, lo, hi) == chain


def test_the_digest_is_the_same_whatever_the_lane_count_and_sees_one_bit():
    total = 5 * BLOCK + 77
    theta, buf = torch.randn(total), torch.randn(total)

    def digest(lanes: int, t: torch.Tensor) -> str:
        parts = []
        for k in range(lanes):
            a, b = lane_range(total, lanes, k)
            parts.append(state_digest(t[a:b], buf[a:b], a))
        return digest_of(parts)

    assert digest(1, theta) == digest(2, theta) == digest(3, theta) == digest(8, theta)
    flipped = theta.clone()
    flipped.view(torch.int32)[3 * BLOCK + 1] ^= 1  # the lowest bit of one value
    assert digest(2, flipped) != digest(2, theta)
    swapped = theta.clone()
    swapped[[0, BLOCK]] = swapped[[BLOCK, 0]]  # the same values in other places
    assert digest(3, swapped) != digest(3, theta)


# -- replicas of different lane counts in one round -------------------------------------------

def mixed_round(layouts: list[int], total: int, *, start: int = 0, stop: int | None = None, codec: str = "fp32",
                part_mb: float = 32.0) -> tuple[list[torch.Tensor], dict[tuple[int, int], object]]:
    """Round 1 of replicas with `layouts[i]` lanes each, over [start, stop) of a model of `total`
    values; every lane's mean, put back together per replica (NaN where nothing arrived)."""
    stop = total if stop is None else stop
    store, run, n = open_store(f"memory://{uuid.uuid4().hex}"), f"run-{uuid.uuid4().hex[:6]}", len(layouts)
    deltas = [torch.randn(total, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    means = [torch.full((stop - start,), float("nan")) for _ in range(n)]
    results, errors = {}, []

    def lane(i: int, k: int, hub: Hub) -> None:
        try:
            ar = StoreAllReduce(store, run, i, n, codec=codec, round_timeout=20, poll_interval=0.002, poll_max=0.02,
                                lanes=ThreadLanes(k, layouts[i], hub), part_mb=part_mb)
            try:
                cut = ar.cut(total, start, stop, 1)
                a, b = cut.held(layouts[i], k)
                res = ar.run_round(1, deltas[i][start + a:start + b].clone(), cut=cut)
                means[i][a:b] = res.mean
                results[(i, k)] = res
            finally:
                ar.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append((i, k, exc))

    threads = []
    for i, lanes in enumerate(layouts):
        hub = Hub(lanes)
        threads += [threading.Thread(target=lane, args=(i, k, hub)) for k in range(lanes)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    want = deltas[0][start:stop].clone()
    for d in deltas[1:]:  # the reducers' fold: in rank order, in fp32
        want += d[start:stop]
    return [want.div_(n)] + means, results


@pytest.mark.parametrize("layouts", [[2, 1], [1, 3, 2], [3, 3, 1, 2]])
@pytest.mark.parametrize("part_mb", [32.0, 0.01])  # whole shards; parts of 2,621 values
def test_replicas_of_different_lane_counts_get_the_same_mean_bit_for_bit(layouts, part_mb):
    total = 6 * BLOCK + 1_001
    want, *means = mixed_round(layouts, total, part_mb=part_mb)[0]
    for mean in means:
        assert torch.equal(mean, want)  # fp32: the very bits of the direct mean, in every lane of every replica


def test_a_fragment_some_lanes_hold_nothing_of_is_still_one_round():
    total = 6 * BLOCK
    (want, *means), results = mixed_round([3, 1], total, start=0, stop=2 * BLOCK - 10)  # lane 2 holds none of it
    for mean in means:
        assert torch.equal(mean, want)
    assert results[(0, 2)].members == [0, 1]


def test_int8_means_are_equal_on_every_lane_of_every_replica():
    (_, *means), _ = mixed_round([2, 1, 3], 5 * BLOCK + 3, codec="int8", part_mb=0.01)
    for mean in means[1:]:
        assert torch.equal(mean, means[0])


def test_the_pieces_of_a_replica_of_several_lanes_are_what_the_estimate_bounds():
    from diloco.spec.estimate import exchange

    total = 6 * BLOCK + 1_001
    _, results = mixed_round([3, 3], total, part_mb=0.01)
    per_replica = {i: sum(res.traffic.puts for (m, _), res in results.items() if m == i) for i in (0, 1)}
    bound = exchange(2, 3, total, "fp32", 0.01, part_mb=0.01, first=True).puts
    single = exchange(2, 1, total, "fp32", 0.01, part_mb=0.01, first=True).puts
    assert all(single < puts <= bound for puts in per_replica.values()), (per_replica, single, bound)


# -- checkpoints written by one lane count, loaded by another ----------------------------------

def test_a_checkpoint_written_by_three_lanes_loads_into_two():
    total = 5 * BLOCK + 9
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-ckpt-lanes"
    theta, buf = torch.randn(total), torch.randn(total)
    for k in range(3):  # replica 0 of 3 lanes writes the two shards of N = 2 (its own and a dead one's)
        ar = StoreAllReduce(store, run, 0, 2, lanes=ThreadLanes(k, 3, Hub(3)))
        ckpt = Checkpoints(ar.io, total)
        a, b = lane_range(total, 3, k)
        for lo, hi in ((0, total // 2), (total // 2, total)):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                ckpt.put_piece(4, (x, y), a, theta[a:b], buf[a:b], [0, 1])
        ar.close()
    ar = StoreAllReduce(store, run, 1, 2)
    assert Checkpoints(ar.io, total).complete() == [4]
    for k in range(2):
        a, b = lane_range(total, 2, k)
        got = Checkpoints(ar.io, total).load(4, a, b)
        assert got is not None and torch.equal(got[0], theta[a:b]) and torch.equal(got[1], buf[a:b])
        assert got[2] == [0, 1]  # the next round's roster travels with the checkpoint
    store.delete(next(m["path"] for m in store.list(f"{run}/ckpt/r00000004/")))
    assert Checkpoints(ar.io, total).complete() == []  # a piece gone: a gap, not a checkpoint
    ar.close()


@pytest.mark.parametrize("a, b, values, want", [
    (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
    (3, 10, 4, [(3, 4), (4, 8), (8, 10)]),   # cut at the model's multiples, not every 4 from a
    (4, 8, 4, [(4, 8)]),
    (5, 6, 4, [(5, 6)]),
    (7, 7, 4, []),
    (0, 3, 1, [(0, 1), (1, 2), (2, 3)]),
])
def test_checkpoint_pieces_are_cut_at_the_models_multiples_of_the_cap(a, b, values, want):
    assert piece_cuts(a, b, values) == want


def test_a_checkpoint_over_the_piece_cap_is_written_in_capped_pieces_and_loads_whole(monkeypatch):
    """A shard of a 1B model is 4–8 GB of [θ ; momentum]: over a single PUT's limit on S3 and Azure.
    Here the cap is 3·BLOCK + 7 values: every object holds at most that many, two writers of other
    lane counts cut the same pieces where their ranges agree, and any lane count loads it whole."""
    cap = 3 * BLOCK + 7
    monkeypatch.setattr(checkpoints_module, "CHECKPOINT_PIECE_VALUES", cap)
    total = 11 * BLOCK + 5
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-ckpt-cap"
    theta, buf = torch.randn(total), torch.randn(total)
    for k in range(3):  # replica 0 of 3 lanes writes both shards of N = 2, as above
        ar = StoreAllReduce(store, run, 0, 2, lanes=ThreadLanes(k, 3, Hub(3)))
        a, b = lane_range(total, 3, k)
        for lo, hi in ((0, total // 2), (total // 2, total)):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                Checkpoints(ar.io, total).put_piece(4, (x, y), a, theta[a:b], buf[a:b], [0, 1])
        ar.close()
    names = [m["path"].rsplit("/", 1)[1] for m in store.list(f"{run}/ckpt/r00000004/")]
    pieces = sorted(tuple(map(int, name.split("-"))) for name in names)
    assert len(pieces) > 5 and all(b - a <= cap for a, b in pieces), pieces
    sizes = [len(store.get(f"{run}/ckpt/r00000004/{a}-{b}")) for a, b in pieces]
    assert max(sizes) < 8 * cap + 1024  # [θ ; momentum] in fp32 and a header
    ar = StoreAllReduce(store, run, 1, 2)  # a replica of 1 lane writes its own shard again: nothing new
    Checkpoints(ar.io, total).put_piece(4, (0, total // 2), 0, theta, buf, [0, 1])
    agreed = [p for p in piece_cuts(0, total // 2, cap) if p in pieces]
    assert agreed and len(list(store.list(f"{run}/ckpt/r00000004/"))) == len(pieces) + len(piece_cuts(0, total // 2, cap)) - len(agreed)
    for lanes in (1, 2):
        for k in range(lanes):
            a, b = lane_range(total, lanes, k)
            got = Checkpoints(ar.io, total).load(4, a, b)
            assert got is not None and torch.equal(got[0], theta[a:b]) and torch.equal(got[1], buf[a:b])
    ar.close()
