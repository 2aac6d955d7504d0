"""Error feedback for the quantised transports: what rounding drops from Δ is sent next round.

With int4 every element of Δ is rounded to one of 15 levels of its block's scale; the error is
small and unbiased per round but it is lost, and it grows with Δ (with H: longer rounds, larger
Δ). Error feedback (as SparseLoCo and 1-bit Adam keep it) adds each round's rounding error to the
next round's Δ, so nothing is lost, only delayed a round. The replica keeps the residual; a
(re)joining replica starts it at zero, and a replica reset for a non-finite update zeroes it.

Δ is quantised here, shard by shard as the all-reduce splits it, before the all-reduce encodes
it: what the all-reduce sends is then exactly representable, so its own encoding changes nothing
and the residual is exactly what the others will not see. topk keeps its own residual inside the
all-reduce (`allreduce.StoreAllReduce._sparsify`).
"""

from __future__ import annotations

import torch

from .codecs import decode, encode

LOSSY = ("bf16", "fp16", "int8", "int4")  # the codecs error feedback applies to


def quantise_with_feedback(delta: torch.Tensor, residual: torch.Tensor, codec: str,
                           shards: list[tuple[int, int]]) -> None:
    """In place: Δ += residual; Δ ← what `codec` carries of it; residual ← what it dropped."""
    delta += residual
    for a, b in shards:
        carried = decode(b"".join(encode(delta[a:b], codec)), codec, b - a)
        torch.sub(delta[a:b], carried, out=residual[a:b])
        delta[a:b] = carried
