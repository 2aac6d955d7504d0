"""The store layout of one run: every key its objects live under, declared once, for the launcher
(presence and scale targets, round summaries and metrics rows read back, artifacts, the store
probe) and the replicas (rounds, checkpoints, history, presence, metrics) alike.

A layout change made here is made for both packages; a key built by hand elsewhere is one that
could drift from it unseen (packages/core/tests/test_runkeys.py lists every family once, with
the exact names the store holds). Documented for users in packages/replica/README.md.

Round numbers in keys are zero-padded to 8 digits, so a listing sorts by round and a reader can
LIST from an offset past the rounds it has (`diloco.store.metrics.RoundReader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .presence import away_name, join_name

SCALE_PREFIX, SCALE_SUFFIX = "scale-", ".json"

# The largest object a run writes. A checkpoint piece holds [θ ; momentum] of its values in fp32 (8
# bytes a value), so a shard of a 1B model of 2 replicas would be one 4 GB object and of 1 replica
# 8 GB: over S3's 5 GiB and Azure's 5,000 MiB limits of a single PUT, which a create-only write
# must be. Pieces are cut at multiples of this many of the model's values (512 MiB objects), the
# same cuts whoever writes them, and a loader holds one piece beside the state it fills.
CHECKPOINT_PIECE_VALUES = 1 << 26


def scale_seq(name: str) -> int | None:
    """The sequence number of a scale target from its name in ``roster/`` (``scale-<seq>.json``),
    or None for any other name."""
    if not (name.startswith(SCALE_PREFIX) and name.endswith(SCALE_SUFFIX)):
        return None
    digits = name[len(SCALE_PREFIX):-len(SCALE_SUFFIX)]
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 12 else None


@dataclass(frozen=True)
class RunKeys:
    """The keys of run `run` (its id, the first segment of every key)."""

    run: str

    # -- a round's exchange ------------------------------------------------------------------

    def round(self, r: int) -> str:
        return f"{self.run}/r{r:08d}"

    def scatter(self, r: int, shard: int, src: int, lane: int) -> str:
        """Lane `lane` of replica `src`: its piece of shard j (`diloco_replica.round.layout.Cut.pieces`)."""
        return f"{self.round(r)}/scatter/{shard}/{src}.{lane}"

    def ready(self, r: int, src: int | None = None, lanes: int = 1, incarnation: int = 0) -> str:
        """That incarnation (`diloco.store.presence.incarnation`) of replica `src` of `lanes` processes
        has every piece it sends in the store (the name carries its lane count and incarnation, so
        whoever decides the round learns them from one LIST, and everyone can tell when a member's
        incarnation ended)."""
        return f"{self.round(r)}/ready/" + ("" if src is None else f"{src}.{lanes}.{incarnation}")

    def members(self, r: int) -> str:
        return f"{self.round(r)}/members.json"

    def reduced(self, r: int, owner: int | None = None) -> str:
        """Reduced shard j under a prefix of its own (`reduced/<j>/mean`): every replica GETs every
        reduced shard, N² GETs a round, which in one prefix would pass S3's 5,500 GET/s per prefix
        from N ≈ 64 on (bench/scale.py); one LIST of `reduced/` still finds them all."""
        return f"{self.round(r)}/reduced/" + ("" if owner is None else f"{owner}/mean")

    def repair(self, r: int, owner: int | None = None) -> str:
        return f"{self.round(r)}/repair/" + ("" if owner is None else str(owner))

    def repaired(self, r: int, owner: int) -> str:
        return f"{self.round(r)}/repaired/{owner}"

    def claim(self, r: int, owner: int, generation: int) -> str:
        return f"{self.round(r)}/claim/{owner}.{generation}"

    # -- checkpoints and the history kept ----------------------------------------------------

    def checkpoint(self, r: int, piece: tuple[int, int] | str | None = None) -> str:
        """Checkpoint r's piece [a, b) of the model (`<a>-<b>`; at most `CHECKPOINT_PIECE_VALUES`
        values, cut at its multiples), or its `void` marker."""
        name = "" if piece is None else piece if isinstance(piece, str) else f"{piece[0]}-{piece[1]}"
        return f"{self.run}/ckpt/r{r:08d}/{name}"

    def checkpoints(self) -> str:
        return f"{self.run}/ckpt/"

    def model(self) -> str:
        """What the checkpoints' flat θ holds: each trainable parameter's name and shape, in order
        (`diloco_replica.outer.manifest`), so `diloco export` can name the tensors it writes."""
        return f"{self.run}/model.json"

    def model_config(self) -> str:
        """The model's own configuration where its trainer integration knows one (a transformers
        ``config.json``: `diloco_replica.outer.modelconfig`), so an export is a directory the model's
        library loads (``from_pretrained``)."""
        return f"{self.run}/model-config.json"

    def low_water(self, r: int | None = None) -> str:
        return f"{self.run}/history/" + ("" if r is None else f"gc-through-r{r:08d}")

    # -- who is in the run -------------------------------------------------------------------

    def roster(self) -> str:
        """The launcher's scale targets and away markers, and replicas' join markers
        (`diloco.store.presence`, `diloco.store.scaling`)."""
        return f"{self.run}/roster/"

    def scale(self, seq: int) -> str:
        return f"{self.roster()}{SCALE_PREFIX}{seq:08d}{SCALE_SUFFIX}"

    def join(self, rank: int, round_: int, incarnation: int) -> str:
        """That incarnation of `rank` (`diloco.store.presence.incarnation`) takes part from round `round_` on."""
        return f"{self.roster()}{join_name(rank, round_, incarnation)}"

    def away(self, rank: int, incarnation: int) -> str:
        """The launcher saw that incarnation of `rank`, and every earlier one, end."""
        return f"{self.roster()}{away_name(rank, incarnation)}"

    # -- what the run reports ----------------------------------------------------------------

    def metrics(self, r: int | None = None, rank: int | None = None) -> str:
        """Each replica's row of round r (`diloco.store.metrics.RoundMetrics`); without `rank`, the
        round's folder of rows; without `r`, every round's."""
        if r is None:
            return f"{self.run}/metrics/"
        return f"{self.run}/metrics/r{r:08d}/" + ("" if rank is None else f"rank-{rank}.json")

    def summary(self, r: int | None = None) -> str:
        """Round r's summary (`diloco.store.metrics.RoundSummary`); without `r`, the folder of them."""
        return f"{self.run}/rounds/" + ("" if r is None else f"r{r:08d}.json")

    def artifact(self, name: str | None = None) -> str:
        """A file the replicas leave for the launcher to copy beside the run's records."""
        return f"{self.run}/artifacts/" + (name or "")

    def probe(self, name: str | None = None) -> str:
        """The objects a store's start-up proof writes and deletes (`diloco.store.objectstore.verify_store`)."""
        return f"{self.run}/probe/" + (name or "")
