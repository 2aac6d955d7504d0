"""A store that cannot serve a run stops it at once, with one line, without burning restarts."""

from __future__ import annotations

import json

from conftest import on_s3, tiny_spec


def test_run_on_a_store_ignoring_create_only_fails_once_and_clearly(cli, tmp_path, state_dir, s3):
    from diloco.testing.s3proxy import FaultyS3Proxy

    with FaultyS3Proxy(s3["env"]["AWS_ENDPOINT_URL"], ignore_conditional=True) as proxy:
        spec = on_s3(tiny_spec(tmp_path, steps=40, sync_every=20, replicas=2), s3)
        spec.write_text(spec.read_text().replace(s3["env"]["AWS_ENDPOINT_URL"], proxy.url))
        proc = cli("run", str(spec), timeout=300, env={"AWS_ENDPOINT_URL": proxy.url})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "configuration error" in proc.stdout and "ignores create-only writes" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    run_id = proc.stdout.split()[1].rstrip(":")
    record = json.loads((state_dir / "runs" / run_id / "run.json").read_text())
    assert record["restarts_used"] == 0 and all(r["restarts"] == 0 for r in record["ranks"])
