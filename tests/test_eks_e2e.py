"""The tiny-LM DiLoCo main job through `backend = "eks"`: real kubernetes client over HTTP
against kmock's Kubernetes API emulator with the test-side Job controller and kubelet from
diloco_eks.testing (pods run as local processes; no kube-apiserver can run here).

Remote means remote: the replicas meet in an s3:// rendezvous on a moto server, and pods see
only the environment their manifest declares (credentials through the spec's `secrets`, which
become a Kubernetes Secret), never the launcher's disk or shell. A pod SIGKILLed, relaunched by
the EKS backend alone and rejoining from the store: test_groups_e2e.py (on S3) and
test_azure_store.py (on Azure Blob)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, on_s3, tiny_spec

pytest.importorskip("diloco_eks")


@pytest.fixture
def cluster(tmp_path):
    from diloco_eks.testing import SimulatedCluster

    with SimulatedCluster(tmp_path / "cluster", extra_pythonpath=[str(ROOT / "examples" / "tiny-lm")]) as sim:
        yield sim
    assert not sim.error_traces, sim.error_traces


def eks_spec(tmp_path, cluster, s3, **kw):
    spec = on_s3(tiny_spec(tmp_path, **kw), s3)
    text = spec.read_text().replace('backend = "local"\n', "")
    text += (f'\n[backend]\nname = "eks"\nimage = "ghcr.io/example/tiny-lm:1"\nnamespace = "ml"\n'
             f'api_url = "{cluster.url}"\n')
    spec.write_text(text)
    return spec


def run_cli(state, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "DILOCO_STATE_DIR": str(state)})


def test_tiny_lm_main_job_through_eks(tmp_path, cluster, s3):
    state = tmp_path / "state"
    proc = run_cli(state, "run", str(eks_spec(tmp_path, cluster, s3, steps=100, sync_every=25, replicas=2)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 4  members [0, 1]" in proc.stdout and "eval loss" in proc.stdout
    run_id = proc.stdout.split()[1].rstrip(":")
    record = json.loads(run_cli(state, "status", run_id, "--json").stdout)["record"]
    assert {r["handle"]["metadata"]["job"] for r in record["ranks"]} == {record["ranks"][0]["handle"]["metadata"]["job"]}
    logs = run_cli(state, "logs", run_id, "--rank", "1").stdout
    assert "round 4: loss" in logs
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=f"runs/{run_id}/")["Contents"]]
    assert any("/reduced/" in k for k in keys) and any("/rounds/" in k for k in keys)  # they met in S3
    dry = run_cli(state, "dryrun", str(tmp_path / "diloco.toml")).stdout
    assert "testing" not in dry.replace("ghcr.io/example/tiny-lm", "")  # credentials never shown


def test_two_processes_per_pod_through_eks(tmp_path, cluster, s3):
    """processes_per_replica = 2: each pod runs torchrun over two DDP processes (gloo on CPU pods)."""
    state = tmp_path / "state"
    spec = eks_spec(tmp_path, cluster, s3, steps=40, sync_every=20, replicas=2)
    spec.write_text(spec.read_text().replace("replicas = 2\n", "replicas = 2\nprocesses_per_replica = 2\n"))
    dry = run_cli(state, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    assert "diloco_replica.torchrun" in dry.stdout and "- --nproc-per-node\n" in dry.stdout and "/dev/shm" in dry.stdout
    proc = run_cli(state, "run", str(spec))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 2  members [0, 1]" in proc.stdout
    run_id = proc.stdout.split()[1].rstrip(":")
    logs = run_cli(state, "logs", run_id, "--rank", "1").stdout
    assert "[rank 1 process 1 attempt 0]" in logs and "[rank 1 process 0 attempt 0]" in logs


def test_eks_refuses_a_rendezvous_on_the_launchers_disk(tmp_path, cluster, s3):
    spec = eks_spec(tmp_path, cluster, s3)
    spec.write_text(spec.read_text().replace(s3["uri"], (tmp_path / "store").as_uri()))
    for cmd in ("dryrun", "run"):
        proc = run_cli(tmp_path / "state", cmd, str(spec))
        assert proc.returncode == 2 and "which 'eks' replicas do not see" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_a_run_on_eks_grows_by_a_pod_while_it_trains(tmp_path, cluster, s3):
    """`diloco scale` on a remote backend: the EKS backend launches the new rank as a pod of its
    own, which meets the others on S3 at the next round, and the run ends with one global model."""
    from test_elastic import check_rounds, wait_for

    state = tmp_path / "state"
    spec = eks_spec(tmp_path, cluster, s3, steps=600, sync_every=20, replicas=2)  # room for a pod to start
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    run_id = proc.stdout.readline().split()[1].rstrip(":")
    try:
        wait_for(state, run_id, lambda e: e["event"] == "round" and e["round"] >= 2)
        scaled = run_cli(state, "scale", run_id, "3")
        assert scaled.returncode == 0, scaled.stderr
        wait_for(state, run_id, lambda e: e["event"] == "round" and len(e["members"]) == 3)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    record = json.loads(run_cli(state, "status", run_id, "--json").stdout)["record"]
    assert [r["status"] for r in record["ranks"]] == ["succeeded"] * 3 and record["ranks"][2]["handle"]["backend_name"] == "eks"
    assert len({r["result"]["theta_digest"] for r in record["ranks"]}) == 1
    check_rounds(s3["uri"], run_id)
