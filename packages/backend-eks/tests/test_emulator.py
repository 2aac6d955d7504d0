"""The eks backend end to end through the real kubernetes client over HTTP, against the strict
Kubernetes stand-in on 127.0.0.1 (kmock's API emulator behind an API server's validation, with a
Job controller and kubelet; no runnable kube-apiserver exists here; see diloco_eks.testing)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

import pytest

from diloco.errors import BackendError, UserError
from diloco.testing import ExecutorConformance, launch, plan_for, process_alive
from diloco_eks import EksExecutor

RUNNER = ["python", "-m", "diloco.bootstrap.runner"]  # the container command when diloco-replica is not installed
REPORT = "diloco.testing.entrypoints:report"


class TestEksConformance(ExecutorConformance):
    wait_timeout = 60.0

    @pytest.fixture(autouse=True)
    def _use_cluster(self, cluster):
        self.cluster = cluster

    def make_executor(self):
        return EksExecutor(image="python:3.11-slim", namespace="conformance", api_url=self.cluster.url,
                           command=RUNNER, cache_seconds=0.05)


def test_forbidden_names_the_verb_and_resource(cluster):
    cluster.deny("create", "jobs", "locked")
    ex = EksExecutor(image="img", namespace="locked", api_url=cluster.url, command=RUNNER)
    with pytest.raises(BackendError) as err:
        launch(ex, 2, REPORT, run_id="forbidden-run")
    msg = str(err.value)
    assert "forbids create jobs.batch in namespace 'locked'" in msg and 'cannot create resource "jobs"' in msg


def test_no_kubeconfig_is_a_clear_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ex = EksExecutor(image="img")
    with pytest.raises(UserError, match="no Kubernetes credentials"):
        launch(ex, 1, REPORT, run_id="nocreds")


def test_image_pull_failure_is_surfaced_in_poll_and_logs(cluster):
    ex = EksExecutor(image="registry.example.com/does-not-exist:1", namespace="pull", api_url=cluster.url,
                     command=RUNNER, cache_seconds=0.05)
    (h,) = launch(ex, 1, REPORT, run_id="pull-fail")
    deadline = time.monotonic() + 20
    while ex.poll(h) != "failed" and time.monotonic() < deadline:
        time.sleep(0.1)
    (res,) = ex.collect([h], timeout=5)
    assert res.status == "failed" and "ErrImagePull" in res.error and "does-not-exist" in res.error
    assert "cannot start: ErrImagePull" in ex.stream_logs(h)
    ex.cancel(h)


def test_cancel_deletes_the_job_and_its_pods_processes(cluster):
    ex = EksExecutor(image="img", namespace="cancel", api_url=cluster.url, command=RUNNER, cache_seconds=0.05)
    handles = launch(ex, 3, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="cancel-me")
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



HELD = """
import time
from pathlib import Path

def main(ctx, marker_dir):
    Path(marker_dir, f"{ctx.rank}.{ctx.attempt}").touch()
    if (ctx.rank, ctx.attempt) == (1, 0):
        raise RuntimeError("first attempt of rank 1 dies")
    if (ctx.rank, ctx.attempt) == (1, 1):
        time.sleep(300)  # until its Job is deleted from outside diloco
    deadline = time.monotonic() + 120
    while not Path(marker_dir, "1.2").exists() and time.monotonic() < deadline:  # the others wait for its return
        time.sleep(0.1)
    return ctx.rank
"""


def test_a_job_deleted_outside_diloco_is_that_ranks_loss_not_the_runs_end(cluster, tmp_path):
    """`kubectl delete job` of one rank's Job (its relaunch, a Job of its own): the rank reads
    cancelled, is relaunched as a new Job within its restart budget, the others train on untouched,
    and the run succeeds. Only `diloco cancel` ends a run."""
    (tmp_path / "held.py").write_text(HELD)
    markers = tmp_path / "markers"
    markers.mkdir()
    cluster.extra_pythonpath.append(str(tmp_path))
    spec = tmp_path / "diloco.toml"
    spec.write_text(f'replicas = 3\nentrypoint = "held:main"\nrendezvous = "s3://bucket/runs"\n'
                    f'[args]\nmarker_dir = "{markers}"\n[restart]\nmonitor_interval = 0.1\nbackoff = 0.1\n'
                    f'[backend]\nname = "eks"\nimage = "img"\nnamespace = "runs"\napi_url = "{cluster.url}"\n'
                    f'command = {json.dumps(RUNNER)}\n')
    env = {**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state")}
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        deadline = time.monotonic() + 90
        while not (markers / "1.1").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, "rank 1's relaunch never started"
            time.sleep(0.1)
        record = json.loads((tmp_path / "state" / "runs" / run_id / "run.json").read_text())
        job = record["ranks"][1]["handle"]["metadata"]["job"]
        assert job.endswith("-r1-a1")
        cluster.batch.delete_namespaced_job(job, "runs", propagation_policy="Background")  # kubectl delete job
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    status = json.loads(subprocess.run([sys.executable, "-m", "diloco", "status", run_id, "--json"],
                                       capture_output=True, text=True, env=env).stdout)
    ranks = status["record"]["ranks"]
    assert [r["status"] for r in ranks] == ["succeeded"] * 3 and [r["restarts"] for r in ranks] == [0, 2, 0]
    assert [len(r["attempts"]) for r in ranks] == [1, 3, 1]  # ranks 0 and 2 never stopped
    kinds = [(e["event"], e.get("rank"), e.get("attempt")) for e in status["events"]]
    assert ("cancelled_outside", 1, 1) in kinds and not [k for k in kinds if k[0] == "run_cancelled"]


def _record_creates(monkeypatch, ex, fail_on_job=None):
    """Record the body of every create call the executor makes (then make it for real), and
    optionally refuse the creation of one Job as the API would."""
    created, real = [], ex.api.call

    def call(verb, resource, namespace, fn, *args, **kwargs):
        if verb == "create":
            body = copy.deepcopy(args[1])
            created.append(body)
            if body["kind"] == "Job" and body["metadata"]["name"] == fail_on_job:
                raise BackendError(f"Kubernetes API error 422 on create jobs.batch in {namespace!r}: refused")
        return real(verb, resource, namespace, fn, *args, **kwargs)

    monkeypatch.setattr(ex.api, "call", call)
    return created


def test_submit_creates_exactly_the_plan_with_secret_values_added(cluster, monkeypatch):
    ex = EksExecutor(image="img", namespace="exact", api_url=cluster.url, command=RUNNER, cache_seconds=0.05)
    shown = ["python", "-c", "import os; print('token=' + os.environ['HF_TOKEN'])"]
    plan = plan_for(ex, 2, shown, run_id="exact-run", secret_env={"HF_TOKEN": "hf-secret-value"})
    planned = copy.deepcopy(plan.body)
    created = _record_creates(monkeypatch, ex)
    handles = ex.submit(plan)
    secret, job = planned
    assert secret["stringData"] == {"HF_TOKEN": "REDACTED"}
    assert created == [{**secret, "stringData": {"HF_TOKEN": "hf-secret-value"}}, job]  # the plan, values added
    assert plan.body == planned  # submitting never changes (or fills in) the plan itself
    assert [h.rank for h in handles] == [0, 1] and {h.metadata["job"] for h in handles} == {job["metadata"]["name"]}
    assert [h.metadata["index"] for h in handles] == [0, 1]
    assert all(h.metadata["secret"] == secret["metadata"]["name"] for h in handles)
    assert "hf-secret-value" not in json.dumps([h.to_dict() for h in handles])
    results = ex.collect(handles, timeout=60)
    assert [r.status for r in results] == ["succeeded"] * 2, [r.error for r in results]
    assert "token=hf-secret-value" in ex.stream_logs(handles[1])  # the pod read the real value from the Secret


def test_relaunch_of_two_ranks_submits_a_job_each_in_request_order(cluster, monkeypatch):
    ex = EksExecutor(image="img", namespace="relaunch", api_url=cluster.url, command=RUNNER, cache_seconds=0.05)
    plan = plan_for(ex, 3, REPORT, run_id="two-ranks", ranks=[2, 0], attempt=1)
    created = _record_creates(monkeypatch, ex)
    handles = ex.submit(plan)
    assert created == plan.body and [d["kind"] for d in created] == ["Job", "Job"]
    assert [(h.rank, h.attempt, h.metadata["index"]) for h in handles] == [(2, 1, 0), (0, 1, 0)]
    assert [h.metadata["job"] for h in handles] == [d["metadata"]["name"] for d in plan.body]
    results = ex.collect(handles, timeout=60)
    assert [(r.rank, r.status, r.result["rank"], r.result["attempt"]) for r in results] == [
        (2, "succeeded", 2, 1), (0, "succeeded", 0, 1)]


def test_a_refused_job_undoes_what_was_started(cluster, monkeypatch):
    """Rank 2's Job is refused: rank 0's Job (already created) is deleted with its Secret, and
    rank 2's Secret, which no Job owns, is deleted too."""
    from kubernetes.client.exceptions import ApiException

    ex = EksExecutor(image="img", namespace="undo", api_url=cluster.url, command=RUNNER, cache_seconds=0.05)
    plan = plan_for(ex, 3, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="undo-run", ranks=[0, 2],
                    attempt=1, secret_env={"HF_TOKEN": "hf-secret-value"})
    jobs = [d["metadata"]["name"] for d in plan.body if d["kind"] == "Job"]
    secrets = [d["metadata"]["name"] for d in plan.body if d["kind"] == "Secret"]
    assert len(jobs) == len(secrets) == 2
    created = _record_creates(monkeypatch, ex, fail_on_job=jobs[1])
    with pytest.raises(BackendError) as err:
        ex.submit(plan)
    msg = str(err.value)
    assert "launching rank 2 on Kubernetes failed" in msg and "refused" in msg
    assert "the 1 Job(s) already started were cancelled" in msg
    assert [d["metadata"]["name"] for d in created] == [secrets[0], jobs[0], secrets[1], jobs[1]]
    for read, name in [(cluster.batch.read_namespaced_job, jobs[0]), (cluster.core.read_namespaced_secret, secrets[0]),
                       (cluster.core.read_namespaced_secret, secrets[1])]:
        with pytest.raises(ApiException) as gone:
            read(name, "undo", _preload_content=False)
        assert gone.value.status == 404, name


# What each pod of a replica of two nodes runs in place of torchrun (no torch here): it finds node 0
# by the DNS name its manifest gives (retrying, as torch's store client does, until the record is
# there), says what it sees, and then waits; node 1 of rank 1 fails instead.
NODE = """
import os, socket, sys, time
rank, node, first = os.environ["REPLICA_RANK"], os.environ["PET_NODE_RANK"], os.environ["PET_MASTER_ADDR"]
deadline = time.monotonic() + 60
while True:
    try:
        address = socket.gethostbyname(first)
        break
    except OSError:
        assert time.monotonic() < deadline, f"{first} never resolved"
        time.sleep(0.1)
print(f"host {socket.gethostname()} node {node} finds node 0 ({first}) at {address}", flush=True)
if (rank, node) == ("1", "1"):
    sys.exit(3)
time.sleep(300)
"""


def test_a_replica_of_two_nodes_is_one_job_whose_pods_find_node_0_and_fail_together(cluster, monkeypatch):
    """nodes = 2, the replicas' commands replaced: submit creates exactly the plan (per replica a
    Secret, a Service, a Job); each replica's pods find node 0 by its DNS name; a node that fails
    fails its replica alone (its Job: Kubernetes stops the other pod), named in the error; the
    other replica runs on until cancelled, which takes its pods and Service."""
    from kubernetes.client.exceptions import ApiException

    ex = EksExecutor(image="img", namespace="islands", api_url=cluster.url, cache_seconds=0.05)
    plan = plan_for(ex, 2, REPORT, run_id="islands", nodes=2, secret_env={"HF_TOKEN": "hf-secret-value"})
    for doc in plan.body:
        if doc["kind"] == "Job":
            doc["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "-c", NODE]
    created = _record_creates(monkeypatch, ex)
    h0, h1 = ex.submit(plan)
    assert created == [{**d, "stringData": {"HF_TOKEN": "hf-secret-value"}} if d["kind"] == "Secret" else d
                       for d in plan.body] and [d["kind"] for d in created] == ["Secret", "Service", "Job"] * 2
    assert (h0.metadata["nodes"], h0.metadata["service"]) == (2, h0.metadata["job"])
    _wait(lambda: ex.poll(h1) == "failed" and ex.poll(h0) == "running")
    (failed,) = ex.collect([h1], timeout=10)
    assert failed.exit_code == 3 and "pod exited with code 3" in failed.error
    assert f"(node 1 of 2, pod {h1.metadata['job']}-1-" in failed.error and "BackoffLimitExceeded" in failed.error
    _wait(lambda: not [p for p in cluster.pods_of(h1.metadata["job"]) if p.proc and p.proc.poll() is None])
    logs = ex.stream_logs(h0)
    assert logs.index("==> node 1 of 2 <==") < logs.index("==> node 0 of 2 <==")  # node 0 (the result's) last
    job = h0.metadata["job"]
    for node in (0, 1):
        assert f"host {job}-{node} node {node} finds node 0 ({job}-0.{job}) at 127.0.0.1" in logs
    pids = [p.proc.pid for p in cluster.pods_of(job)]
    ex.cancel(h0)
    _wait(lambda: not any(process_alive(p) for p in pids))
    assert ex.poll(h0) == "cancelled"
    with pytest.raises(ApiException) as gone:
        cluster.core.read_namespaced_service(job, "islands")
    assert gone.value.status == 404


def test_a_pod_deleted_before_it_ended_counts_as_a_failure(cluster):
    """As the 1.29 Job controller counts it (its job-tracking finalizer): `kubectl delete pod` of a
    running pod fails its index, which diloco then relaunches; the pod is not silently recreated."""
    ex = EksExecutor(image="img", namespace="islands", api_url=cluster.url, command=RUNNER, cache_seconds=0.05)
    (handle,) = launch(ex, 1, "diloco.testing.entrypoints:sleep", {"seconds": 300}, run_id="deleted-pod")
    _wait(lambda: ex.poll(handle) == "running")
    pod = ex.api.pod_for("islands", handle.metadata["job"], 0)["metadata"]["name"]
    cluster.core.delete_namespaced_pod(pod, "islands")
    (result,) = ex.collect([handle], timeout=30)
    assert result.status == "failed"
    status = json.loads(cluster.batch.read_namespaced_job(handle.metadata["job"], "islands",
                                                          _preload_content=False).data)["status"]
    assert (status["failed"], status["failedIndexes"]) == (1, "0")


def _wait(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
