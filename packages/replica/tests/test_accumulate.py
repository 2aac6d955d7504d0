"""A shard's sum (`finite.accumulate`): the members' contributions in order, what is left out and why.

The first usable contribution is copied into the total rather than added to zeros; the sum is
the same one (compared with `torch.equal`, which counts −0.0 and 0.0 equal: only a zero's sign
may differ).
"""

from __future__ import annotations

import pytest
import torch

from diloco_replica.transport.finite import Contribution, accumulate
from diloco_replica.transport.wire import CorruptObject

NUMEL = 4_099
A, B, C = (torch.randn(NUMEL, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
NAN = A.clone().index_fill_(0, torch.tensor([7]), float("nan"))


def corrupt():
    raise CorruptObject("scatter/0/1: checksum mismatch")


def reference(terms):
    total = torch.zeros(NUMEL)
    for values, scale in terms:
        total.add_(values, alpha=scale)
    return total


CASES = {
    # name: ([(rank, values or None for corrupt, scale)], used, corrupt ranks, nonfinite ranks, reference terms)
    "plain sum": ([(0, A, 1.0), (1, B, 1.0), (2, C, 1.0)], [0, 1, 2], [], [], [(A, 1.0), (B, 1.0), (C, 1.0)]),
    "weighted, time-based": ([(0, A, 1 / 3), (1, B, 0.25)], [0, 1], [], [], [(A, 1 / 3), (B, 0.25)]),
    "first corrupt": ([(0, None, 1.0), (1, B, 1.0), (2, C, 1.0)], [1, 2], [0], [], [(B, 1.0), (C, 1.0)]),
    "first non-finite": ([(0, NAN, 1.0), (1, B, 1.0), (2, C, 1.0)], [1, 2], [], [0], [(B, 1.0), (C, 1.0)]),
    "middle non-finite": ([(0, A, 0.5), (1, NAN, 1.0), (2, C, 0.5)], [0, 2], [], [1], [(A, 0.5), (C, 0.5)]),
    "all corrupt": ([(0, None, 1.0), (1, None, 1.0)], [], [0, 1], [], []),
}


@pytest.mark.parametrize("name", CASES)
def test_accumulate(name):
    parts, used, bad, nonfinite, terms = CASES[name]
    summed = accumulate([Contribution(rank, f"k{rank}", corrupt if values is None else (lambda v=values: v), scale)
                         for rank, values, scale in parts], NUMEL)
    assert (summed.used, sorted(summed.corrupt), summed.nonfinite) == (used, bad, nonfinite)
    assert torch.equal(summed.total, reference(terms))
    assert summed.finite
