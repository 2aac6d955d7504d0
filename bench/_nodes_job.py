"""The replica `bench/nodes.py` runs: `_recovery_job`'s model of a given size with cheap inner
steps, in every process of a replica of K nodes, each process writing what it held (its peak
host memory, the global model's digest) where the bench reads it: a replica's own result is
its process 0's alone."""

from __future__ import annotations

import json
from pathlib import Path

from _recovery_job import train as train_blob

from diloco.bootstrap.context import ReplicaContext


def train(ctx: ReplicaContext, out_dir: str, megabytes: float = 100.0, steps: int = 40, step_s: float = 0.0) -> dict:
    result = train_blob(ctx, megabytes=megabytes, steps=steps, step_s=step_s)
    result.update(lane=ctx.lane, lanes=ctx.lanes, attempt=ctx.attempt)
    Path(out_dir, f"rank{ctx.rank}-lane{ctx.lane}-attempt{ctx.attempt}.json").write_text(json.dumps(result))
    return result
