"""Hiding the sync on a slow store: every sync mode on one tiny LM, N = 4, through the launcher.

Each replica's store sits behind a throttled link (`diloco.store.throttle`: DILOCO_STORE_BYTES_PER_S,
the same for every row), slow enough that synchronous fp32 DiLoCo spends >= 30% of its wall time
in sync. Rows: synchronous fp32, synchronous int8, overlap, overlap + fragments, overlap + int4,
topk. Same model, data, seed and steps for every row, so eval loss is compared at equal tokens.

    .venv/bin/python bench/sync_modes.py        # ~20 min on 2 CPU cores; prints JSON
    BENCH_QUICK=1 .venv/bin/python bench/sync_modes.py   # a smoke run: 40 steps, two rows

BENCH_STEPS, BENCH_RATE (bytes/s per replica and direction), BENCH_ROWS (comma-separated names)
and BENCH_DIM / BENCH_LAYERS scale it. Targets (issue "Hide the sync"): overlap (+ fragments)
sync share <= 3% with eval loss within 1% of synchronous fp32; int4 bytes <= 1/8 of fp32 with
loss within 1%; topk at 1-3% density <= 1/30 of fp32 bytes with loss within 3%.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from _common import knob, run_spec, tiny_lm_spec, toml_text  # noqa: E402 - bench/ is the script's directory

STEPS = int(knob("BENCH_STEPS", "400", "40"))
H = int(knob("BENCH_H", "20", "20"))
RATE = float(knob("BENCH_RATE", "4e6", "4e6"))
DIM = int(knob("BENCH_DIM", "192", "64"))
LAYERS = int(knob("BENCH_LAYERS", "3", "1"))
ROWS = {
    "sync fp32": {},
    "sync int8": {"transport": "int8"},
    "overlap": {"overlap": True},
    "overlap delay 5": {"overlap": True, "overlap_delay": 5},
    "overlap + fragments": {"overlap": True, "fragments": 4},
    "overlap + int4": {"overlap": True, "transport": "int4"},
    "topk": {"transport": "topk", "topk_density": 0.01},
}
PICK = [r for r in knob("BENCH_ROWS", ",".join(ROWS), "sync fp32,overlap delay 5").split(",") if r]


def spec_text(settings: dict) -> str:
    """The main job at this bench's size, H and sync mode, each replica's store throttled."""
    spec = tiny_lm_spec(args={"dim": DIM, "layers": LAYERS},
                        diloco={"total_steps": STEPS, "sync_every": H, "transport": "fp32", **settings},
                        env={"DILOCO_STORE_BYTES_PER_S": f"{RATE:g}", "DILOCO_STORE_LATENCY_S": "0.01"})
    return toml_text(spec)


def run_row(name: str, settings: dict, tmp: Path) -> dict:
    spec, state = tmp / f"{name.replace(' ', '-')}.toml", tmp / "state"
    spec.write_text(spec_text(settings))
    runs, wall = run_spec(spec, state, name)
    summary = json.loads((runs / "artifacts" / "summary.json").read_text())
    record = json.loads((runs / "run.json").read_text())
    results = [r["result"] for r in record["ranks"]]
    train_s = max(r["wall_s"] for r in results)
    assert len({r["theta_digest"] for r in results}) == 1, f"{name}: replicas disagree on θ_global"
    return {
        "row": name, "settings": settings, "eval_loss": round(summary["eval_loss"], 4),
        "tokens_per_s": round(summary["tokens"] / train_s), "sync_share": round(summary["sync_share"], 4),
        "bytes_per_replica_per_round": round(summary["bytes_communicated"] / len(results) / summary["rounds"]),
        "rounds": summary["rounds"], "train_s": round(train_s, 1), "wall_s": round(wall, 1),
        "parameters": summary["parameters"],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_row(name, ROWS[name], Path(tmp)) for name in PICK]
    base = next((r for r in rows if r["row"] == "sync fp32"), rows[0])
    fp32_round_bytes = base["bytes_per_replica_per_round"]
    for r in rows:
        r["eval_loss_vs_sync_fp32"] = round(r["eval_loss"] / base["eval_loss"] - 1, 4)
        # bytes of one full-model sync: a fragments round moves 1/K of the model
        per_model = r["bytes_per_replica_per_round"] * r["settings"].get("fragments", 1)
        r["bytes_vs_fp32"] = round(per_model / fp32_round_bytes, 4)
        r["tokens_per_s_vs_sync_fp32"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    print(json.dumps({
        "bench": "sync_modes", "replicas": tiny_lm_spec()["replicas"], "steps_per_replica": STEPS, "sync_every": H,
        "parameters": base["parameters"], "store_bytes_per_s_per_replica": RATE, "rows": rows,
        "targets": {"overlap sync_share": "<= 0.03", "overlap eval_loss_vs_sync_fp32": "abs <= 0.01",
                    "int4 bytes_vs_fp32": "<= 0.125", "int4 eval_loss_vs_sync_fp32": "abs <= 0.01",
                    "topk bytes_vs_fp32": "<= 0.0333", "topk eval_loss_vs_sync_fp32": "abs <= 0.03",
                    "sync fp32 sync_share": ">= 0.30"},
    }, indent=2))


if __name__ == "__main__":
    main()
