"""Fault-injection aids the test harnesses use; off (one attribute check) unless enabled."""

from __future__ import annotations

import os
import time


class PhaseMarker:
    """Announces which phase of a round a replica is in.

    With DILOCO_FAULT_PHASE_FILE set (``{rank}`` and ``{lane}`` are replaced), each phase's name,
    the round and the process id are written there as the phase starts, and
    DILOCO_FAULT_PHASE_DELAY seconds are slept, so a test harness can aim SIGKILLs and SIGSTOPs
    at uploads, reductions and gathers — at one process of a multi-process replica too — and
    record where each landed. Without ``{lane}`` in the template only process 0 writes.
    """

    def __init__(self, rank: int, lane: int = 0):
        template = os.environ.get("DILOCO_FAULT_PHASE_FILE")
        if template and lane and "{lane}" not in template:
            template = None
        self.path = template.replace("{rank}", str(rank)).replace("{lane}", str(lane)) if template else None
        self.delay = float(os.environ.get("DILOCO_FAULT_PHASE_DELAY") or 0)

    def __call__(self, phase: str, r: int) -> None:
        if self.path is None:
            return
        with open(self.path, "w") as f:
            f.write(f"{phase} {r} {os.getpid()}\n")
        if self.delay:
            time.sleep(self.delay)


class CorruptionInjector:
    """Damages objects at rest right after they are written, as bit rot or a bad disk would.

    DILOCO_FAULT_CORRUPT="scatter:3:0:1,reduced:5:2" flips one payload byte of round 3's shard 0
    from rank 1, and of round 5's reduced shard 2, in the store, after the writer has put them
    (the writer keeps the good bytes it had). Off unless the variable is set.
    """

    def __init__(self):
        spec = os.environ.get("DILOCO_FAULT_CORRUPT") or ""
        self.targets = {tuple(x.split(":")) for x in spec.split(",") if x}

    def __call__(self, store, key: str, kind: str, r: int, owner: int, src: int | None = None) -> None:
        want = (kind, str(r), str(owner)) + ((str(src),) if src is not None else ())
        if want not in self.targets:
            return
        blob = bytearray(store.get(key))
        blob[-1] ^= 0xFF
        store.put(key, bytes(blob))


class Faults:
    """The fault-injection hooks a round's I/O calls (`roundio.RoundIO`): where a replica is
    (`phase`) and what it just wrote (`after_write`). Off unless the variables above are set."""

    def __init__(self, rank: int = 0, lane: int = 0):
        self.phase = PhaseMarker(rank, lane)
        self.after_write = CorruptionInjector()
