"""Fault-injection aids the test harnesses use; off (one attribute check) unless enabled."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from .codecs import decode, encode
from .wire import Identity, joined, pack, split


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
    """Damages objects on their way into the store, as a bad disk or a torn write would: the
    store never holds the good bytes, so no reader can have read them.

    DILOCO_FAULT_CORRUPT="scatter:3:0:1,reduced:5:2" flips one payload byte of round 3's shard 0
    from rank 1, and of round 5's reduced shard 2, as they are written (the writer keeps the good
    bytes it had). Off unless the variable is set.
    """

    def __init__(self):
        spec = os.environ.get("DILOCO_FAULT_CORRUPT") or ""
        self.targets = {tuple(x.split(":")) for x in spec.split(",") if x}

    def __call__(self, blob: bytes, kind: str, r: int, owner: int, src: int | None = None) -> bytes:
        want = (kind, str(r), str(owner)) + ((str(src),) if src is not None else ())
        if want not in self.targets:
            return blob
        damaged = bytearray(blob)
        damaged[-1] ^= 0xFF
        return bytes(damaged)


class WrongLengthInjector:
    """Re-packs objects as they are written with one element too many, as a writer bug would:
    identity, header and payload checksums all valid, only the layout is wrong.

    DILOCO_FAULT_WRONG_LENGTH="scatter:3:0:1,reduced:5:2" (targets as DILOCO_FAULT_CORRUPT's).
    """

    def __init__(self):
        spec = os.environ.get("DILOCO_FAULT_WRONG_LENGTH") or ""
        self.targets = {tuple(x.split(":")) for x in spec.split(",") if x}

    def __call__(self, blob: bytes, kind: str, r: int, owner: int, src: int | None = None) -> bytes:
        want = (kind, str(r), str(owner)) + ((str(src),) if src is not None else ())
        return lengthened(blob) if want in self.targets else blob


def lengthened(blob: bytes) -> bytes:
    """`blob` (a packed object, trusted: the injector's own write) with one more element, a zero."""
    h, payload = split(blob)
    values = decode(payload, h["codec"], h["numel"])
    parts = encode(torch.cat([values, torch.zeros(1)]), h["codec"])
    ident = Identity(h["run"], h["round"], h["kind"], h["owner"], h["src"])
    return joined(pack(ident, parts, codec=h["codec"], numel=h["numel"] + 1, meta=h["meta"]))


NONFINITE_FIRED = "fault injection: the parameters set to NaN after step"  # each firing's log line, to the step


class NonFiniteInjector:
    """Turns a replica's parameters NaN after a given global inner step, as a diverged step would
    leave them; the inner steps that follow poison the inner optimizer's state too.

    DILOCO_FAULT_NONFINITE="2:130,0:75": rank 2 after step 130, rank 0 after step 75 (once per
    process; a relaunched replica that resumes before the step meets it again). It fires only on
    the step itself: a replica that catches up from θ_global past the step (left behind, then
    holding rounds) never meets it, so each firing is logged, and a test knows what was injected.
    """

    def __init__(self, rank: int, log: logging.Logger | None = None):
        spec = os.environ.get("DILOCO_FAULT_NONFINITE") or ""
        pairs = [x.split(":") for x in spec.split(",") if x]
        self.steps = {int(step) for who, step in pairs if who == str(rank)}
        self.log = log or logging.getLogger(__name__)

    def __call__(self, step: int, view: Any) -> None:
        """`view`: the process's `modelview.ModelView` (its tensors are looked up only when firing)."""
        if not self.steps or step not in self.steps:
            return
        self.steps.discard(step)
        with torch.no_grad():
            for t in view.tensors:
                t.fill_(float("nan"))
        self.log.warning("%s %d", NONFINITE_FIRED, step)


class Faults:
    """The fault-injection hooks: where a replica is (`phase`), what it writes (`as_written`,
    called by `roundio.RoundIO`) and which inner step it just took (`after_step`, called by
    `DiLoCo.step`). Off unless the variables above are set."""

    def __init__(self, rank: int = 0, lane: int = 0, log: logging.Logger | None = None):
        self.phase = PhaseMarker(rank, lane)
        self._corrupt, self._lengthen = CorruptionInjector(), WrongLengthInjector()
        self.after_step = NonFiniteInjector(rank, log)

    def as_written(self, data, kind: str, r: int, owner: int, src: int | None = None):
        """`data` as the store is to hold it: damaged if it is a target, else untouched (no copy)."""
        if not (self._corrupt.targets or self._lengthen.targets):
            return data
        blob = data if isinstance(data, bytes) else joined(data)
        damaged = self._lengthen(self._corrupt(blob, kind, r, owner, src), kind, r, owner, src)
        return data if damaged is blob else damaged
