"""Every bench under bench/ runs (its quick mode) and prints the JSON it documents.

Numbers are not checked here (speed targets live in the benches, never in tests); what is
checked is that each bench still runs against today's code and examples and reports the fields
docs/benchmarks.md quotes — `sync_modes.py` and `tiny_lm.py` once broke unseen when the example's
spec moved a key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = {
    "launch.py": ["results", "bare_interpreter_s", "first_step"],
    "allreduce.py": ["results"],
    "bytes.py": ["results", "bound_up"],
    "status_reads.py": ["results"],
    "lanes.py": ["results"],
    "nodes.py": ["exchange", "lost_node", "targets"],
    "round_cost.py": ["rows"],
    "tiny_lm.py": ["diloco", "data_parallel", "diloco_vs_dp_eval_loss"],
    "sync_modes.py": ["rows", "targets"],
    "scale.py": ["rows", "targets"],
    "uneven.py": ["rows", "targets", "round_seconds_vs_fixed", "mixed_rows", "mixed_vs_uniform", "resize_rows"],
    "gone.py": ["rows", "gone_vs_alone", "targets"],
    "recovery.py": ["rows"],
    "relaunch.py": ["rows", "targets"],
    "gpu_sync.py": ["rows", "targets"],
    "peers.py": ["rows", "diloco_vs_torchft", "targets"],
    "trainers.py": ["rows", "callback_vs_wrapper_s_per_round", "lightning_callback_vs_wrapper_s_per_round", "trainer_vs_loop"],
}
# Benches that install a peer project into a venv of their own (torchft, with its own torch: ~40 s
# and a torch download in CI) run only when their variable is 1; CI's 30 minutes have no room:
#   DILOCO_BENCH_TORCHFT=1 .venv/bin/python -m pytest tests/test_benches.py -k peers
OPT_IN = {"peers.py": "DILOCO_BENCH_TORCHFT"}
ROUND_COST_FIELDS = {"store", "replicas", "model_mb", "added_host_memory_vs_model", "requests_per_replica_per_round",
                     "polls_per_replica_per_round", "round_vs_raw"}


def test_every_bench_is_listed_here():
    assert {p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_")} == set(BENCHES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_the_bench_runs_in_quick_mode_and_prints_its_json(bench, tmp_path):
    if bench in OPT_IN and os.environ.get(OPT_IN[bench]) != "1":
        pytest.skip(f"{bench} makes a venv of its own: set {OPT_IN[bench]}=1 to run it")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / bench)], capture_output=True, text=True,
                          timeout=280, cwd=tmp_path, env={**os.environ, "BENCH_QUICK": "1",
                                                          "DILOCO_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    for key in BENCHES[bench]:
        assert key in out, f"{bench} no longer reports {key!r}"
    if bench == "scale.py":
        assert [row["replicas"] for row in out["rows"]] == [4, 8, 16]
        assert all(row["round_s"] > 0 and row["requests_per_replica_per_round"] > 0 for row in out["rows"])
    if bench == "gpu_sync.py":  # no GPU here: the proxy, compute-only first, every row's fields
        assert [r["mode"] for r in out["rows"]][0] == "compute-only" and {r["device"] for r in out["rows"]} == {"cpu-proxy"}
        assert all({"tokens_per_s", "blocked_s_per_round", "step_inflation", "eval_loss", "host_train_gb", "host_join_gb",
                    "host_added_x_model", "host_join_x_model"} <= set(r) for r in out["rows"][1:])
        assert all(r["host_join_gb"] > 0 for r in out["rows"][1:])  # θ_global and the snapshot at least
    if bench == "peers.py":
        assert [row["system"] for row in out["rows"]] == ["diloco", "torchft"]
        assert all(row["eval_loss"] > 0 for row in out["rows"])  # the same model trained on both sides
        assert {"sync_s_per_round", "sync_s_exchange", "eval_loss"} <= set(out["diloco_vs_torchft"][0])
    if bench == "round_cost.py":
        assert {row["store"] for row in out["rows"]} == {"file", "s3"}
        for row in out["rows"]:
            assert ROUND_COST_FIELDS <= set(row), row
            assert 0.99 < row["bytes_up_vs_bound"] < 1.01  # the byte bound holds, streamed or not
