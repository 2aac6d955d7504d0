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


def island_spec(tmp_path, cluster, s3, *, steps, sync_every):
    """Two replicas in two groups on the same cluster: `island`, one replica of two pods (nodes = 2:
    an Indexed Job of two pods, torchrun across them through node 0's DNS name), and `single`, one
    replica of one pod. (Two islands at once would collide here: every simulated pod shares the
    machine's network, so two node-0s would serve torch's store on one port; on a cluster each pod
    has its own.)"""
    from diloco.local.island import free_port
    from conftest import placed_by_groups

    spec = on_s3(tiny_spec(tmp_path, steps=steps, sync_every=sync_every, restart="backoff = 0.2"), s3)
    backend = (f'[group.backend]\nname = "eks"\nimage = "ghcr.io/example/tiny-lm:1"\nnamespace = "ml"\n'
               f'api_url = "{cluster.url}"\nmaster_port = {free_port()}\n')
    spec.write_text(placed_by_groups(spec) + f'\n[[group]]\nname = "island"\nreplicas = 1\nnodes = 2\n{backend}'
                    f'\n[[group]]\nname = "single"\nreplicas = 1\n{backend}')
    return spec


def test_a_replica_of_two_pods_trains_and_a_deleted_pod_relaunches_it_whole(tmp_path, cluster, s3):
    """A replica of two pods (one Indexed Job; node rank = completion index, node 0 found as
    `<job>-0.<job>` through the Job's headless Service) trains with another replica. One of its pods
    deleted mid-run (`kubectl delete pod`) fails its Job as a whole: Kubernetes stops the other pod,
    the supervisor relaunches the replica once, as one attempt (a new Job of two pods), and it rejoins
    from the store while the other replica trains on, untouched; the run ends with one global model.
    (Where it rejoins depends on the machine's pace: mid-run, or at the last checkpoint if the other
    replica, training alone meanwhile, got there first.)"""
    from conftest import events_of, one_global_model, record_of, wait_for_round

    state = tmp_path / "state"
    spec = island_spec(tmp_path, cluster, s3, steps=200, sync_every=20)
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "DILOCO_STATE_DIR": str(state)})
    try:
        run_id = launcher.stdout.readline().split()[1].rstrip(":")
        wait_for_round(state, run_id, 2, timeout=240)
        job = record_of(state, run_id)["ranks"][0]["handle"]["metadata"]["job"]
        pods = {p.index: p.name for p in cluster.pods_of(job)}
        assert sorted(pods) == [0, 1], pods  # one Job, two pods
        cluster.core.delete_namespaced_pod(pods[1], "ml")  # kubectl delete pod: node 1 of rank 0
        out, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    record = record_of(state, run_id)
    one_global_model(record)
    island, single = record["ranks"]
    assert (island["restarts"], single["restarts"]) == (1, 0) and len(single["attempts"]) == 1
    assert [h["metadata"]["job"][-6:] for h in island["attempts"]] == ["-r0-a0", "-r0-a1"]
    failed = [e for e in events_of(state, run_id) if e["event"] in ("failed", "relaunch_scheduled")]
    assert [(e["event"], e["rank"]) for e in failed] == [("failed", 0), ("relaunch_scheduled", 0)]  # counted once
    assert "no pod of the replica's 2 nodes says why: one was deleted" in failed[0]["error"]
    logs = run_cli(state, "logs", run_id, "--rank", "0", "--attempt", "1", "-n", "400").stdout
    assert logs.index("==> node 1 of 2 <==") < logs.index("==> node 0 of 2 <==")  # node 0, with the result, last
    # both processes of the new Job's two pods, one torch group again, rejoined from the store at one round
    joined = [int(line.split("joined at round ")[1].split()[0]) for line in logs.splitlines()
              if "joined at round" in line]
    assert len(joined) == 2 and joined[0] == joined[1] >= 2, logs[-2000:]
    events = events_of(state, run_id)
    after = events[[e["event"] for e in events].index("failed"):]
    assert any(e["event"] == "round" and e["members"] == [1] for e in after), events[-5:]  # the other trained on
