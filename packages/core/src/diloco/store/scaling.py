"""Resizing a run while it trains: `diloco scale RUN N [--group NAME]` and `Run.scale`.

A request is a file in the run's record directory (`scale/<time>-<random>.json`), so it works
from any shell, with the launcher running or not: the supervising launcher applies the requests
it has not applied yet at its next check, and `diloco resume` applies one made while no launcher
ran. Applying one (`Supervisor`):

- **growing** adds ranks numbered after every rank the run ever had (ids are never reused, so
  no history is mixed up), launches them on the group's backend, and writes the run's new
  target into the store (`roster_body`); each new replica loads the global state, says so, and
  joins at the next round decided after that (diloco_replica's `roster`), so no round waits for
  a replica that is still starting;
- **shrinking** retires the group's highest ranks: the target drops them, each takes part in the
  round it is in, leaves after it and exits 0, and the supervisor does not relaunch it (one not
  running yet is cancelled).

`plan_resize` decides which ranks come and go: pure, table-tested, like `diloco.supervise.policy.decide`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..host.statedir import private_dir, write_json_atomic

MAX_RANK = 1 << 20  # rank ids are never reused in a run, so they may pass its size; this bounds them
ROSTER_KIND = "diloco-roster"


@dataclass(frozen=True)
class ScaleRequest:
    """A request to give `group` (None: the run's one group) `replicas` replicas."""

    name: str
    replicas: int
    group: str | None
    at: float


def plan_resize(active: Mapping[str, list[int]], next_rank: int, group: str, replicas: int) -> tuple[list[int], list[int]]:
    """(ranks to add, ranks to retire) for `group` to run `replicas` replicas: new ids from
    `next_rank` on, or the group's highest active ranks."""
    have = sorted(active.get(group, []))
    if replicas >= len(have):
        return list(range(next_rank, next_rank + replicas - len(have))), []
    return [], have[replicas:]


def ranks_ok(ranks: Any) -> bool:
    """Whether `ranks` (read from a store) is a roster: distinct rank ids, ascending, at least one."""
    return isinstance(ranks, list) and bool(ranks) and all(type(r) is int and 0 <= r < MAX_RANK for r in ranks) \
        and ranks == sorted(set(ranks))


def roster_body(run_id: str, seq: int, ranks: list[int]) -> bytes:
    """The run's target in the store (`<run>/roster/scale-<seq>.json`): every rank it should have."""
    return json.dumps({"kind": ROSTER_KIND, "run": run_id, "seq": seq, "ranks": sorted(ranks)}).encode()


def parse_roster(run_id: str, seq: int, body: bytes | memoryview) -> list[int]:
    """A target read back from the store, checked; ValueError naming what is wrong."""
    try:
        data = json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != ROSTER_KIND or data.get("run") != run_id:
        raise ValueError("not a roster target of this run")
    ranks = data.get("ranks")
    if data.get("seq") != seq or not ranks_ok(ranks):
        raise ValueError(f"malformed: its seq must be {seq} and its ranks distinct, ascending ids below {MAX_RANK}")
    return ranks


def request_scale(record: Any, replicas: Any, group: str | None) -> ScaleRequest:
    """Check and record a request to resize `record`'s run (a `diloco.runrecord.state.RunRecord`)."""
    run = record.run_id
    if record.ended:
        raise UserError(f"run {run} has ended ({record.state}); only a running run can be scaled")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= 4096:
        raise UserError(f"replicas must be a whole number from 0 to 4096, got {replicas!r}")
    counts = active_counts(record)
    names = sorted(counts)
    if group is None:
        if len(names) > 1:
            raise UserError(f"run {run} has groups {', '.join(names)}: name the one to scale with --group")
        group = names[0]
    elif group not in counts:
        raise UserError(f"run {run} has no group {group!r}; its groups: {', '.join(names)}")
    total = sum(counts.values()) - counts[group] + replicas
    min_members = int((record.spec.diloco or {}).get("min_members") or 1)
    if total < max(1, min_members):
        raise UserError(f"that leaves the run {total} replicas, below min_members = {min_members}; keep at least "
                        f"{max(1, min_members)}")
    if int(record.data.get("last_round") or 0) < 1:  # round 0's checkpoint says who is in round 1
        raise UserError(f"run {run} has not finished its first round yet; scale it once it trains (`diloco status "
                        f"{run}` shows the rounds)")
    req = ScaleRequest(f"{time.time_ns():020d}-{secrets.token_hex(4)}", replicas,
                       None if not record.rank_groups else group, time.time())
    private_dir(record.dir / "scale")
    write_json_atomic(record.dir / "scale" / f"{req.name}.json",
                      {"replicas": req.replicas, "group": req.group, "at": req.at})
    return req


def pending(record: Any, applied: list[str]) -> list[ScaleRequest]:
    """The requests in `record`'s directory not in `applied`, oldest first (a malformed file is
    skipped: only `request_scale` writes there)."""
    folder = record.dir / "scale"
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.stem in applied:
            continue
        try:
            data = json.loads(path.read_text())
            replicas, group = data["replicas"], data.get("group")
            if type(replicas) is not int or not 0 <= replicas <= 4096 or not (group is None or isinstance(group, str)):
                continue
            out.append(ScaleRequest(path.stem, replicas, group, float(data.get("at") or 0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def active_counts(record: Any) -> dict[str, int]:
    """Replicas each group runs now (retired ranks left out); a run without groups is one, "g0"."""
    ranks = record.ranks
    groups = record.rank_groups
    counts: dict[str, int] = {g.name: 0 for g in record.spec.replica_groups()}
    for st in ranks:
        if not st.retired:
            name = groups.get(st.rank) or "g0"
            counts[name] = counts.get(name, 0) + 1
    if not ranks:  # not launched yet: the spec's sizes
        counts = {g.name: g.replicas for g in record.spec.replica_groups()}
    return counts
