"""Where every value of the model lives: one flat vector, cut the same way by every replica.

The exchange, the checkpoints and the fragments are all defined over the model's flat fp32
parameter vector of T values, never over what one process holds, so a replica of 1 process and
one of 8 meet in the same round and load the same checkpoints:

- **Lanes.** A replica of L processes syncs as L lanes; lane k holds the k-th of L contiguous
  slices of the vector (`lane_range`), cut on a grid of `BLOCK` values that no lane count
  changes, so the state's digest is the same sum of per-block hashes on every replica. DDP's processes each hold the whole model and sync their
  slice; FSDP2's are redistributed into these slices inside the replica (`modelview`).
- **Fragments.** Fragment p of K (Streaming DiLoCo) is the p-th of K contiguous slices of the
  vector; a round syncs one fragment, and a lane takes part with what it holds of it (maybe
  nothing).
- **Shards.** A round's fragment is cut into N·P shards (`Cut.bounds`; P parts a replica,
  `diloco.store.wiresize.parts_per_shard` of the fragment's size), the same for every replica. Each
  lane sends its *piece* of a shard — the shard ∩ its slice — as an object of its own; the
  shard's reducer assembles every member's pieces, whatever the member's lane count, and
  publishes one mean per shard, which every lane holding part of the shard reads.

A replica's lane counts reach the others through the round's membership record, so every
reducer knows which pieces to expect from whom.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LANES = 4096  # processes in one replica: what a ready marker or a membership record may claim
BLOCK = 4096      # values: lanes start on a multiple of it, so a block is always one lane's (`outer.state_digest`)


def shard_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """N contiguous, near-equal slices covering [0, numel)."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def lane_range(total: int, lanes: int, lane: int) -> tuple[int, int]:
    """The slice [a, b) of a model of `total` values that lane `lane` of `lanes` holds: whole
    `BLOCK`s, near-equal (a model under `lanes` blocks leaves the last lanes empty)."""
    a, b = shard_bounds(-(-total // BLOCK), lanes)[lane]
    return min(a * BLOCK, total), min(b * BLOCK, total)


def lane_fragment(total: int, lanes: int, lane: int, part: int, parts: int) -> tuple[int, int]:
    """What lane `lane` of `lanes` holds of fragment `part` of `parts`, in the lane's own coordinates."""
    a, b = lane_range(total, lanes, lane)
    x, y = clip(*shard_bounds(total, parts)[part], a, b)
    return x - a, y - a


def clip(a: int, b: int, lo: int, hi: int) -> tuple[int, int]:
    """[a, b) ∩ [lo, hi), empty as (x, x)."""
    x, y = max(a, lo), min(b, hi)
    return (x, y) if x < y else (x, x)


@dataclass(frozen=True)
class Cut:
    """A round's vector — fragment [start, stop) of a model of `total` values — in N·P shards.

    Coordinates are the fragment's own (0 … stop − start) unless a name says otherwise.
    """

    total: int
    start: int
    stop: int
    n: int
    parts: int = 1
    bounds: list[tuple[int, int]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", shard_bounds(self.stop - self.start, self.n * self.parts))

    @property
    def count(self) -> int:
        return self.n * self.parts

    @property
    def live(self) -> list[int]:
        """The shards with values in them (a fragment smaller than N·P leaves some empty: nobody
        sends, reduces or reads those)."""
        return [j for j, (a, b) in enumerate(self.bounds) if a < b]

    def held(self, lanes: int, lane: int) -> tuple[int, int]:
        """What lane `lane` of a replica of `lanes` holds of the fragment (maybe empty)."""
        a, b = lane_range(self.total, lanes, lane)
        x, y = clip(a, b, self.start, self.stop)
        return x - self.start, y - self.start

    def pieces(self, j: int, lanes: int) -> list[tuple[int, int, int]]:
        """(lane, a, b): shard j as a replica of `lanes` holds it, one non-empty piece per lane."""
        a, b = self.bounds[j]
        out = []
        for k in range(lanes):
            x, y = self.held(lanes, k)
            p, q = clip(a, b, x, y)
            if p < q:
                out.append((k, p, q))
        return out

    def lead(self, j: int, lanes: int) -> int:
        """The lane of a replica of `lanes` that reduces shard j when that replica does: the one
        holding most of it (the first such), which keeps its own piece while the replica's other
        lanes send theirs — so a lane boundary inside a replica's own shard costs at most half a
        shard of upload, and lanes cut on `BLOCK`s rarely cut a shard at all."""
        pieces = self.pieces(j, lanes)
        return max(pieces, key=lambda x: (x[2] - x[1], -x[0]))[0] if pieces else 0

    def overlapping(self, a: int, b: int) -> list[int]:
        """The shards that overlap [a, b), in order."""
        return [j for j, (x, y) in enumerate(self.bounds) if x < b and a < y and x < y]


def piece_cuts(a: int, b: int, values: int) -> list[tuple[int, int]]:
    """[a, b) cut at the model's multiples of `values`: the checkpoint pieces a writer of [a, b)
    puts, each within a store's single-PUT limit (`diloco.store.runkeys.CHECKPOINT_PIECE_VALUES`).
    Cutting at absolute multiples, not every `values` from a, gives two writers of overlapping
    ranges (replicas of other lane counts) the same pieces where their ranges agree."""
    if values < 1:
        raise ValueError(f"pieces of {values} values")
    cuts, pos = [], a
    while pos < b:
        end = min(b, (pos // values + 1) * values)
        cuts.append((pos, end))
        pos = end
    return cuts


def cover(pieces: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]] | None:
    """Pieces (a, b) whose union covers [lo, hi), fewest first-come (greedy); None if there is a gap.

    Checkpoint pieces are named by their ranges; replicas of different lane counts cut a shard
    differently, so a checkpoint may hold overlapping pieces, and any chain of them will do.
    """
    if lo >= hi:
        return []
    chain, pos, i = [], lo, 0
    ordered = sorted(set(pieces))
    while pos < hi:  # one sweep: of the pieces starting at or before pos, the one reaching furthest
        best = None
        while i < len(ordered) and ordered[i][0] <= pos:
            if ordered[i][1] > pos and (best is None or ordered[i][1] > best[1]):
                best = ordered[i]
            i += 1
        if best is None:
            return None
        chain.append(best)
        pos = best[1]
    return chain
