"""The byte layout of what replicas put in the store, as arithmetic: one place for it.

diloco-replica's codecs (`diloco_replica.transport.codecs`) encode with these block sizes and check
every payload against `payload_nbytes`; the launcher's estimate (`diloco.spec.estimate`) predicts a
run's traffic with the same functions, without torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "topk")
INT8_CHUNK = 2048    # int8: one fp32 absmax scale per 2,048 elements
INT4_BLOCK = 256     # int4: one fp16 absmax scale per 256 elements
TOPK_BLOCK = 4096    # topk: each 4,096-element block keeps its own top elements
# Every object is a 13-byte prefix, a JSON header naming what it is (~150 bytes plus the run id,
# more for a reduced shard's member list), then the payload (`diloco_replica.transport.wire`).
OBJECT_OVERHEAD = 13 + 160
MARKER_NBYTES = 2          # a replica's "ready" marker
MEMBERS_NBYTES = 13 + 240  # a round's members.json: members, lane counts, attempts, the next roster, who is absent


def parts_per_shard(numel: int, n: int, part_mb: float) -> int:
    """P: how many objects each of a round's N shards of `numel` fp32 values is sent as.

    A shard of at most `part_mb` MiB (as fp32, whatever the codec) is one object; a larger one is
    cut into P near-equal parts, so a reducer folds one part while the next downloads and readers
    fetch the parts already published (`diloco_replica.round.allreduce`). Every replica computes the
    same P from the same numel and N, so it is never agreed on or stored.
    """
    shard_bytes = 4 * -(-numel // n)
    return max(1, -(-shard_bytes // max(1, int(part_mb * 2**20))))


@dataclass
class Traffic:
    """Bytes and requests through the store: what a replica counts (`diloco_replica.round.storeaccess`)
    and what the estimate predicts (`diloco.spec.estimate`), field for field.

    `polls` are the GETs and LISTs made while waiting for other replicas (also counted in
    `gets` and `lists`): their number follows the wait, not the protocol. `repair_looks` are
    the polls a reducer spends looking for repair requests (also in `polls`): only while it
    waits itself, at most one a second.
    """

    bytes_up: float = 0
    bytes_down: float = 0
    puts: float = 0
    gets: float = 0
    lists: float = 0
    deletes: float = 0
    polls: float = 0
    repair_looks: float = 0

    @property
    def request_count(self) -> float:
        """Billed requests the protocol makes, polls left out (deletes are free on S3)."""
        return self.puts + self.gets + self.lists - self.polls

    def requests(self) -> dict[str, float]:
        return {"puts": self.puts, "gets": self.gets, "lists": self.lists, "deletes": self.deletes, "polls": self.polls,
                "repair_looks": self.repair_looks}

    def snapshot(self) -> Traffic:
        return Traffic(**asdict(self))

    def since(self, before: Traffic) -> Traffic:
        return Traffic(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def times(self, k: float) -> Traffic:
        return Traffic(**{n: v * k for n, v in asdict(self).items()})

    def plus(self, other: Traffic) -> Traffic:
        return Traffic(**{n: v + getattr(other, n) for n, v in asdict(self).items()})


def blocks(numel: int, size: int) -> int:
    return (numel + size - 1) // size


def topk_kept(density: float) -> int:
    """Elements `topk` keeps per 4,096-element block at `density` (at least one)."""
    return max(1, math.ceil(density * TOPK_BLOCK))


def payload_nbytes(numel: int, codec: str, kept: int | None = None) -> int:
    """The payload size of `numel` elements under `codec`; `topk` needs the kept elements' count."""
    if codec == "fp32":
        return 4 * numel
    if codec in ("bf16", "fp16"):
        return 2 * numel
    if codec == "int8":
        return numel + 4 * blocks(numel, INT8_CHUNK)
    if codec == "int4":
        return (numel + 1) // 2 + 2 * blocks(numel, INT4_BLOCK)
    if codec == "topk":
        return 6 * blocks(numel, TOPK_BLOCK) + 3 * (kept or 0)
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


def expected_payload_nbytes(numel: int, codec: str, *, density: float = 0.01, union_of: int = 1) -> int:
    """What a shard of `numel` elements is expected to weigh on the wire.

    For `topk`, a replica's shard keeps `topk_kept(density)` per block; a reduced shard carries the
    union of `union_of` members' supports, bounded here by their sum (disjoint supports), so the
    estimate is an upper bound for reduced shards.
    """
    if codec != "topk":
        return payload_nbytes(numel, codec)
    n_blocks = blocks(numel, TOPK_BLOCK)
    per_block = min(TOPK_BLOCK, union_of * topk_kept(density))
    kept = min(numel, n_blocks * per_block)
    return payload_nbytes(numel, codec, kept)
