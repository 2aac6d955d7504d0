"""Error feedback's quantising hands the all-reduce the encodings it made, and those are the bytes
the all-reduce would have sent: the same objects in the store, one encoding of Δ fewer."""

from __future__ import annotations

import uuid

import pytest
import torch
from test_streaming import at_once

from diloco.store.objectstore import open_store
from diloco_replica.round.steps import upload as upload_module
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.transport.codecs import decode, encode
from diloco_replica.round.steps.feedback import quantise_pieces_with_feedback, quantise_with_feedback
from diloco_replica.round.layout import shard_bounds
from diloco_replica.round.streaming import LiveDelta


def delta_and_residual(numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(numel, generator=g) * 1e-2
    delta[:300] *= 1e-9  # blocks whose scale is below fp16's smallest (int4's floor)
    return delta, torch.randn(numel, generator=g) * 1e-4


@pytest.mark.parametrize("codec, kept", [("int4", True), ("int8", True), ("bf16", False), ("fp16", False)])
def test_the_kept_encodings_are_what_encoding_the_quantised_shard_again_gives(codec, kept):
    delta, residual = delta_and_residual(10_007, seed=1)
    shards = dict(enumerate(shard_bounds(delta.numel(), 5)))
    got = quantise_with_feedback(delta, residual, codec, shards, keep={1, 3, 4})
    assert sorted(got) == ([1, 3, 4] if kept else [])
    for j, parts in got.items():
        a, b = shards[j]
        assert b"".join(parts) == b"".join(encode(delta[a:b], codec)), j


@pytest.mark.parametrize("codec", ["int4", "int8", "bf16", "fp16"])
def test_quantising_a_delta_read_per_piece_gives_the_bytes_of_quantising_it_whole(codec):
    """A round on the thread reads Δ a piece at a time (`LiveDelta`): its encodings, the values its
    folds decode and the residual it keeps are those of the whole-vector form."""
    theta = torch.randn(10_007, generator=torch.Generator().manual_seed(7)) * 1e-2
    local, residual = delta_and_residual(10_007, seed=2)
    shards = dict(enumerate(shard_bounds(theta.numel(), 5)))
    whole, whole_residual = theta - local, residual.clone()
    quantise_with_feedback(whole, whole_residual, codec, shards, keep=set(shards))
    live_residual = residual.clone()
    got = quantise_pieces_with_feedback(LiveDelta(theta, lambda a, b, out: out.copy_(local[a:b])), live_residual,
                                        codec, shards)
    assert sorted(got) == sorted(shards) and torch.equal(live_residual, whole_residual)
    for j, (a, b) in shards.items():
        assert b"".join(got[j]) == b"".join(encode(whole[a:b], codec)), j  # what the whole form sends
        assert torch.equal(decode(b"".join(got[j]), codec, b - a), whole[a:b])  # what its folds read


def test_the_all_reduce_uploads_the_kept_encodings_as_they_are():
    n, numel = 3, 9_001
    runs = {}
    for reuse in (False, True):
        store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-kept"
        means, encodes = {}, []
        original = upload_module.encode_tensor

        def counting(x, codec):
            encodes.append(x.numel())
            return original(x, codec)

        upload_module.encode_tensor = counting
        try:
            def go(i: int) -> None:
                delta, residual = delta_and_residual(numel, seed=10 + i)
                count = n  # one part a shard at this size
                uploaded = {j for j in range(count) if j != i}
                kept = quantise_with_feedback(delta, residual, "int4", dict(enumerate(shard_bounds(numel, count))),
                                              keep=uploaded)
                ar = StoreAllReduce(store, run, i, n, codec="int4", round_timeout=10, poll_interval=0.002,
                                    poll_max=0.02)
                try:
                    means[i] = ar.run_round(1, delta, encoded=kept if reuse else None).mean
                finally:
                    ar.close()
                assert not reuse or kept == {}, "the encodings were held past their upload"

            errors = at_once(n, go)
        finally:
            upload_module.encode_tensor = original
        assert not errors, errors
        scatter = {k: bytes(store.get(k)) for k in sorted(m["path"] for m in store.list(f"{run}/r00000001/scatter/"))}
        runs[reuse] = means, scatter, encodes
    (before, objects_before, encodes_before), (after, objects_after, encodes_after) = runs[False], runs[True]
    for i in range(n):
        assert torch.equal(after[i], before[i]) and torch.equal(after[i], after[0])
    assert objects_after == objects_before and len(objects_after) == n * (n - 1)  # byte for byte
    assert len(encodes_before) - len(encodes_after) == n * (n - 1)  # no shard encoded a second time
