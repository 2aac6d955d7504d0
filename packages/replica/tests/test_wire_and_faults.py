"""The wire format and the all-reduce under bad objects and missing replicas (in-process store)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import FellBehind, RoundFailed, StoreAllReduce
from diloco.store.runkeys import RunKeys
from diloco_replica.transport.wire import CorruptObject, Identity, encode_tensor, encoded_nbytes, joined, pack, unpack

ID = Identity("run-a", 3, "scatter", 1, 2)


def blob_of(x: torch.Tensor, codec: str = "fp32", ident: Identity = ID) -> bytes:
    return joined(pack(ident, encode_tensor(x, codec), codec=codec, numel=x.numel()))


@pytest.mark.parametrize("codec, rel_err, bytes_per", [("fp32", 0.0, 4), ("bf16", 8e-3, 2), ("fp16", 1e-3, 2),
                                                        ("int8", 1e-2, 1)])
def test_codecs_round_trip_and_size(codec, rel_err, bytes_per):
    x = torch.randn(50_001)
    got = unpack(blob_of(x, codec), ID, "k").tensor()
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert (got - x).abs().max() <= rel_err * x.abs().max() + 1e-12
    assert encoded_nbytes(x.numel(), codec) <= bytes_per * x.numel() * 1.002 + 16


def test_corrupted_payload_is_detected():
    blob = bytearray(blob_of(torch.randn(1000)))
    blob[-10] ^= 0xFF
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        unpack(bytes(blob), ID, "run-a/r3/scatter/1/2")


def test_truncated_object_is_detected():
    blob = blob_of(torch.randn(1000))
    with pytest.raises(CorruptObject, match="truncated"):
        unpack(blob[:-100], ID, "k")
    with pytest.raises(CorruptObject, match="truncated"):
        unpack(blob[:6], ID, "k")


def test_object_from_another_run_or_round_is_foreign():
    blob = blob_of(torch.randn(10), ident=Identity("old-run", 3, "scatter", 1, 2))
    with pytest.raises(CorruptObject, match="foreign object"):
        unpack(blob, ID, "k")
    with pytest.raises(CorruptObject, match="foreign object"):
        unpack(blob_of(torch.randn(10), ident=Identity("run-a", 2, "scatter", 1, 2)), ID, "k")


def test_not_a_diloco_object():
    with pytest.raises(CorruptObject, match="not a diloco object"):
        unpack(b"\x80\x04\x95pickle-bytes-here-not-ours", ID, "k")


def run_round(store, run, n, deltas, *, skip=(), timeout=2.0, min_members=1, r=1, codec="fp32"):
    out, errors = {}, {}

    def go(i):
        ar = StoreAllReduce(store, run, i, n, round_timeout=timeout, min_members=min_members, poll_interval=0.005,
                            codec=codec)
        try:
            out[i] = ar.run_round(r, deltas[i])
        except Exception as exc:  # collected and asserted by the caller
            errors[i] = exc
        finally:
            ar.close()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n) if i not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, errors


def test_corrupt_contribution_is_never_averaged_in_and_is_reported():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-c"
    deltas = [torch.full((100,), float(i)) for i in range(2)]
    # rank 1 "uploads" a corrupted shard for owner 0 before the round, then only rank 0 runs: the
    # ready marker says rank 1 is a member, so rank 0 must read that object — and leave it out.
    good = joined(pack(Identity(run, 1, "scatter", 0, 1), encode_tensor(deltas[1][:50], "fp32"), codec="fp32",
                       numel=50))
    bad = bytearray(good)
    bad[-1] ^= 1
    store.put(f"{run}/r00000001/scatter/0/1.0", bytes(bad))
    store.put(RunKeys(run).ready(1, 1), b"{}")
    store.put(f"{run}/r00000001/reduced/1/mean", pack(Identity(run, 1, "reduced", 1, -1),
                                                 encode_tensor(torch.zeros(50), "fp32"), codec="fp32", numel=50))
    out, errors = run_round(store, run, 2, deltas, skip=(1,))
    assert not errors, errors
    assert torch.equal(out[0].mean[:50], deltas[0][:50])  # rank 1's damaged part is not in the mean
    [incident] = out[0].incidents
    assert incident["object"] == f"{run}/r00000001/scatter/0/1.0" and incident["writer"] == 1
    assert "checksum mismatch" in incident["problem"] and "left out" in incident["action"]
    reduced = unpack(store.get(f"{run}/r00000001/reduced/0/mean"), Identity(run, 1, "reduced", 0, -1), "k")
    assert reduced.meta["members"] == [0] and "1" in reduced.meta["left_out"]


def test_reused_store_from_an_old_run_does_not_leak_in():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    deltas = [torch.randn(64) for _ in range(3)]
    run_round(store, "old-run", 3, [d * 100 for d in deltas])
    out, errors = run_round(store, "new-run", 3, deltas)
    assert not errors
    assert torch.allclose(out[0].mean, torch.stack(deltas).mean(0), atol=1e-6)


def test_missing_replicas_are_left_out_and_recorded():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    deltas = [torch.full((10,), float(i)) for i in range(4)]
    out, errors = run_round(store, "run-m", 4, deltas, skip=(2,), timeout=0.5)
    assert not errors and {o.members == [0, 1, 3] for o in out.values()} == {True}
    assert torch.allclose(out[0].mean, torch.full((10,), (0 + 1 + 3) / 3))
    assert all(torch.equal(out[0].mean, o.mean) for o in out.values())


def test_below_min_members_fails_the_round_clearly():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    out, errors = run_round(store, "run-f", 3, [torch.zeros(4)] * 3, skip=(1, 2), timeout=0.3, min_members=2)
    assert isinstance(errors[0], RoundFailed) and "below min_members=2" in str(errors[0])


def test_waiting_does_not_poll_in_a_tight_loop():
    """A replica waiting 1 s for an absent peer makes a handful of requests, not hundreds."""
    store = open_store(f"memory://{uuid.uuid4().hex}")
    ar = StoreAllReduce(store, "run-p", 0, 2, round_timeout=1.0, poll_interval=0.01, poll_max=0.25)
    ar.run_round(1, torch.zeros(8))
    assert ar.store.traffic.lists + ar.store.traffic.gets < 30, ar.store.traffic


def test_a_replica_behind_the_retained_history_is_told_to_rejoin():
    """Rounds ≤ 5 were garbage-collected; a replica arriving for round 4 must not decide it anew."""
    store = open_store(f"memory://{uuid.uuid4().hex}")
    store.put("run-g/history/gc-through-r00000005", b"{}")
    ar = StoreAllReduce(store, "run-g", 0, 2, round_timeout=0.2, poll_interval=0.01)
    with pytest.raises(FellBehind, match="rounds ≤ 5 were garbage-collected"):
        ar.run_round(4, torch.zeros(8))
    assert not list(store.list("run-g/r00000004/"))  # nothing written for the dead round


# -- the sync-hiding codecs ---------------------------------------------------------------------


def test_int4_round_trip_and_size():
    from diloco_replica.transport.codecs import INT4_BLOCK

    x = torch.randn(50_001)
    got = unpack(blob_of(x, "int4"), ID, "k").tensor()
    rows = torch.nn.functional.pad(x, (0, (-x.numel()) % INT4_BLOCK)).view(-1, INT4_BLOCK)
    step = (rows.abs().amax(1) / 7).repeat_interleave(INT4_BLOCK)[:x.numel()]
    assert ((got - x).abs() <= 0.5 * step * 1.002 + 1e-6).all()  # within half a quantization step
    assert encoded_nbytes(x.numel(), "int4") <= x.numel() * (0.5 + 2 / INT4_BLOCK) + 2


def test_topk_keeps_the_largest_of_each_block_and_sends_only_them():
    from diloco_replica.transport.codecs import TOPK_BLOCK, sparsify

    x = torch.randn(3 * TOPK_BLOCK + 100)
    kept = sparsify(x, 0.01)
    per_block = [(kept[a:a + TOPK_BLOCK] != 0).sum().item() for a in range(0, x.numel(), TOPK_BLOCK)]
    assert per_block == [41, 41, 41, 41]
    block = x[:TOPK_BLOCK].abs()
    assert kept[:TOPK_BLOCK].abs().min().item() == 0 and \
        set(kept[:TOPK_BLOCK].nonzero().flatten().tolist()) == set(block.topk(41).indices.tolist())
    got = unpack(blob_of(kept, "topk"), ID, "k").tensor()
    assert torch.equal(got != 0, kept != 0)
    assert (got - kept).abs().max() <= kept.abs().max() / 127
    assert len(blob_of(kept, "topk")) < 3 * 4 * 41 + 6 * 4 + 300  # 3 bytes per kept value, plus header


def test_a_topk_payload_with_inconsistent_counts_is_corrupt():
    from diloco_replica.transport.codecs import sparsify

    parts = encode_tensor(sparsify(torch.randn(5000), 0.01), "topk")
    counts = bytearray(parts[1])
    counts[0] ^= 0x01  # a writer bug, not bit rot: the checksum is computed over the bad bytes
    parts[1] = memoryview(bytes(counts))
    with pytest.raises(CorruptObject, match="payload size does not match codec"):
        unpack(joined(pack(ID, parts, codec="topk", numel=5000)), ID, "k")


def test_topk_error_feedback_loses_nothing():
    """Over rounds, what was sent plus what is still in the residual is everything there was to send."""
    store = open_store(f"memory://{uuid.uuid4().hex}")
    ar = StoreAllReduce(store, "run-ef", 0, 1, codec="topk", topk_density=0.01, round_timeout=5,
                        poll_interval=0.001, poll_max=0.01)
    residual = torch.zeros(20_000)
    total_in, total_sent = torch.zeros(20_000), torch.zeros(20_000)
    for r in range(1, 6):
        delta = torch.randn(20_000, generator=torch.Generator().manual_seed(r))
        total_in += delta
        res = ar.run_round(r, delta.clone(), in_place=True, residual=residual)
        assert (res.mean != 0).sum() <= 5 * 41 + 41  # one member: its sparse contribution is the mean
        total_sent += res.mean
    ar.close()
    assert torch.allclose(total_sent + residual, total_in, atol=1e-4)
    assert residual.abs().sum() > 0
