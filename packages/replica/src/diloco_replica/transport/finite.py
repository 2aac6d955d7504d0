"""Finiteness: no NaN or Inf joins a mean, is published, or becomes θ_global.

A replica whose training diverged uploads well-formed objects with valid checksums whose values
are NaN or Inf. Averaged in, one such contribution makes θ_global NaN on every replica at once,
and the run goes on "succeeding" with `loss nan`. So every contribution is checked before it
joins a mean (`accumulate`), every mean before it is published, and θ_global after every outer
step (`outer.outer_step`); a round in which no finite contribution is left, or whose mean or
outer step would be non-finite, stops the run with one line (`NonFinite`, a `UserError`: every
replica would meet it again after a relaunch).

The check runs over every byte of every round, so it is a sum: NaN and ±Inf propagate through a
sum, so a finite sum proves every element finite, in one vectorised pass with no allocation
(`torch.isfinite(x).all()` allocates a mask and is ~30× slower). Only a non-finite sum of
finite elements (the sum itself overflowed) needs the elementwise test. A reduction checks its
running total once — Σ finite ⇔ every contribution finite — and looks for the culprit only
when something is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.errors import UserError

from .wire import CorruptObject

NONFINITE = "non-finite values (NaN or Inf)"


class NonFinite(UserError):
    """No finite global state can be made: every contribution of a round was non-finite, or its
    mean or outer step overflowed. Relaunching would meet it again, so the run stops (exit 78)."""


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of a float tensor is finite (one summing pass in the common case)."""
    if x.numel() == 0 or math.isfinite(float(x.sum())):
        return True
    return bool(torch.isfinite(x).all())  # NaN/Inf, or only the sum overflowed


@dataclass
class Contribution:
    """One member's part of a shard: who sent it, the object it came in, and how to read its values
    (fp32, decoded; reading may raise `CorruptObject` — a payload that fits no encoder)."""

    rank: int
    key: str
    read: Callable[[], torch.Tensor]
    scale: float = 1.0  # its weight in the sum (time-based rounds: 1 / its inner steps)


@dataclass
class Sum:
    total: torch.Tensor
    used: list[int] = field(default_factory=list)               # ranks in the total, in order
    corrupt: dict[int, str] = field(default_factory=dict)       # rank -> why its object was unreadable
    nonfinite: list[int] = field(default_factory=list)          # ranks whose values were NaN or Inf
    finite: bool = True                                         # whether the total is finite


def accumulate(parts: list[Contribution], numel: int, device: torch.device | None = None) -> Sum:
    """Σ of the readable, finite contributions, in the order given, on `device` (default: the
    host); who is in it and who is not.

    The fast path reads each contribution once and checks the total once. If the total is not
    finite, each contribution is checked on its own and the total is summed again without the
    non-finite ones (the same order, so the same rounding as if they had never been there).
    """
    out = Sum(torch.empty(numel, dtype=torch.float32, device=device))
    readable = []
    for part in parts:
        try:
            values = part.read()
        except CorruptObject as exc:
            out.corrupt[part.rank] = str(exc)
            continue
        _add(out.total, values, part.scale, first=not readable)
        readable.append(part)
    out.used = [p.rank for p in readable]
    if not readable:
        out.total.zero_()
    if all_finite(out.total):
        return out
    out.finite = False
    out.used = []
    for part in readable:
        values = part.read()
        if all_finite(values):
            _add(out.total, values, part.scale, first=not out.used)
            out.used.append(part.rank)
        else:
            out.nonfinite.append(part.rank)
    if not out.used:
        out.total.zero_()
    out.finite = all_finite(out.total)  # False: no culprit, the sum overflowed; the caller refuses to publish it
    return out


def _add(total: torch.Tensor, values: torch.Tensor, scale: float, *, first: bool) -> None:
    """total ← values·scale (the first term) or total + values·scale, on the total's device. The
    first term is copied, not added to zeros: the same sum (0 + x = x; only a zero's sign may
    differ) with one pass over fresh memory fewer — zeroing a shard-sized buffer costs as much as
    the fold itself. A scaled term is a multiply, then an add, each rounded on its own (`add(...,
    alpha=)` may fuse them, differently on a CPU and a GPU)."""
    values = values.to(total.device)
    if first:
        if scale == 1.0:
            total.copy_(values)
        else:
            torch.mul(values, scale, out=total)
    elif scale == 1.0:
        total += values
    else:
        total += values * scale
