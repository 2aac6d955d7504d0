"""How far a run is and where its time goes: the live progress line, the per-round timeline.

Everything here is computed from what any shell can read: the run's event log (the launcher
turns each round summary into a ``round`` event carrying the global step, the total, the
straggler and the wait it cost) and the round summaries (`diloco.store.metrics`), whose rows carry
each replica's seconds per phase.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..spec.groups import rank_groups
from ..store.metrics import PHASES, RoundSummary
from ..runrecord.state import FINAL_STATES

ETA_WINDOW = 10  # rounds the step rate (and so the ETA) is measured over


@dataclass
class Progress:
    """A run's progress as `diloco run`, `diloco status --follow` and `status --json` show it."""

    state: str
    round: int = 0
    step: int = 0
    total_steps: int | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None
    eta_s: float | None = None
    members: int = 0
    replicas: int = 0
    restarts: int = 0
    preemptions: int = 0
    elapsed_s: float = 0.0
    straggler: int | None = None        # the last round's
    waited_s: float = 0.0               # replica-seconds spent waiting for it
    groups: dict[str, list[int]] | None = None  # a run across backends: group → [members, replicas]
    straggler_group: str | None = None
    store_unreachable_s: float | None = None  # how long the store has not answered the launcher, while it does not

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def progress_of(data: dict[str, Any], events: list[dict[str, Any]], now: float) -> Progress:
    """Progress from a run record's data and its events (oldest first)."""
    launches = [e for e in events if e.get("event") == "launch"]
    start = launches[0]["t"] if launches else data.get("created_at", now)
    ended = data.get("state") in FINAL_STATES
    last_t = events[-1]["t"] if ended and events else now
    # the replicas the run should have: the launch's, or its target since `diloco scale`
    replicas = data.get("target_replicas") or (data.get("launch") or {}).get("n_replicas") or 0
    p = Progress(state=str(data.get("state", "?")), replicas=int(replicas),
                 restarts=int(data.get("restarts_used", 0)), preemptions=int(data.get("preemptions_used", 0)),
                 elapsed_s=max(0.0, last_t - start))
    away = (data.get("health") or {}).get("store_unreachable")
    if isinstance(away, dict) and isinstance(away.get("since"), (int, float)) and not ended:
        p.store_unreachable_s = max(0.0, now - away["since"])
    names = rank_groups(data.get("spec"))
    if names:
        names.update({int(r): str(g) for r, g in (data.get("scaled_ranks") or {}).items()})
        retired = {r.get("rank") for r in data.get("ranks") or [] if isinstance(r, dict) and r.get("retired")}
        p.groups = {}
        for rank, name in names.items():
            p.groups.setdefault(name, [0, 0])[1] += rank not in retired
    rounds = [e for e in events if e.get("event") == "round"]
    if not rounds:
        return p
    last = rounds[-1]
    p.round, p.step, p.total_steps = last["round"], int(last.get("step") or 0), last.get("total_steps")
    p.tokens_per_s, p.members = last.get("tokens_per_s"), len(last.get("members") or [])
    p.straggler, p.waited_s = last.get("straggler"), float(last.get("waited_s") or 0.0)
    if p.groups is not None:
        for m in last.get("members") or []:
            if isinstance(m, int) and m in names:
                p.groups[names[m]][0] += 1
        p.straggler_group = names.get(p.straggler) if isinstance(p.straggler, int) else None
    window = rounds[-ETA_WINDOW - 1:]
    first_step, first_t = (int(window[0].get("step") or 0), window[0]["t"]) if len(window) > 1 else (0, start)
    if p.step > first_step and last["t"] > first_t:
        p.steps_per_s = (p.step - first_step) / (last["t"] - first_t)
        if p.total_steps and not ended:
            p.eta_s = max(0.0, (p.total_steps - p.step) / p.steps_per_s - (now - last["t"]))
    return p


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_line(p: Progress) -> str:
    """One line: what the live display shows beside its bar, and what a log gets."""
    store = f"  STORE UNREACHABLE for {clock(p.store_unreachable_s)}" if p.store_unreachable_s is not None else ""
    if not p.round:
        return f"{p.state.lower()}  waiting for round 1  elapsed {clock(p.elapsed_s)}  restarts {p.restarts}{store}"
    total = f"/{p.total_steps:,}" if p.total_steps else ""
    parts = [f"step {p.step:,}{total}", f"round {p.round}"]
    if p.tokens_per_s:
        parts.append(f"{p.tokens_per_s:,.0f} tok/s")
    if p.state in FINAL_STATES:
        parts.append(p.state.lower())
    else:
        parts.append(f"ETA {clock(p.eta_s)}" if p.total_steps else "ETA ? (no total_steps)")
    by_group = f" ({', '.join(f'{g} {m}/{n}' for g, (m, n) in p.groups.items())})" if p.groups else ""
    parts += [f"members {p.members}/{p.replicas}{by_group}", f"restarts {p.restarts}", f"elapsed {clock(p.elapsed_s)}"]
    if p.straggler is not None and p.waited_s > 0:
        where = f" in {p.straggler_group}" if p.straggler_group else ""
        parts.append(f"straggler {p.straggler}{where} (+{p.waited_s:.1f} replica-s)")
    return "  ".join(parts) + store


def render_progress(p: Progress) -> Table:
    """The live display: a bar over global steps with step / total and ETA, and a second line with
    the rest of the progress line, each short enough for an 80-column terminal."""
    total = p.total_steps or None
    bar = ProgressBar(total=float(total) if total else None, completed=float(p.step), width=30)
    head, *rest = progress_line(p).split("  round ", 1)
    if p.round and p.total_steps:
        head = f"{100 * p.step / p.total_steps:.0f}%  {head}"
    eta = next((x for x in progress_line(p).split("  ") if x.startswith("ETA")), "")
    grid = Table.grid(padding=(0, 1))
    grid.add_row(bar, Text(f"{head}  {eta}".rstrip() if rest else head, style="bold"))
    if rest:
        tail = "  ".join(x for x in ("round " + rest[0]).split("  ") if not x.startswith("ETA"))
        grid.add_row("", Text(tail))
    return grid


# -- the timeline ----------------------------------------------------------------------------

def timeline_rows(rounds: list[RoundSummary], groups: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """One row per replica per round: seconds per phase, hidden exchange time, straggler flag;
    `groups` (rank → group name, `diloco.spec.groups.rank_groups`) adds each row's group."""
    out = []
    for s in rounds:
        for row in s.rows:
            out.append({"round": s.round, "rank": row.rank, "attempt": row.attempt,
                        **({"group": groups.get(row.rank)} if groups else {}),
                        "member": row.member, **{p: row.phases.get(p) for p in PHASES},
                        "hidden": row.hidden_s, "straggler": s.straggler == row.rank,
                        "waited_for_straggler_s": s.waited_s if s.straggler == row.rank else 0.0})
    return out


def timeline_table(rounds: list[RoundSummary], groups: dict[int, str] | None = None) -> Table:
    table = Table(title="timeline: seconds per phase, per replica and round", title_justify="left")
    for col in ("round", "rank", *(("group",) if groups else ()), *PHASES, "hidden", ""):
        table.add_column(col, justify="right" if col not in ("", "group") else "left")
    for s in rounds:
        for i, row in enumerate(sorted(s.rows, key=lambda r: r.rank)):
            phases = row.phases
            note = ""
            if s.straggler == row.rank:
                note = f"straggler: others waited {s.waited_s:.2f} replica-s"
            elif not row.member:
                note = "not a member (adopted the result)"
            table.add_row(str(s.round) if i == 0 else "", str(row.rank),
                          *((Text(groups.get(row.rank, "?")),) if groups else ()),
                          *[f"{phases[p]:.2f}" if p in phases else "-" for p in PHASES],
                          f"{row.hidden_s:.2f}", note)
        table.add_section()
    return table


def straggler_lines(rounds: list[RoundSummary], groups: dict[int, str] | None = None) -> list[str]:
    """Who held the rounds up, overall: replica-seconds everyone waited, by straggler (and its group)."""
    cost: dict[int, float] = {}
    count: dict[int, int] = {}
    for s in rounds:
        if s.straggler is not None:
            cost[s.straggler] = cost.get(s.straggler, 0.0) + s.waited_s
            count[s.straggler] = count.get(s.straggler, 0) + 1
    return [f"rank {rank}{f' ({groups[rank]})' if groups and rank in groups else ''}: straggler in {count[rank]} of {len(rounds)} rounds, others waited {cost[rank]:.1f} "
            f"replica-s for it" for rank in sorted(cost, key=lambda k: -cost[k])]
