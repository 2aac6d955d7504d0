"""Reducing one shard: average the members' contributions, publish the mean once, return it.

The store cannot add, so shard j's reducer downloads the members' parts of it (each member's as
the pieces its lanes sent, assembled), folds them into
one shard-sized total in rank order in fp32 as they arrive (at most `window` downloads held at
once, `streaming.Prefetch`), encodes the mean with the transport codec and create-only puts
``r/reduced/j``. It returns what it published and the mean as every reader decodes it (on the
host, where the outer step reads it), so the reducer holds the same bytes as everyone else; the
caller keeps the object for repairs, or reads the mean another replica published first (the
reducer never reads reduced shards). The decoding, the fold, the
mean and its encoding run where the round's codec arithmetic does (`codecdevice`: the model's GPU
for a quantised transport, else the host), with the same bits on either.

A contribution that is missing, fails its checksum twice, does not fit the round's layout
(`wire.check_layout`), holds NaN/Inf (`finite`) or, in time-based rounds, states an impossible
inner-step count is left out of the mean: an incident each, and the published object names who
was left out and why — the NaN/Inf senders too, so every replica learns it and they reset. A
mean that would not be finite is never published (`finite.NonFinite` stops the run), nor a shard
every member sent NaN/Inf for: training diverged on every member. Except where that is the
round's only member, the others absent (preempted, relaunching, paused) in a run of several: one
replica's divergence, as it would be beside finite contributions. Its update is left out as then:
the shard's update for the round is zero (the outer momentum still moves θ_global, one for
everyone), and the replica resets to θ_global and trains on.

Time-based rounds (`step_cap` set): each contribution states its inner steps τ_i (1..step_cap)
and the mean is FedNova's, mean_i(Δ_i / τ_i) · mean_i(τ_i) over the members in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...transport.codecdevice import CodecDevice
from ...transport.codecs import exact_divisor
from ...transport.finite import NONFINITE, Contribution, NonFinite, accumulate, all_finite
from .membership import Membership
from ..errors import RoundFailed
from ..io import RoundIO
from ..state import Round
from ..streaming import Prefetch, ReadOnceThenRefetch
from ...transport.wire import decode_tensor, encode_tensor, pack


@dataclass(frozen=True)
class Reduction:
    """What reducing shard j came to. Published here: `mean` as every reader decodes it and
    `blob`, the object put, which the caller keeps to serve repairs (`repairs.RepairDesk`).
    Published by another replica first (a takeover's race, or a late reducer whose inputs were
    cleaned up after someone else reduced them): both None, and the caller reads that mean."""

    j: int
    mean: torch.Tensor | None = None
    blob: list | None = None

    @property
    def published_here(self) -> bool:
        return self.blob is not None


class _PublishedElsewhere(Exception):
    """Shard j was reduced by another replica while this one read its inputs."""


class ShardReducer:
    """Reduces the shards this replica is the reducer of, or takes over (one per replica and lane)."""

    def __init__(self, io: RoundIO, membership: Membership, *, window: int, step_cap: int | None,
                 codec_device: CodecDevice | None = None):
        self.io, self.membership = io, membership
        self.window, self.step_cap = window, step_cap
        self.codec_device = codec_device or CodecDevice()

    def reduce(self, rnd: Round, j: int, *, takeover: bool) -> Reduction:
        """Average shard j of `rnd` over its members and publish it (create-only).

        Each member's contribution is assembled from the pieces its lanes sent (`layout.Cut.pieces`
        by its lane count); this lane's own piece is read locally.
        `takeover`: shard j's reducer died, so its owner's kept piece (never uploaded) is gone too.
        If another replica publishes shard j first, the `Reduction` says so and holds no mean.
        """
        with self.codec_device.running():
            return self._reduce(rnd, j, takeover=takeover)

    def _reduce(self, rnd: Round, j: int, *, takeover: bool) -> Reduction:
        io, r, numel = self.io, rnd.r, rnd.size(j)
        device = self.codec_device.device
        a = rnd.cut.bounds[j][0]
        owner = rnd.owner(j)
        local = io.rank if rnd.member else None  # whose contribution includes this lane's own piece

        def remote(m: int) -> list[tuple[int, int, int]]:
            """Member m's pieces of shard j in the store (lane, start, stop)."""
            return [(k, p, q) for k, p, q in rnd.cut.pieces(j, rnd.layouts.get(m, 1))
                    if not (m == local and k == rnd.lane)]

        sources = [m for m in rnd.members if remote(m)]
        if takeover and owner in sources and owner != io.rank:
            sources.remove(owner)  # a dead owner kept its own piece of shard j locally: its update is gone
        in_sum = [m for m in rnd.members if m in sources or m == local]

        def fetch(m: int) -> tuple[list | None, str | None, str]:
            got = []
            for k, p, q in remote(m):
                obj, problem = io.get_scatter(r, j, m, k, q - p)
                if obj is None:
                    return None, problem, io.keys.scatter(r, j, m, k)
                got.append((k, p, q, obj))
            return got, None, ""

        prefetch = Prefetch(io.pool, fetch, sources, self.window)
        left_out: dict[str, str] = {}
        steps_of: dict[int, int] = {}  # time-based rounds: each contribution's inner steps

        def leave_out(m: int, problem: str, *, nonfinite: bool = False, key: str | None = None) -> None:
            key = key or io.keys.scatter(r, j, m, rnd.cut.lead(j, rnd.layouts.get(m, 1)))
            rnd.left_out(j, key, m, problem, nonfinite=nonfinite)
            io.log(f"round {r}: {key} from rank {m}: {problem}; left out of shard {j}'s mean")
            left_out[str(m)] = problem

        def assemble(readers: list[tuple[int, int, Callable[[], torch.Tensor]]]) -> Callable[[], torch.Tensor]:
            """A member's whole shard from its pieces (one piece: as read, no copy)."""
            if len(readers) == 1:
                return readers[0][2]

            def read() -> torch.Tensor:
                out = torch.empty(numel, dtype=torch.float32, device=device)
                for p, q, piece in readers:
                    out[p - a:q - a] = piece()
                return out

            return read

        def contributions():
            for m in in_sum:
                key = io.keys.scatter(r, j, m, rnd.cut.lead(j, rnd.layouts.get(m, 1)))
                readers: list[tuple[int, int, Callable[[], torch.Tensor]]] = []
                if m == local:
                    if rnd.steps is not None:
                        steps_of[m] = rnd.steps
                    p, q = rnd.piece(j)
                    if p < q:
                        readers.append((p, q, lambda: rnd.own(j, device)))
                if m in sources:
                    got, problem, where = prefetch.next(m)
                    if got is None:
                        if problem == "missing":
                            self.membership.check_not_collected(r)
                        if io.exists(io.keys.reduced(r, j)):  # reduced (and inputs cleaned) while we looked
                            raise _PublishedElsewhere
                        leave_out(m, problem, key=where)
                        continue
                    if self.step_cap is not None:
                        stated = {s if type(s := obj.meta.get("steps")) is int else repr(s) for _, _, _, obj in got}
                        stated |= {steps_of[m]} if m in steps_of else set()
                        steps = next(iter(stated)) if len(stated) == 1 else None
                        if type(steps) is not int or not 1 <= steps <= self.step_cap:
                            leave_out(m, f"its inner-step count {steps!r} is not an integer in 1..{self.step_cap}"
                                      if len(stated) == 1 else f"its pieces state different inner-step counts "
                                      f"{sorted(stated, key=repr)}")
                            continue
                        steps_of[m] = steps
                    for k, p, q, obj in got:
                        reader = ReadOnceThenRefetch(obj, lambda m=m, k=k, p=p, q=q: io.get_scatter(r, j, m, k, q - p),
                                                     device)
                        readers.append((p, q, reader.read))
                    obj = got = None  # this frame must not keep the downloads alive while the next ones come
                readers.sort(key=lambda x: x[0])
                yield Contribution(m, key, assemble(readers), 1.0 / steps_of.get(m, 1))

        try:
            summed = accumulate(contributions(), numel, device)
        except _PublishedElsewhere:
            return Reduction(j)
        finally:
            prefetch.cancel()
        for m, problem in summed.corrupt.items():
            leave_out(m, problem)
        for m in summed.nonfinite:
            leave_out(m, f"{NONFINITE} in its update", nonfinite=True)
        if not summed.used:
            if summed.nonfinite and len(summed.nonfinite) == len(left_out):
                if len(rnd.members) == 1 and io.n > 1:  # one replica's divergence, not the run's
                    return self._publish(rnd, j, torch.zeros(numel, device=device),
                                         {"members": [], "left_out": left_out, "nonfinite": summed.nonfinite,
                                          "reducer": io.rank, "takeover": takeover},
                                         finite_total=True, flagged=summed.nonfinite)
                raise NonFinite(f"round {r}: every contribution to shard {j} is non-finite (NaN or Inf), from ranks "
                                f"{summed.nonfinite}: training diverged on every member, so no finite global state "
                                f"can follow; lower the learning rate (or check the data) and start a new run")
            raise RoundFailed(f"round {r}: no usable contribution to shard {j}")
        # in place: one shard-sized buffer (the rounding of total / n, on either device)
        mean = summed.total.div_(exact_divisor(len(summed.used), summed.total))
        meta = {"members": summed.used, "left_out": left_out, "nonfinite": summed.nonfinite, "reducer": io.rank,
                "takeover": takeover}
        if self.step_cap is not None:  # FedNova: the mean of Δ_i/τ_i, scaled back by the mean τ
            used_steps = [steps_of[m] for m in summed.used]
            mean.mul_(sum(used_steps) / len(used_steps))
            meta["steps"] = dict(zip(map(str, summed.used), used_steps))
        return self._publish(rnd, j, mean, meta, finite_total=summed.finite, flagged=summed.nonfinite)

    def _publish(self, rnd: Round, j: int, mean: torch.Tensor, meta: dict, *, finite_total: bool,
                 flagged: list[int]) -> Reduction:
        """Encode and create-only put shard j's mean: what was published, with the mean decoded
        from it; or, if another replica published first, that it did."""
        io, r, numel = self.io, rnd.r, rnd.size(j)
        blob = pack(io.reduced_identity(r, j), encode_tensor(mean, io.codec), codec=io.codec, numel=numel, meta=meta)
        payload = blob[1] if len(blob) == 2 else b"".join(blob[1:])
        decoded = decode_tensor(payload, io.codec, numel)  # exactly what every reader decodes
        # fp32 decodes to total / k exactly, finite with the total; another codec's range may overflow
        if not (finite_total and io.codec == "fp32" and self.step_cap is None) and not all_finite(decoded):
            raise NonFinite(f"round {r}: the mean of shard {j} would be non-finite in transport {io.codec!r} "
                            f"(it overflowed): training diverged; it is not published. Lower the learning rate and "
                            f"start a new run")
        if io.put(io.keys.reduced(r, j), blob, create_only=True, written=("reduced", r, j)):
            rnd.nonfinite.update(flagged)
            return Reduction(j, decoded, blob)
        return Reduction(j)  # someone else won: the caller reads theirs
