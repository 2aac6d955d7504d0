"""The end-of-run report: summary numbers, the loss curve and the timeline, written to the store's
artifacts/.

`diloco run` copies ``<run>/artifacts/`` next to the run's records and prints summary.txt, so
the report looks the same whichever backend ran the replicas.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dataclasses import asdict

from diloco.bootstrap.context import ReplicaContext
from diloco.store.metrics import RoundReader, RoundSummary
from diloco.store.runkeys import RunKeys

from .plots import loss_png, timeline_png


def data_parallel_bytes(n_params: int, world: int, steps: int) -> int:
    """Bytes a per-step ring all-reduce of fp32 gradients moves (sent + received, all replicas)."""
    return int(steps * 4 * (world - 1) * n_params * 4)


def summarize(rounds: list[RoundSummary], *, eval_loss: float | None, steps: int, n_params: int,
              world: int, settings: dict[str, Any]) -> dict[str, Any]:
    moved = sum(r.bytes_up + r.bytes_down for r in rounds)
    dp = data_parallel_bytes(n_params, world, steps)
    shares = [r.sync_share for r in rounds if r.sync_share is not None]
    return {
        "eval_loss": eval_loss,
        "final_train_loss": rounds[-1].loss if rounds else None,
        "rounds": len(rounds),
        "replicas": world,
        "inner_steps_per_replica": steps,
        "parameters": n_params,
        "transport": settings.get("transport"),
        "sync_every": settings.get("sync_every"),
        "fragments": settings.get("fragments"),
        "overlap": settings.get("overlap"),
        "bytes_communicated": moved,
        "data_parallel_bytes": dp,
        "communication_reduction": dp / moved if moved else None,
        "sync_share": sum(shares) / len(shares) if shares else None,
        "tokens": sum(r.tokens for r in rounds),
    }


def format_summary(s: dict[str, Any]) -> str:
    def mb(x: int) -> str:
        return f"{x / 1e6:,.1f} MB"

    lines = [
        f"eval loss            {s['eval_loss']:.4f}" if s["eval_loss"] is not None else "eval loss            n/a",
        f"rounds               {s['rounds']} (H={s['sync_every']}, {s['replicas']} replicas, "
        f"{s['inner_steps_per_replica']} inner steps each, {s['parameters']:,} parameters)",
        f"communicated         {mb(s['bytes_communicated'])} ({s['transport']}) vs {mb(s['data_parallel_bytes'])} "
        f"for per-step data-parallel: {s['communication_reduction']:.0f}x less"
        if s["communication_reduction"] else "communicated         n/a",
        f"sync share of wall   {100 * s['sync_share']:.1f}%" if s["sync_share"] is not None else "sync share   n/a",
    ]
    return "\n".join(lines) + "\n"


def write_run_report(ctx: ReplicaContext, diloco: Any, *, eval_loss: float | None, steps: int, n_params: int,
                     wait_s: float = 15.0) -> dict[str, Any]:
    """Gather every replica's round metrics (waiting briefly for the last round), write the report."""
    deadline = time.monotonic() + wait_s
    reader = RoundReader(diloco.store, ctx.run_id)
    rounds = reader.read_new()
    while (not rounds or rounds[-1].round < diloco.round) and time.monotonic() < deadline:
        time.sleep(0.2)
        rounds += reader.read_new()
    if not rounds or rounds[-1].round < diloco.round:
        rounds += reader.read_new(final=True)
    summary = summarize(rounds, eval_loss=eval_loss, steps=steps, n_params=n_params, world=ctx.world_size,
                        settings=diloco.settings.to_dict())
    store = diloco.store
    store.put(RunKeys(ctx.run_id).artifact("summary.json"), json.dumps({**summary, "rounds_detail": [asdict(r) for r in rounds]}, indent=2).encode())
    store.put(RunKeys(ctx.run_id).artifact("summary.txt"), format_summary(summary).encode())
    for name, png in (("loss.png", loss_png(rounds, eval_loss, steps)), ("timeline.png", timeline_png(rounds))):
        if png:
            store.put(RunKeys(ctx.run_id).artifact(name), png)
    return summary
