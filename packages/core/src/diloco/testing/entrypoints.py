"""Tiny entrypoints the conformance kit runs on a backend. Importable wherever diloco-core is."""

from __future__ import annotations

import os
import time

from diloco.bootstrap.context import ReplicaContext


def report(ctx: ReplicaContext, marker: str = "") -> dict:
    """Print who we are, return it: proves rank, world size and run id reached the replica."""
    print(f"replica rank={ctx.rank} world={ctx.world_size} run={ctx.run_id} attempt={ctx.attempt} {marker}",
          flush=True)
    return {"rank": ctx.rank, "world_size": ctx.world_size, "run_id": ctx.run_id, "attempt": ctx.attempt,
            "env_rank": os.environ.get("REPLICA_RANK")}


def fail_on(ctx: ReplicaContext, fail_rank: int = 0) -> dict:
    """Rank `fail_rank` raises; the others succeed."""
    if ctx.rank == fail_rank:
        raise RuntimeError(f"deliberate failure on rank {ctx.rank}")
    return {"rank": ctx.rank}


def sleep(ctx: ReplicaContext, seconds: float = 60.0) -> None:
    print(f"rank {ctx.rank} sleeping {seconds}s (attempt {ctx.attempt} rerun {ctx.rerun})", flush=True)
    time.sleep(seconds)


def noop() -> None:
    """Does nothing: what launch benchmarks time."""
