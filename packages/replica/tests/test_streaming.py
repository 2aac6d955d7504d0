"""A round streamed shard by shard gives the very bits of the whole-vector round.

The all-reduce reads Δ from a `DeltaSource` a shard at a time and hands each shard's mean to a
sink as it arrives (`diloco_replica.round.streaming`; the exchanger applies the outer step there); the
replicas' agreement rests on every replica computing the same floats, so the streamed path must
equal the whole-vector one bit for bit, and must never materialise Δ or the mean whole.
"""

from __future__ import annotations

import threading
import time
import uuid

import torch

from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.outer.step import outer_step
from diloco_replica.round.layout import shard_bounds
from diloco_replica.round.streaming import LiveDelta


def at_once(n: int, go) -> dict[int, BaseException]:
    """go(i) for replicas 0..n−1, each on a thread of its own, all at once; back when all are done,
    with what each that failed raised."""
    errors = {}

    def run(i: int) -> None:
        try:
            go(i)
        except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return errors


def rounds(n: int, deltas: list[torch.Tensor], *, streamed: bool, codec: str = "fp32"):
    """Each replica's round-1 mean: whole (RoundResult.mean) or gathered from the sink."""
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-stream"
    out, sizes = {}, {i: [] for i in range(n)}

    def go(i: int) -> None:
        ar = StoreAllReduce(store, run, i, n, codec=codec, round_timeout=10, poll_interval=0.002, poll_max=0.02)
        try:
            if streamed:
                theta = torch.zeros_like(deltas[i])
                local = -deltas[i]  # Δ = θ − local

                def read_local(a: int, b: int, out: torch.Tensor) -> None:  # as a thread-mode round reads it
                    sizes[i].append(b - a)
                    out.copy_(local[a:b])

                got = torch.full_like(deltas[i], float("nan"))

                def sink(j, a, b, mean):
                    got[a:b] = mean

                res = ar.run_round(1, LiveDelta(theta, read_local), sink=sink)
                assert res.mean is None
                out[i] = got
            else:
                out[i] = ar.run_round(1, deltas[i].clone()).mean
        finally:
            ar.close()

    errors = at_once(n, go)
    assert not errors, errors
    return out, sizes


def test_a_streamed_round_gives_the_bits_of_a_whole_one_and_never_reads_delta_whole():
    n, numel = 4, 10_001
    deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    for codec in ("fp32", "int8"):
        whole, _ = rounds(n, deltas, streamed=False, codec=codec)
        streamed, sizes = rounds(n, deltas, streamed=True, codec=codec)
        for i in range(n):
            assert torch.equal(whole[i], streamed[i]), (codec, i)
            assert torch.equal(streamed[i], streamed[0])  # every replica holds the same mean
        shard = -(-numel // n)
        assert all(s <= shard for i in range(n) for s in sizes[i]), "Δ was read in pieces larger than a shard"


def test_a_replica_on_the_thread_reads_its_model_in_slices_and_holds_no_snapshot():
    """A round on the training process's thread reads θ_local where it is (`LiveDelta`): no host
    copy of the lane beside θ_global (an FSDP2 lane, whose values other processes hold, still
    snapshots them); its Δ is the same subtraction, slice by slice."""
    from diloco.bootstrap.context import ReplicaContext
    from diloco_replica import DiLoCo
    from diloco_replica.loop.modelview import ReplicatedView, ShardedView

    model = torch.nn.Linear(8, 8)
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), ReplicaContext(0, 1, "run-live"),
                    store=open_store(f"memory://{uuid.uuid4().hex}"), sync_every=2, total_steps=4)
    try:
        assert diloco.sync.snapshot is None and diloco.transfers.snapshot_buf is None
    finally:
        diloco.close()
    assert ReplicatedView.reads_live and not ShardedView.reads_live
    theta = torch.randn(1_001, generator=torch.Generator().manual_seed(5))
    local = torch.randn(1_001, generator=torch.Generator().manual_seed(6))
    live = LiveDelta(theta, lambda a, b, out: out.copy_(local[a:b]))
    whole = theta - local
    assert torch.equal(live.shard(0, live.numel), whole)
    assert all(torch.equal(live.shard(a, b), whole[a:b]) for a, b in [(0, 7), (7, 500), (500, 1_001)])


def test_the_outer_step_applied_shard_by_shard_is_bit_identical_to_the_whole_step():
    numel = 3 * (1 << 18) + 12_345  # across several of the step's chunks
    theta = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    buf = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    whole_t, whole_b = theta.clone(), buf.clone()
    assert outer_step(whole_t, whole_b, grad, lr=0.7, momentum=0.9, nesterov=True)
    for n in (3, 7):
        t, b = theta.clone(), buf.clone()
        for a, z in reversed(shard_bounds(numel, n)):  # any order, as shards arrive
            assert outer_step(t[a:z], b[a:z], grad[a:z], lr=0.7, momentum=0.9, nesterov=True)
        assert torch.equal(t, whole_t) and torch.equal(b, whole_b)


def test_a_reducers_own_mean_is_applied_while_it_gathers_and_the_round_waits_for_it():
    """The outer step of a replica's own shard (the sink) runs beside the gather of the others'
    shards, not before it, and `run_round` returns only once that sink is done: the caller's
    buffers are never written after the round has returned."""
    n, numel = 2, 1_000
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-own-sink"
    spans, returned = {i: {} for i in range(n)}, {}
    gathering = [threading.Event() for _ in range(n)]

    def go(i: int) -> None:
        ar = StoreAllReduce(store, run, i, n, round_timeout=10, poll_interval=0.002, poll_max=0.02)

        def sink(j, a, b, mean):
            start = time.monotonic()
            if j == i:  # the own shard's outer step lasts until the other shard arrives (or 10 s)
                gathering[i].wait(10)
            else:
                gathering[i].set()
            spans[i][j] = (start, time.monotonic())

        try:
            ar.run_round(1, torch.full((numel,), float(i + 1)), sink=sink)
            returned[i] = time.monotonic()
        finally:
            ar.close()

    errors = at_once(n, go)
    assert not errors, errors
    for i in range(n):
        own, other = spans[i][i], spans[i][1 - i]
        assert other[0] < own[1], f"replica {i} gathered only after its own shard's sink: {spans[i]}"
        assert returned[i] >= own[1], f"replica {i}'s round returned while its own sink was still running"


def test_an_error_applying_the_own_shard_fails_the_round():
    n, numel = 2, 1_000
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-own-sink-error"

    def go(i: int) -> None:
        ar = StoreAllReduce(store, run, i, n, round_timeout=10, poll_interval=0.002, poll_max=0.02)

        def sink(j, a, b, mean):
            if j == i:
                raise RuntimeError(f"outer step of shard {j} failed")

        try:
            ar.run_round(1, torch.ones(numel), sink=sink)
        finally:
            ar.close()

    errors = {i: repr(exc) for i, exc in at_once(n, go).items()}
    assert errors == {i: repr(RuntimeError(f"outer step of shard {i} failed")) for i in range(n)}


def test_an_overlapped_rounds_merge_in_the_parameters_gives_the_bits_of_the_flat_merge():
    """θ_now + θ_global_new − θ_at_sync added into fp32 parameters in place (`ModelView.merge_part`)
    rounds as the flat copy did; bf16 parameters keep the flat merge (one rounding at the end)."""
    from diloco_replica.round.lanes import Lanes
    from diloco_replica.loop.modelview import model_view

    def model(dtype):
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(dtype)

    inplace, flat = model(torch.float32), model(torch.float32)
    view, reference = model_view(inplace, Lanes()), model_view(flat, Lanes())
    assert view.merges_in_place and not model_view(model(torch.bfloat16), Lanes()).merges_in_place
    for parts in (1, 3):
        for part in range(parts):
            a, b = view.fragment(part, parts)
            at_sync = view.gather_part(part, parts) - 0.25
            theta = torch.randn(view.numel, generator=torch.Generator().manual_seed(part)) * 1e-3
            view.merge_part(theta[a:b], at_sync, part, parts)
            now = reference.gather_part(part, parts)
            now += theta[a:b]
            now -= at_sync
            reference.write_part(now, part, parts)
            assert all(torch.equal(p, q) for p, q in zip(inplace.parameters(), flat.parameters()))
