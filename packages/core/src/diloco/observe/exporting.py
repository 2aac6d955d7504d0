"""`diloco export`: the launcher's side of taking a run's global model out of its store.

The store's checkpoints are in the replicas' own format, which only diloco-replica reads (it
needs torch, which core never imports): this finds the run's store — from the run's record, or
the `store` URI given, for a shell that never launched the run — and runs
``python -m diloco_replica.export`` in this Python, which writes ``<out>/model.safetensors``
(and, where the run's trainer integration stored the model's configuration, ``config.json``)
(`diloco_replica.export`). The store's credentials are this shell's, as for `diloco status`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..runrecord.state import RunRecord, check_run_id


def export_model(run_id: str, out: str | Path, *, round_: int | None = None, store: str | None = None) -> dict[str, Any]:
    """Write the run's global model (checkpoint `round_`, default the newest) to
    ``<out>/model.safetensors``; returns what was written (`diloco_replica.export.Exported`)."""
    if store is None:
        record = RunRecord.load(run_id)
        run_id, store = record.run_id, record.rendezvous
        if not store:
            raise UserError(f"run {run_id!r} has no rendezvous store recorded; name it with --store URI")
    else:
        check_run_id(run_id)
    if find_spec("diloco_replica") is None:
        raise UserError("diloco export reads the replicas' checkpoint format with diloco-replica, which is not "
                        "installed here: pip install diloco-replica")
    cmd = [sys.executable, "-m", "diloco_replica.export"]
    if round_ is not None:
        cmd += ["--round", str(round_)]
    proc = subprocess.run([*cmd, "--", store, run_id, str(out)], capture_output=True, text=True)
    if proc.returncode < 0:  # killed: most often the out-of-memory killer (it holds θ and the momentum)
        raise UserError(f"export was killed by signal {-proc.returncode} (out of memory? it needs about 3x the "
                        f"model's fp32 size in host memory)")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UserError(errors[-1][len("error: "):] if errors else
                        f"export failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
