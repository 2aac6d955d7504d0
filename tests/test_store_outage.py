"""A store outage longer than `round_timeout`, on real local runs: the tiny LM on moto's S3 behind
a proxy that goes down (connections refused, then 503 Service Unavailable) and comes back.

The replicas wait for the store with backoff, their rounds' deadlines standing still meanwhile
(`diloco.store.outage`); nothing fails, nothing is relaunched, and the run ends bit-identical.
While the store is away, `diloco status` (and the live bar) say so; past `store_outage_limit`
the run fails with one line naming the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import on_s3, tiny_spec
from diloco.testing.s3proxy import FaultyS3Proxy
from diloco.testing.scenarios import events_of, one_global_model, record_of, wait_for_round


def launch(spec, state, proxy) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec), "--on-interrupt", "detach"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DILOCO_STATE_DIR": str(state), "AWS_ENDPOINT_URL": proxy.url})
    return proc, proc.stdout.readline().split()[1].rstrip(":")


def spec_on_s3(tmp_path, s3, *, steps: int, diloco: str):
    """The tiny LM, 2 replicas, on moto S3 (reached through the proxy), `round_timeout` 8 s and `diloco` added."""
    spec = on_s3(tiny_spec(tmp_path, steps=steps, sync_every=20, replicas=2), s3)
    spec.write_text(spec.read_text().replace("round_timeout = 120", "round_timeout = 8" + diloco))
    return spec, tmp_path / "state"


def status(state, run_id, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", "status", run_id, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DILOCO_STATE_DIR": str(state)})


def test_an_outage_longer_than_round_timeout_is_waited_out_and_the_run_ends_bit_identical(tmp_path, s3):
    spec, state = spec_on_s3(tmp_path, s3, steps=160, diloco="")
    with FaultyS3Proxy(s3["env"]["AWS_ENDPOINT_URL"]) as proxy:
        proc, run_id = launch(spec, state, proxy)
        try:
            wait_for_round(state, run_id, 3)
            proxy.go_down(refuse_s=12, unavailable_s=10)  # 22 s away: past round_timeout (8 s)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(e["event"] == "store_unreachable"
                                                          for e in events_of(state, run_id)):
                time.sleep(0.2)
            during = status(state, run_id)
            view = json.loads(status(state, run_id, "--json").stdout)
            assert proxy.outage_done.wait(60)
            out, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
    assert proc.returncode == 0, out
    assert proxy.dropped + proxy.unavailable > 0  # the replicas did meet the outage
    said = " ".join(during.stdout.split())  # (as the terminal wrapped it)
    assert "has not answered the launcher since" in said and "store_outage_limit" in said, during.stdout
    assert view["progress"]["store_unreachable_s"] is not None
    assert "STORE UNREACHABLE for" in said
    events = events_of(state, run_id)
    kinds = [e["event"] for e in events]
    assert "store_unreachable" in kinds and "store_back" in kinds
    back = next(e for e in events if e["event"] == "store_back")
    assert back["after_seconds"] > 8  # longer than a round may wait
    assert not {"failed", "relaunch_scheduled", "diverged"} & set(kinds), kinds  # nothing failed or restarted
    record = record_of(state, run_id)
    one_global_model(record)
    assert all(r["result"]["rounds"] == 8 for r in record["ranks"])
    assert "Traceback" not in out


def test_an_outage_past_store_outage_limit_fails_the_run_with_one_line_naming_the_store(tmp_path, s3):
    spec, state = spec_on_s3(tmp_path, s3, steps=400, diloco="\nstore_outage_limit = 6")
    with FaultyS3Proxy(s3["env"]["AWS_ENDPOINT_URL"]) as proxy:
        proc, run_id = launch(spec, state, proxy)
        try:
            wait_for_round(state, run_id, 2)
            proxy.go_down(refuse_s=300, unavailable_s=0)
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
    assert proc.returncode != 0, out
    failed = [line for line in out.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and s3["uri"] in failed[0] and "has not answered" in failed[0], out
    assert "store_outage_limit = 6 s" in failed[0] and "Traceback" not in out
    record = record_of(state, run_id)
    assert record["state"] == "FAILED" and s3["uri"] in record["failure"]
