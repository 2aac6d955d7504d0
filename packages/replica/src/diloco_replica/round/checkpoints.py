"""The run's history in the store: checkpoints, the garbage-collection low-water mark, and GC.

- Checkpoints every `checkpoint_every` rounds, and of the run's last round when its training
  ends (`GlobalState.checkpoint_last`), at ``ckpt/r<round>/<a>-<b>``: [θ_global ;
  momentum] of the model's values [a, b) in fp32. Shard j of N (of the whole model) is written
  create-only by shard j's reducer, each of its lanes writing its piece of it (`layout`); round
  0 is the initial state. A piece holds at most `CHECKPOINT_PIECE_VALUES` values (512 MiB: one
  PUT of any store takes it; `layout.piece_cuts`), so a lane's share of a shard may be several
  pieces. Pieces are named by their ranges, so a checkpoint written by replicas
  of one lane count loads into replicas of another; it is complete once its pieces cover the
  model (`layout.cover`). A rejoining replica loads the newest *complete* checkpoint and
  replays the reduced shards of the rounds after it.
- A checkpoint can be voided (``ckpt/r<round>/void``) by a replica that learns its θ had
  diverged when it wrote shards of it, or by a loader that finds a shard corrupt — a bad
  checksum, the wrong length for its shard, or non-finite values — which is an incident too
  (`RoundIO.report`); loaders and GC skip void checkpoints.
- The low-water mark: before GC deletes anything it writes ``history/gc-through-r<p>``
  (create-only). Every round ≤ the highest mark is gone or going, so a replica that has not
  decided such a round must rejoin from a checkpoint, never decide it again — round 1
  included (a replica still at round 0 must not re-run a deleted round 1 alone).
"""

from __future__ import annotations

import json

import torch

from diloco.store.runkeys import CHECKPOINT_PIECE_VALUES
from diloco.store.scaling import ranks_ok

from ..transport.finite import all_finite
from .io import RoundIO
from .layout import clip, cover, piece_cuts
from ..transport.wire import CorruptObject, Identity, check_layout, encode_tensor, pack, unpack

VOID = "void"
LOAD_WINDOW_BYTES = 64 << 20  # checkpoint shards up to this size are fetched four at a time


class Checkpoints:
    """The run's checkpoints of a model of `total` values (set once the model is known:
    `GlobalState`), its low-water mark and its garbage collection."""

    def __init__(self, io: RoundIO, total: int = 0):
        self.io, self.total = io, total

    # -- low-water mark ----------------------------------------------------------------------

    def low_water(self) -> int:
        """The highest round GC has begun deleting (0: nothing deleted yet). One LIST."""
        marks = [x for x in self.io.store.list_names(self.io.keys.low_water()) if x.startswith("gc-through-r")]
        return max((int(x.rsplit("r", 1)[1]) for x in marks if x.rsplit("r", 1)[1].isdigit()), default=0)

    def _mark_low_water(self, r: int) -> None:
        self.io.put(self.io.keys.low_water(r), b"{}", create_only=True)  # a mark already there is as good

    # -- checkpoints -------------------------------------------------------------------------

    def put_piece(self, r: int, piece: tuple[int, int], start: int, theta: torch.Tensor,
                  buf: torch.Tensor | None, roster: list[int]) -> None:
        """[θ ; momentum] of the model's values `piece` = [a, b), from a lane whose `theta` and
        `buf` begin at the model's value `start` (momentum None: zeros, as at round 0), as objects
        of at most `CHECKPOINT_PIECE_VALUES` values each (`layout.piece_cuts`); `roster`: round
        r + 1's ranks (`roster`), which a replica rejoining from here needs."""
        io = self.io
        for a, b in piece_cuts(*piece, CHECKPOINT_PIECE_VALUES):
            x, y = a - start, b - start
            momentum = buf[x:y] if buf is not None else torch.zeros(b - a)  # one piece's worth at a time
            parts = encode_tensor(theta[x:y], "fp32") + encode_tensor(momentum, "fp32")  # two buffers, never joined
            blob = pack(Identity(io.run_id, r, "ckpt", a, b), parts, codec="fp32", numel=2 * (b - a),
                        meta={"numel": self.total, "next": roster})
            io.put(io.keys.checkpoint(r, (a, b)), blob, create_only=True)  # a piece already there is the same

    def complete(self) -> list[int]:
        """Rounds whose pieces cover the whole model and that are not void, oldest first."""
        pieces: dict[int, list[tuple[int, int]]] = {}
        void: set[int] = set()
        for name in self.io.store.list_names(self.io.keys.checkpoints()):
            head, _, leaf = name.partition("/")
            if not (head.startswith("r") and head[1:].isdigit()):
                continue
            if leaf == VOID:
                void.add(int(head[1:]))
            elif (piece := self._piece(leaf)) is not None:
                pieces.setdefault(int(head[1:]), []).append(piece)
        return sorted(r for r, got in pieces.items() if r not in void and cover(got, 0, self.total) is not None)

    def present(self, r: int) -> list[tuple[int, int]]:
        """The pieces of checkpoint r already in the store (one LIST)."""
        return [p for p in map(self._piece, self.io.store.list_names(self.io.keys.checkpoint(r))) if p is not None]

    def _piece(self, name: str) -> tuple[int, int] | None:
        """[a, b) from a piece's name `<a>-<b>` if it is one within the model (else None: ignored)."""
        a, _, b = name.partition("-")
        if a.isdigit() and b.isdigit() and 0 <= int(a) < int(b) <= self.total:
            return int(a), int(b)
        return None

    def void(self, rounds: list[int], why: str) -> None:
        """Mark checkpoints unusable (written from a diverged θ); create-only, idempotent."""
        for r in rounds:
            self.io.put(self.io.keys.checkpoint(r, VOID), json.dumps({"why": why}).encode(), create_only=True)

    def load(self, r: int, start: int, stop: int, into: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
             *, void: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """θ and momentum of checkpoint r for the model's values [start, stop) (a lane's), and round
        r + 1's roster; None if a piece vanished (GC raced us), is corrupt, or the pieces leave a gap.

        `into`: the buffers to load θ and the momentum into (each made here where None), so a join
        holds no second copy of the state; after a None they hold part of checkpoint r, which the
        caller's next load overwrites whole. `void`: a corrupt piece voids the checkpoint and is
        reported (a replica's load); False: only logged (a reader outside the run changes nothing)."""
        io = self.io
        theta, buf = (x if x is not None else torch.empty(stop - start) for x in into)
        if theta.numel() != stop - start or buf.numel() != stop - start:
            raise ValueError(f"load into buffers of {theta.numel()} and {buf.numel()} values, not {stop - start}")
        rosters: list[list[int]] = []
        # a lane holding nothing of the model (a tiny one) still reads one piece: its roster
        chain = cover(self.present(r), start, stop) if start < stop else cover(self.present(r), 0, 1)
        if chain is None:
            io.log(f"checkpoint {r} no longer covers values [{start}, {stop}); trying the next checkpoint")
            return None
        keys = [io.keys.checkpoint(r, piece) for piece in chain]
        # Pieces in flight are copied out and dropped as they come, so loading holds a few pieces
        # beyond θ and the momentum, not the whole checkpoint twice: four small ones ahead, or one
        # large one at a time (a piece of a 2-replica run is as large as the model).
        small = chain and 8 * max(b - a for a, b in chain) <= LOAD_WINDOW_BYTES
        ahead = 3 if small else 0
        window = [io.pool.submit(io.store.get, k) for k in keys[:ahead + 1]]
        for i, ((a, b), key) in enumerate(zip(chain, keys)):
            blob = window.pop(0).result()
            if ahead and i + ahead + 1 < len(keys):
                window.append(io.pool.submit(io.store.get, keys[i + ahead + 1]))
            if blob is None:
                io.log(f"checkpoint piece {key} vanished while loading; trying the next checkpoint")
                return None
            try:
                got = unpack(blob, Identity(io.run_id, r, "ckpt", a, b), key)
                if got.meta.get("numel") != self.total:
                    from diloco.errors import UserError

                    raise UserError(f"{key} holds a model of {got.meta.get('numel')} parameters, this replica has "
                                    f"{self.total}: the rendezvous store already holds run {io.run_id!r} of another "
                                    f"model; use a new run or another rendezvous")
                roster = got.meta.get("next")
                if not ranks_ok(roster) or rosters and roster != rosters[0]:
                    raise CorruptObject(f"{key}: malformed or disagreeing roster of the next round: {str(roster)[:80]}")
                rosters.append(roster)
                part = check_layout(got, numel=2 * (b - a), codec="fp32").tensor()
                if not all_finite(part):
                    raise CorruptObject(f"{key}: non-finite values in a checkpoint (no replica writes them)")
            except CorruptObject as exc:
                if void:
                    self._void_corrupt(r, key, exc)
                else:
                    io.log(f"checkpoint piece {key} is corrupt: {exc}")
                return None
            x, y = clip(a, b, start, stop)  # copies out of the downloaded buffer
            theta[x - start:y - start], buf[x - start:y - start] = part[x - a:y - a], part[b - a + x - a:b - a + y - a]
            del blob, got, part  # before the next piece arrives
            if not ahead and i + 1 < len(keys):
                window.append(io.pool.submit(io.store.get, keys[i + 1]))
        return theta, buf, rosters[0]

    def _void_corrupt(self, r: int, key: str, exc: CorruptObject) -> None:
        """A checkpoint shard no replica can use: void the checkpoint (loaders go to an older one)
        and report it, so the launcher shows an `incident` as it does for corruption in a round."""
        self.void([r], f"corrupt shard: {exc}")
        self.io.report({"round": r, "object": key, "writer": None, "problem": str(exc), "during": "rejoin",
                        "action": f"checkpoint {r} voided by rank {self.io.rank}; an older one is loaded"})

    # -- garbage collection ------------------------------------------------------------------

    def collect_garbage(self, newest: int) -> int:
        """Delete what no rejoin can need any more; returns how many objects went.

        A rejoiner loads the newest complete checkpoint and replays the rounds after it. Once
        checkpoint p < `newest` is complete, rounds ≤ p and checkpoints < p are dead weight (p,
        not `newest`: `newest` may still miss a shard whose writer died). The low-water mark
        p is written first, so no replica decides a round that is being deleted.
        """
        try:
            older = [c for c in self.complete() if c < newest]
            if not older:
                return 0
            keep_from = max(older)
            self._mark_low_water(keep_from)
            io = self.io
            raw = io.store.store  # the listing is not counted; the deletes below are
            doomed = [d for d in raw.list_dirs(f"{io.run_id}/") if _round_below(d.rsplit("/", 1)[-1], keep_from + 1)]
            doomed += [d for d in raw.list_dirs(io.keys.checkpoints()) if _round_below(d.rsplit("/", 1)[-1], keep_from)]
            n = 0
            for prefix in doomed:
                for meta in list(raw.list(prefix + "/")):
                    io.store.delete(meta["path"])
                    n += 1
            if n:
                io.log(f"removed {n} objects of rounds before checkpoint {keep_from}")
            return n
        except Exception as exc:  # storage hygiene must never stop training
            self.io.log(f"garbage collection after round {newest} failed: {exc}")
            return 0


def _round_below(name: str, below: int) -> bool:
    """Whether a directory named r<round> holds a round older than `below`."""
    return name.startswith("r") and name[1:].isdigit() and int(name[1:]) < below
