"""Error feedback for the quantised transports: what rounding drops from Δ is sent next round.

With int4 every element of Δ is rounded to one of 15 levels of its block's scale; the error is
small and unbiased per round but it is lost, and it grows with Δ (with H: longer rounds, larger
Δ). Error feedback (as SparseLoCo and 1-bit Adam keep it) adds each round's rounding error to the
next round's Δ, so nothing is lost, only delayed a round. The replica keeps the residual; a
(re)joining replica starts it at zero, and a replica reset for a non-finite update zeroes it.

Δ is quantised here, shard by shard as the all-reduce splits it, before the all-reduce sends
it: what the all-reduce sends is then exactly representable and the residual is exactly what
the others will not see. The encodings made here are the very bytes the all-reduce would make
again (quantising a quantised shard changes nothing), so those of the shards it uploads are
handed to it to send as they are (`keep`): for int4 and int8 that saves encoding (N−1)/N of Δ a
second time, on the host cores beside the training loop, for a tenth to a quarter of Δ's fp32
bytes held through the upload. bf16 and fp16 are a cast to encode and half of Δ to hold, so
they are encoded again. topk keeps its own residual inside the all-reduce
(`upload.Uploader.sparsify`).
"""

from __future__ import annotations

import torch

from ...transport.codecs import decode, encode
from ..streaming import DeltaSource

LOSSY = ("bf16", "fp16", "int8", "int4")  # the codecs error feedback applies to
KEPT = ("int8", "int4")  # their encodings are kept for the upload (a quarter of fp32 or less)


def quantise_with_feedback(delta: torch.Tensor, residual: torch.Tensor, codec: str,
                           pieces: dict[int, tuple[int, int]], keep: set[int] = frozenset()) -> dict[int, list[memoryview]]:
    """In place, piece by piece as the all-reduce sends Δ (`pieces`: shard -> [a, b) of Δ, which
    they cover): Δ += residual; Δ ← what `codec` carries of it; residual ← what it dropped. The
    arithmetic runs where the residual lives (the host, or the model's GPU: `codecdevice`); Δ
    stays on the host.

    Returns the encodings of the pieces in `keep` (shards) if `codec` is one whose encodings are
    worth keeping (`KEPT`), else nothing.
    """
    kept = {}
    for j, (a, b) in pieces.items():
        part = delta[a:b].to(residual.device)  # a view on the host
        part += residual[a:b]
        encoded = encode(part, codec)
        carried = decode(b"".join(encoded), codec, b - a, residual.device)
        torch.sub(part, carried, out=residual[a:b])
        delta[a:b] = carried
        if j in keep and codec in KEPT:
            kept[j] = encoded
    return kept


def quantise_pieces_with_feedback(source: DeltaSource, residual: torch.Tensor, codec: str,
                                  pieces: dict[int, tuple[int, int]]) -> dict[int, list[memoryview]]:
    """`quantise_with_feedback` for a Δ read a piece at a time (`streaming.LiveDelta`, which holds
    no Δ to quantise in place): each piece of Δ + residual → its encoding in `codec`, residual ←
    what it dropped, and every piece's encoding returned — they are the only copy of what this lane
    contributes (uploaded as they are; its own shard's and a taken-over shard's folds decode them).
    The same elementwise operations as the whole-vector form, so the same bytes; a piece of Δ at a
    time and the encodings (a quarter of Δ's bytes or less for int8 and int4, half for bf16 and
    fp16) are held instead of Δ."""
    kept = {}
    for j, (a, b) in pieces.items():
        part = source.shard(a, b, residual.device).to(residual.device)
        part += residual[a:b]
        encoded = encode(part, codec)
        torch.sub(part, decode(b"".join(encoded), codec, b - a, residual.device), out=residual[a:b])
        kept[j] = encoded
    return kept
