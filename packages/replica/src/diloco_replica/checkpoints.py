"""The run's history in the store: checkpoints, the garbage-collection low-water mark, and GC.

- Checkpoints every `checkpoint_every` rounds at ``ckpt/r<round>/<j>``: shard j of
  [θ_global ; momentum] in fp32, written create-only by shard j's reducer; round 0 is the
  initial state. With L processes per replica, lane k's shard j is j·L + k and a
  checkpoint is complete with all N·L. A rejoining replica loads the newest *complete* checkpoint and replays the
  reduced shards of the rounds after it.
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

from .finite import all_finite
from .roundio import RoundIO
from .storeaccess import shard_bounds
from .wire import CorruptObject, Identity, check_layout, encode_tensor, pack, unpack

VOID = "void"
LOAD_WINDOW_BYTES = 64 << 20  # checkpoint shards up to this size are fetched four at a time


class Checkpoints:
    def __init__(self, io: RoundIO):
        self.io = io

    # -- low-water mark ----------------------------------------------------------------------

    def low_water(self) -> int:
        """The highest round GC has begun deleting (0: nothing deleted yet). One LIST."""
        marks = [x for x in self.io.store.list_names(self.io.keys.low_water()) if x.startswith("gc-through-r")]
        return max((int(x.rsplit("r", 1)[1]) for x in marks if x.rsplit("r", 1)[1].isdigit()), default=0)

    def _mark_low_water(self, r: int) -> None:
        self.io.put(self.io.keys.low_water(r), b"{}", create_only=True)  # a mark already there is as good

    # -- checkpoints -------------------------------------------------------------------------

    def put_shard(self, r: int, j: int, theta: torch.Tensor, buf: torch.Tensor | None, *,
                  digest: str | None = None) -> None:
        """Shard j of [θ ; momentum] (momentum None: zeros, as at round 0)."""
        io = self.io
        a, b = shard_bounds(theta.numel(), io.n)[j]
        parts = encode_tensor(theta[a:b], "fp32") + encode_tensor(buf[a:b] if buf is not None else torch.zeros(b - a),
                                                                  "fp32")  # written as two buffers, never joined
        blob = pack(Identity(io.run_id, r, "ckpt", io.sid(j), -1), parts, codec="fp32",
                    numel=2 * (b - a), meta={"numel": theta.numel(), "writer_digest": digest})
        io.put(io.keys.checkpoint(r, io.sid(j)), blob, create_only=True)  # a shard already there is the same

    def complete(self) -> list[int]:
        """Rounds with every checkpoint shard present and no void marker, oldest first."""
        counts: dict[int, int] = {}
        void: set[int] = set()
        for name in self.io.store.list_names(self.io.keys.checkpoints()):
            head, _, leaf = name.partition("/")
            if not (head.startswith("r") and head[1:].isdigit()):
                continue
            if leaf == VOID:
                void.add(int(head[1:]))
            elif leaf.isdigit():
                counts[int(head[1:])] = counts.get(int(head[1:]), 0) + 1
        return sorted(r for r, c in counts.items() if c >= self.io.n * self.io.shards.lanes and r not in void)

    def present(self, r: int) -> set[int]:
        """This lane's shards of checkpoint r already in the store (one LIST)."""
        return self.io.present(self.io.keys.checkpoint(r))

    def void(self, rounds: list[int], why: str) -> None:
        """Mark checkpoints unusable (written from a diverged θ); create-only, idempotent."""
        for r in rounds:
            self.io.put(self.io.keys.checkpoint(r, VOID), json.dumps({"why": why}).encode(), create_only=True)

    def load(self, r: int, numel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This lane's θ and momentum of checkpoint r; None if a shard vanished (GC raced us) or is corrupt."""
        io = self.io
        bounds = shard_bounds(numel, io.n)
        keys = [io.keys.checkpoint(r, io.sid(j)) for j in range(io.n)]
        theta, buf = torch.empty(numel), torch.empty(numel)
        # Shards in flight are copied out and dropped as they come, so loading holds a few shards
        # beyond θ and the momentum, not the whole checkpoint twice: four small ones, or one large.
        depth = 4 if 8 * numel // io.n <= LOAD_WINDOW_BYTES else 1
        window = [io.pool.submit(io.store.get, k) for k in keys[:depth]]
        for j, key in enumerate(keys):
            blob = window.pop(0).result()
            if j + depth < len(keys):
                window.append(io.pool.submit(io.store.get, keys[j + depth]))
            if blob is None:
                io.log(f"checkpoint shard {key} vanished while loading; trying the next checkpoint")
                return None
            a, b = bounds[j]
            try:
                got = unpack(blob, Identity(io.run_id, r, "ckpt", io.sid(j), -1), key)
                if got.meta.get("numel") != numel:
                    from diloco.errors import UserError

                    raise UserError(f"{key} holds a model of {got.meta.get('numel')} parameters, this replica has "
                                    f"{numel}: the rendezvous store already holds run {io.run_id!r} of another "
                                    f"model; use a new run or another rendezvous")
                part = check_layout(got, numel=2 * (b - a), codec="fp32").tensor()
                if not all_finite(part):
                    raise CorruptObject(f"{key}: non-finite values in a checkpoint (no replica writes them)")
            except CorruptObject as exc:
                self._void_corrupt(r, key, exc)
                return None
            theta[a:b], buf[a:b] = part[: b - a], part[b - a:]  # copies out of the downloaded buffer
        return theta, buf

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
