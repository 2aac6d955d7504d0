"""Tiny LM: DiLoCo (N=4, H=50) against data-parallel training at equal tokens, same script.

- DiLoCo runs go through the real launcher (`diloco run` on the local backend) with transport
  fp32, fp16 and int8; their summary.json artifacts give eval loss and sync share.
- The data-parallel baseline is synchronous DP with averaged gradients, computed exactly in one
  process as one optimizer over the 4 replicas' batches (4 × batch_size per step), same model,
  same inner optimizer and schedule, same number of steps — so the same tokens.
Prints JSON. Targets: DiLoCo eval loss within 2% of DP; sync share ≤ 5%; fp16/int8 change the
final eval loss by < 0.5% relative to fp32.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-lm"
sys.path.insert(0, str(EXAMPLE))

from _common import knob, run_spec, tiny_lm_spec, toml_text  # noqa: E402 - bench/ is the script's directory

STEPS = int(knob("BENCH_STEPS", "1500", "60"))
TRANSPORTS = knob("BENCH_TRANSPORTS", "fp32,fp16,int8", "fp32").split(",")


def diloco_run(transport: str, state: Path) -> dict:
    path = state / f"bench-{transport}.toml"
    path.write_text(toml_text(tiny_lm_spec(diloco={"total_steps": STEPS, "transport": transport})))
    try:
        run_dir, wall = run_spec(path, state, transport)
    finally:
        path.unlink()
    summary = json.loads((run_dir / "artifacts" / "summary.json").read_text())
    summary.pop("rounds_detail", None)
    return {"transport": transport, "wall_s": round(wall, 1), **summary}


def data_parallel(world: int) -> dict:
    import torch

    import tiny_lm

    spec = tiny_lm_spec()["args"]  # the model DiLoCo's replicas train (train()'s defaults where unset)
    bs, context, lr = spec["batch_size"], spec["context"], spec["lr"]
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    train, evals = tiny_lm.load_corpus(spec.get("max_bytes", 3_000_000))
    model = tiny_lm.build(0, context, spec.get("dim", 128), spec.get("layers", 2))
    from diloco_replica import inner_optimizer

    opt = inner_optimizer(model.parameters(), lr=lr)
    t0 = time.monotonic()
    for step in range(STEPS):
        xs, ys = [], []
        for rank in range(world):  # the same per-replica data streams DiLoCo's replicas draw
            gen = torch.Generator().manual_seed(hash((0, rank, step)) & 0x7FFF_FFFF)
            x, y = tiny_lm.batch(train, bs, context, gen)
            xs.append(x)
            ys.append(y)
        for group in opt.param_groups:
            group["lr"] = tiny_lm.lr_at(step, STEPS, lr, 50)
        loss = tiny_lm.loss_of(model, torch.cat(xs), torch.cat(ys))  # mean over all = averaged gradients
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"eval_loss": tiny_lm.evaluate(model, evals, context), "wall_s": round(time.monotonic() - t0, 1),
            "tokens": STEPS * world * bs * context}


def main() -> None:
    with tempfile.TemporaryDirectory() as state:
        runs = [diloco_run(t, Path(state)) for t in TRANSPORTS]
    dp = data_parallel(tiny_lm_spec()["replicas"])  # as many workers as DiLoCo's replicas
    base = next((r for r in runs if r["transport"] == "fp32"), runs[0])
    out = {
        "bench": "tiny_lm", "steps_per_replica": STEPS, "replicas": tiny_lm_spec()["replicas"], "sync_every": base.get("sync_every"),
        "data_parallel": dp, "diloco": runs,
        "diloco_vs_dp_eval_loss": round(base["eval_loss"] / dp["eval_loss"] - 1, 4),
        "transport_vs_fp32_eval_loss": {r["transport"]: round(r["eval_loss"] / base["eval_loss"] - 1, 4) for r in runs},
        "targets": {"diloco_vs_dp_eval_loss": "<= +0.02", "sync_share": "<= 0.05",
                    "transport_vs_fp32_eval_loss": "abs < 0.005"},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
