"""Per-round metrics, read back from the run's store for `diloco run` and `diloco status`.

Each replica writes one JSON object per round it took part in, at
``<run_id>/metrics/r<round:08d>/rank-<r>.json`` (loss, tokens, bytes up/down, seconds in
compute and in sync, members). This module only reads and aggregates them, so the view is the
same whichever backend ran the replicas.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any


def metrics_key(run_id: str, round_: int, rank: int) -> str:
    return f"{run_id}/metrics/r{round_:08d}/rank-{rank}.json"


def aggregate(round_: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One round's line: mean loss over members, summed tokens, throughput, sync share."""
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    compute = max((r.get("compute_s", 0.0) for r in rows), default=0.0)
    sync = max((r.get("sync_s", 0.0) for r in rows), default=0.0)
    tokens = sum(r.get("tokens", 0) for r in rows)
    members = sorted({m for r in rows for m in r.get("members", [])})
    return {
        "round": round_,
        "members": members,
        "reported": sorted(r["rank"] for r in rows),
        "loss": sum(losses) / len(losses) if losses else None,
        "tokens": tokens,
        "tokens_per_s": tokens / (compute + sync) if compute + sync > 0 else None,
        "sync_share": sync / (compute + sync) if compute + sync > 0 else None,
        "bytes_up": sum(r.get("bytes_up", 0) for r in rows),
        "bytes_down": sum(r.get("bytes_down", 0) for r in rows),
    }


def read_rounds(rendezvous: str | None, run_id: str, *, after: int = -1, complete_only: bool = True,
                store: Any = None) -> list[dict[str, Any]]:
    """Aggregated rounds after round `after`, in order. Missing store → no rounds.

    Pass an already opened `store` when calling repeatedly (one client, reused connections).
    """
    if not rendezvous and store is None:
        return []
    from .store import open_store

    try:
        store = store if store is not None else open_store(rendezvous)
        offset = f"{run_id}/metrics/r{after:08d}/~" if after >= 0 else None
        by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for meta in store.list(f"{run_id}/metrics/", offset=offset):
            parts = meta["path"].split("/")
            if len(parts) != 4 or not parts[2].startswith("r"):
                continue
            raw = store.get(meta["path"])
            if raw is None:
                continue
            try:
                by_round[int(parts[2][1:])].append(json.loads(bytes(raw)))
            except (ValueError, json.JSONDecodeError):
                continue
    except Exception:  # the store may not exist yet, or be unreachable from this shell
        return []
    out = []
    rounds = [r for r in sorted(by_round) if r > after]
    for i, rnd in enumerate(rounds):
        agg = aggregate(rnd, by_round[rnd])
        # the newest round may still be reporting; an older one missing a member never will
        if complete_only and i == len(rounds) - 1 and not set(agg["members"]) <= set(agg["reported"]):
            break
        out.append(agg)
    return out
