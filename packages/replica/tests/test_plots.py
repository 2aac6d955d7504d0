"""The timeline's wall-clock view does not trust the replicas' clocks to agree (`plots.clock_offsets`)."""

from __future__ import annotations

import pytest

from diloco.store.metrics import RoundMetrics, RoundSummary
from diloco_replica.records.plots import clock_offsets


def rounds_of(skew: dict[int, float], ends: list[float], late: dict[tuple[int, int], float] | None = None,
              jump: tuple[int, int, float] | None = None) -> list[RoundSummary]:
    """Rounds ending at `ends` (true time), each replica's row stamped by its own clock; `late`:
    (round, rank) → seconds it really applied the round after the others; `jump`: (rank, from
    round, new skew)."""
    out = []
    for r, end in enumerate(ends, 1):
        rows = []
        for rank, s in skew.items():
            if jump and rank == jump[0] and r >= jump[1]:
                s = jump[2]
            rows.append(RoundMetrics(round=r, rank=rank, t=end + s + (late or {}).get((r, rank), 0.0)))
        out.append(RoundSummary(round=r, members=sorted(skew), reported=sorted(skew), loss=None, tokens=0,
                                tokens_per_s=None, sync_share=None, bytes_up=0, bytes_down=0, rows=rows))
    return out


@pytest.mark.parametrize("skew", [{0: 0.0, 1: 0.0}, {0: 30.0, 1: -30.0, 2: 0.0}, {0: 1e6, 1: -3.0, 2: 7.5, 3: 0.0}])
def test_clocks_that_disagree_are_lined_up_on_the_rounds_they_share(skew):
    rounds = rounds_of(skew, [100.0 + 5 * k for k in range(8)], late={(3, 1): 2.0})
    offsets = clock_offsets(rounds)
    base = offsets[0] - skew[0]
    assert all(offsets[k] - base == pytest.approx(s, abs=1e-9) for k, s in skew.items())
    aligned = [row.t - offsets[row.rank] for row in rounds[2].rows]  # a real lateness stays visible
    assert max(aligned) - min(aligned) == pytest.approx(2.0)


def test_a_clock_that_jumped_is_lined_up_where_it_stood_for_most_rounds():
    rounds = rounds_of({0: 0.0, 1: 0.0, 2: 0.0}, [100.0 + 5 * k for k in range(8)], jump=(2, 3, 45.0))
    assert clock_offsets(rounds)[2] == pytest.approx(45.0)
    assert clock_offsets(rounds[:1]) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_a_round_with_one_row_says_nothing_about_clocks():
    assert clock_offsets(rounds_of({0: 30.0}, [100.0, 105.0])) == {}
