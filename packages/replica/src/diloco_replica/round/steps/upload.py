"""Step 1 of a round (`allreduce`): this lane's pieces of Δ into the store.

For every shard j of the round this lane holds part of and does not reduce itself, its piece goes
to ``r/scatter/j/<rank>.<lane>``, encoded in the run's codec: as it was encoded already (topk's
sparsified pieces, made here; error feedback's quantised ones, `feedback`), else encoded now. At
most `window` shards' worth of Δ is being encoded or sent at once. The upload ends when every lane
of the replica has its pieces up (`Lanes.agree`), so the ready marker written after it means the
whole replica's contribution is in the store.

With the `topk` transport a replica sparsifies each piece of Δ + its error-feedback residual
(`codecs.sparsify`), keeps what it does not send in the residual, and contributes exactly what the
others decode: the sparse encodings are what it sends and what its own shard's mean folds in.

A piece encoded here (a quantised transport without error feedback) is encoded where the round's
codec arithmetic runs (`codecdevice`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...transport.codecdevice import CodecDevice
from ...transport.codecs import sparsify
from ..io import RoundIO
from ..state import Round
from ..streaming import WholeDelta, Window
from ...transport.wire import decode_tensor, encode_tensor, pack


class Uploader:
    """One lane's uploads of its pieces of Δ, round after round."""

    def __init__(self, io: RoundIO, *, codec: str, topk_density: float, window: int,
                 codec_device: CodecDevice | None = None):
        self.io, self.codec, self.topk_density, self.window = io, codec, topk_density, window
        self.codec_device = codec_device or CodecDevice()

    def upload(self, rnd: Round, residual: torch.Tensor | None) -> None:
        """Every piece this lane sends in round `rnd`, in the store once every lane's are;
        `residual`: topk's error feedback, as long as the lane's Δ."""
        if self.codec == "topk":
            rnd.sent = self.sparsify(rnd, residual)
        gate = Window(self.window * rnd.cut.parts)

        def put(j: int) -> None:
            with gate:  # at most `window` shards' worth of Δ exist at once
                self.put(rnd, j)

        def upload_all() -> None:
            for f in [self.io.pool.submit(put, j) for j in rnd.mine() if not rnd.keeps(j)]:
                f.result()

        self.io.lanes.agree(upload_all)  # "ready" means every lane's pieces are in the store
        if self.codec != "topk" and isinstance(rnd.source, WholeDelta):
            rnd.sent.clear()  # Δ holds the same values (quantised in place); a source read per piece does not

    def sparsify(self, rnd: Round, residual: torch.Tensor | None) -> dict[int, list[memoryview]]:
        """topk: each piece of Δ (+ residual) → what is sent, encoded; the residual keeps the rest.

        The encoded pieces are small (the density's share of Δ) and are what this replica
        contributes to every mean, its own shard's and a taken-over one's, as others decode it.
        """
        encoded = {}
        h = rnd.held[0]
        for j in rnd.mine():
            a, b = (x - h for x in rnd.piece(j))
            part = rnd.source.shard(a, b)
            if residual is not None:
                part += residual[a:b]
            parts = encode_tensor(sparsify(part, self.topk_density), "topk")
            if residual is not None:
                torch.sub(part, decode_tensor(b"".join(parts), "topk", b - a), out=residual[a:b])
            encoded[j] = parts
        return encoded

    def put(self, rnd: Round, j: int) -> None:
        """Upload this lane's piece of shard j: as encoded already, else encoded now."""
        io, lane, (a, b) = self.io, rnd.lane, rnd.piece(j)
        ident = io.scatter_identity(rnd.r, j, rnd.rank, lane)
        if j in rnd.sent:
            encoded = rnd.sent[j]
        else:
            with self.codec_device.running():
                encoded = encode_tensor(self.codec_device.to(rnd.own(j, self.codec_device.device)), self.codec)
        blob = pack(ident, encoded, codec=self.codec, numel=b - a, meta=self.meta(rnd))
        io.put(io.keys.scatter(rnd.r, j, rnd.rank, lane), blob, written=("scatter", rnd.r, j, rnd.rank))

    def meta(self, rnd: Round) -> dict[str, Any] | None:
        """What a contribution states besides its values: its inner steps, in time-based rounds."""
        return {"steps": rnd.steps} if rnd.steps is not None else None
