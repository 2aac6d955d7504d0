"""`diloco-replica module:function` / `python -m diloco_replica`: the container entrypoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(args, env, tmp_path):
    full = {**os.environ, "REPLICA_RANK": "1", "DILOCO_REPLICAS": "2", "DILOCO_RUN_ID": "entry-test",
            "DILOCO_ATTEMPT": "3", "DILOCO_RESULT_PATH": str(tmp_path / "result.json"), **env}
    full.pop("DILOCO_ENTRYPOINT", None)
    return subprocess.run([sys.executable, "-m", "diloco_replica", *args], capture_output=True, text=True,
                          env=full, timeout=60)


def test_runs_the_named_function_with_a_context_from_the_environment(tmp_path):
    proc = run(["diloco.testing.entrypoints:report"], {"DILOCO_ENTRYPOINT_ARGS": '{"marker": "from-env"}'}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "replica rank=1 world=2 run=entry-test attempt=3 from-env" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "succeeded" and result["result"]["rank"] == 1


def test_a_failing_function_records_its_traceback(tmp_path):
    proc = run(["diloco.testing.entrypoints:fail_on"], {"DILOCO_ENTRYPOINT_ARGS": '{"fail_rank": 1}'}, tmp_path)
    assert proc.returncode == 1 and "deliberate failure on rank 1" in proc.stderr
    assert "RuntimeError" in json.loads((tmp_path / "result.json").read_text())["error"]


def test_without_an_entrypoint_it_says_what_to_do(tmp_path):
    proc = run([], {}, tmp_path)
    assert proc.returncode == 2 and "name the training function" in proc.stderr
