"""The end-of-run pictures: the loss curve (with eval points) and the per-round timeline.

matplotlib is optional (the `plot` extra); without it the report has no PNGs and says nothing.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

from diloco.store.metrics import PHASES, RoundSummary

COLORS = {"compute": "#4c72b0", "upload": "#dd8452", "wait": "#c44e52", "reduce": "#8172b3",
          "download": "#55a868", "outer": "#937860"}
MAX_GANTT_ROUNDS = 12  # the Gantt shows the last rounds; the bars below show every round


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _png(fig: Any, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_png(rounds: list[RoundSummary], eval_loss: float | None, final_step: int | None = None) -> bytes | None:
    """Train loss per round (mean over replicas) against the global step, eval points if reported."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    pts = [(r.step or r.round, r.loss) for r in rounds if r.loss is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label="train loss (mean over replicas)")
    evals = [e for r in rounds for e in r.evals]
    if eval_loss is not None and final_step:
        evals.append([final_step, eval_loss])
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "s--", color="tab:red", ms=4, label="eval loss")
    ax.set_xlabel("global inner step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig, plt)


def clock_offsets(rounds: list[RoundSummary]) -> dict[int, float]:
    """Each replica's wall clock against the others', from the rounds they share: the median over
    rounds of its row's `t` less the median `t` of the round's rows. The members of a round
    apply it within moments of each other (they read the same result), so seconds between
    their `t` are their clocks' disagreement, not their work's; a replica whose clock jumped
    is lined up by where it stood for most of the rounds given (tests/test_skewed_clocks.py)."""
    gaps: dict[int, list[float]] = {}
    for s in rounds:
        ts = [row.t for row in s.rows if row.t]
        if len(ts) < 2:
            continue
        middle = statistics.median(ts)
        for row in s.rows:
            if row.t:
                gaps.setdefault(row.rank, []).append(row.t - middle)
    return {rank: statistics.median(g) for rank, g in gaps.items()}


def timeline_png(rounds: list[RoundSummary]) -> bytes | None:
    """Top: each replica's last rounds on a wall-clock axis, one colour per phase. Bottom: every
    round's mean seconds per phase over its members, and what waiting for its straggler cost."""
    plt = _pyplot()
    members = [r for r in rounds if any(row.phases for row in r.rows)]
    if plt is None or not members:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=100, gridspec_kw={"height_ratios": [3, 2]})
    shown = members[-MAX_GANTT_ROUNDS:]
    skew = clock_offsets(shown)  # hosts' clocks disagree: line them up on the rounds they share
    t0 = min(row.t - skew.get(row.rank, 0.0) - sum(row.phases.values()) for s in shown for row in s.rows)
    ranks = sorted({row.rank for s in shown for row in s.rows})
    for s in shown:
        for row in s.rows:
            phases = row.phases
            end = row.t - skew.get(row.rank, 0.0) - t0
            start = end - sum(phases.get(p, 0.0) for p in PHASES)
            for p in PHASES:  # laid out back to back, ending when the replica applied the round
                width = phases.get(p, 0.0)
                top.barh(row.rank, width, left=start, color=COLORS[p], height=0.6,
                         edgecolor="black" if s.straggler == row.rank else "none", linewidth=0.6)
                start += width
    top.set_yticks(ranks, [f"rank {r}" for r in ranks])
    top.invert_yaxis()
    top.set_xlabel("seconds (the replicas' clocks lined up on the rounds they share; black outline: the straggler)")
    top.set_title(f"rounds {shown[0].round}-{shown[-1].round}: where each replica's time went")
    xs = [s.round for s in members]
    base = [0.0] * len(members)
    for p in PHASES:
        vals = []
        for s in members:
            rows = [row for row in s.rows if row.member and row.phases]
            vals.append(sum(row.phases.get(p, 0.0) for row in rows) / max(1, len(rows)))
        bottom.bar(xs, vals, bottom=base, color=COLORS[p], label=p)
        base = [b + v for b, v in zip(base, vals)]
    bottom.plot(xs, [s.waited_s for s in members], "k.-", ms=3, lw=0.8, label="waited for straggler (replica-s)")
    bottom.set_xlabel("round")
    bottom.set_ylabel("seconds (mean over members)")
    bottom.legend(ncol=4, fontsize=7)
    bottom.grid(alpha=0.3, axis="y")
    return _png(fig, plt)
