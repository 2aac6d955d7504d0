"""The eks backend end to end through the real kubernetes client over HTTP, against kmock's
Kubernetes API emulator on 127.0.0.1 with a test-side Job controller and kubelet (no runnable
kube-apiserver exists here; see diloco_eks.testing for what the stand-in does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from diloco.errors import BackendError, UserError
from diloco.testing import ExecutorConformance, process_alive
from diloco_eks import EksExecutor

RUNNER = ["python", "-m", "diloco.runner"]  # the container command when diloco-replica is not installed


class TestEksConformance(ExecutorConformance):
    wait_timeout = 60.0

    @pytest.fixture(autouse=True)
    def _use_cluster(self, cluster):
        self.cluster = cluster

    def make_executor(self):
        return EksExecutor(image="python:3.11-slim", namespace="conformance", api_url=self.cluster.url,
                           command=RUNNER, cache_seconds=0.05)


def test_forbidden_names_the_verb_and_resource(cluster):
    import kmock

    cluster.emulator["post", kmock.resource("batch", "v1", "jobs"), kmock.namespace("locked")] << 403 << {
        "kind": "Status", "status": "Failure", "reason": "Forbidden",
        "message": 'jobs.batch is forbidden: User "dev" cannot create resource "jobs" in API group "batch"'}
    ex = EksExecutor(image="img", namespace="locked", api_url=cluster.url, command=RUNNER)
    with pytest.raises(BackendError) as err:
        ex.launch_replicas(2, "diloco.testing.entrypoints:report", run_id="forbidden-run")
    msg = str(err.value)
    assert "forbids create jobs.batch in namespace 'locked'" in msg and 'cannot create resource "jobs"' in msg


def test_no_kubeconfig_is_a_clear_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ex = EksExecutor(image="img")
    with pytest.raises(UserError, match="no Kubernetes credentials"):
        ex.launch_replicas(1, "diloco.testing.entrypoints:report", run_id="nocreds")


def test_image_pull_failure_is_surfaced_in_poll_and_logs(cluster):
    ex = EksExecutor(image="registry.example.com/does-not-exist:1", namespace="pull", api_url=cluster.url,
                     command=RUNNER, cache_seconds=0.05)
    (h,) = ex.launch_replicas(1, "diloco.testing.entrypoints:report", run_id="pull-fail")
    deadline = time.monotonic() + 20
    while ex.poll(h) != "failed" and time.monotonic() < deadline:
        time.sleep(0.1)
    (res,) = ex.collect([h], timeout=5)
    assert res.status == "failed" and "ErrImagePull" in res.error and "does-not-exist" in res.error
    assert "cannot start: ErrImagePull" in ex.stream_logs(h)
    ex.cancel(h)


def test_cancel_deletes_the_job_and_its_pods_processes(cluster):
    ex = EksExecutor(image="img", namespace="cancel", api_url=cluster.url, command=RUNNER, cache_seconds=0.05)
    handles = ex.launch_replicas(3, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="cancel-me")
    deadline = time.monotonic() + 20
    while not all(ex.poll(h) == "running" for h in handles) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [p.proc.pid for p in cluster.pods_of(handles[0].metadata["job"])]
    assert len(pids) == 3
    ex.cancel(handles[1])
    ex.cancel(handles[1])
    deadline = time.monotonic() + 20
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(p) for p in pids)
    assert [ex.poll(h) for h in handles] == ["cancelled"] * 3


def test_diloco_run_through_eks_with_a_relaunched_rank(cluster, tmp_path):
    """`diloco run` with backend eks: a rank that fails once is relaunched as its own Job."""
    (tmp_path / "flaky.py").write_text(
        "def main(ctx):\n"
        "    if ctx.rank == 1 and ctx.attempt == 0:\n"
        "        raise RuntimeError('first attempt of rank 1 dies')\n"
        "    return ctx.rank\n")
    cluster.extra_pythonpath.append(str(tmp_path))
    spec = tmp_path / "diloco.toml"
    spec.write_text('replicas = 3\nentrypoint = "flaky:main"\nrendezvous = "s3://bucket/runs"\n[restart]\nmonitor_interval = 0.1\nbackoff = 0.1\n'
                    f'[backend]\nname = "eks"\nimage = "img"\nnamespace = "runs"\napi_url = "{cluster.url}"\n'
                    f'command = {json.dumps(RUNNER)}\n')
    env = {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", str(spec)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = proc.stdout.split()[1].rstrip(":")
    status = json.loads(subprocess.run([sys.executable, "-m", "diloco", "status", run_id, "--json"],
                                       capture_output=True, text=True, env=env).stdout)
    ranks = status["record"]["ranks"]
    assert [r["status"] for r in ranks] == ["succeeded"] * 3 and ranks[1]["restarts"] == 1
    assert ranks[1]["handle"]["metadata"]["job"].endswith("-r1-a1")
    logs = subprocess.run([sys.executable, "-m", "diloco", "logs", run_id, "--rank", "1", "--attempt", "0"],
                          capture_output=True, text=True, env=env)
    assert "first attempt of rank 1 dies" in logs.stdout

