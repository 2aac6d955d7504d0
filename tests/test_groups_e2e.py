"""One run across four backends: a local group, an EKS group (the Kubernetes emulator), a SageMaker
group (its control plane) and a Modal group (the fake Modal server), meeting in one s3:// store
on a moto server. One replica killed in the EKS group is relaunched by the EKS backend and rejoins
from the store; every replica of every group ends holding the same global model. `diloco cancel`
from another shell stops every group, and no replica process stays behind on any stand-in: the
one cancel test of the cloud backends end to end.

Every CLI call is its own process with the shell a user would have: AWS keys, the Modal token,
the cluster's URL in the spec. Replicas get only what their group's backend gives them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, events_of, one_global_model, placed_by_groups, record_of, tiny_spec, wait_for_round

pytest.importorskip("diloco_eks")
pytest.importorskip("diloco_sagemaker")
pytest.importorskip("diloco_modal")

ROLE = "arn:aws:iam::123456789012:role/diloco-sagemaker"
SECRETS = 'secrets = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"]\n'


@pytest.fixture
def clouds(tmp_path, s3):
    """The three stand-ins at once, and the shell that reaches all of them."""
    from diloco_eks.testing import SimulatedCluster
    from diloco_modal.testing import FakeModal
    from diloco_sagemaker.testing import FakeSageMaker, create_execution_role

    assert create_execution_role(s3["env"]["AWS_ENDPOINT_URL"]) == ROLE
    modal = FakeModal(tmp_path / "modal-cloud", grace_seconds=10.0).start()
    try:
        with SimulatedCluster(tmp_path / "cluster", extra_pythonpath=[str(ROOT / "examples" / "tiny-lm")]) as k8s, \
                FakeSageMaker(tmp_path / "sagemaker", aws_endpoint=s3["env"]["AWS_ENDPOINT_URL"], grace_seconds=3.0,
                              stopping_seconds=2.0) as sm:
            yield {"k8s": k8s, "sm": sm, "modal": modal, "env": {**os.environ, **sm.env, **modal.env}}
            deadline = time.monotonic() + 20
            while (sm.live_processes() or modal.live_processes() or k8s.live_processes()) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            leftover = sm.live_processes() + modal.live_processes() + k8s.live_processes()
        assert not k8s.error_traces, k8s.error_traces
    finally:
        modal.stop()
    assert not leftover, f"replica processes still running: {leftover}"
    assert modal.unimplemented() == [] and modal.server_errors() == []


def four_clouds_spec(tmp_path, s3, clouds, **kw):
    """The tiny-LM main job with its four replicas in four groups, one per backend."""
    spec = tiny_spec(tmp_path, **kw)
    text = placed_by_groups(spec)
    text = text.replace("round_timeout = 120", "round_timeout = 15\ncheckpoint_every = 2")
    head, sep, rest = text.partition("\n[")
    text = head + f'\nrendezvous = "{s3["uri"]}"\nstore_region = "us-east-1"\n' + SECRETS + sep + rest
    text += f"""
[[group]]
name = "here"
replicas = 1
[group.backend]
name = "local"

[[group]]
name = "k8s"
replicas = 1
region = "us-west-2"
[group.backend]
name = "eks"
image = "ghcr.io/example/tiny-lm:1"
namespace = "ml"
api_url = "{clouds['k8s'].url}"

[[group]]
name = "sm"
replicas = 1
[group.backend]
name = "sagemaker"
role = "{ROLE}"
region = "us-east-1"
image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco-replica:test"

[[group]]
name = "modal"
replicas = 1
[group.backend]
name = "modal"
app_name = "tiny-lm"
"""
    spec.write_text(text)
    return spec


def waited(launcher, wait) -> None:
    """`wait()`, or the launcher's output with the failure (it is what says why)."""
    try:
        wait()
    except AssertionError as exc:
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=120)
        raise AssertionError(f"{exc}\nlauncher:\n{out[-4000:]}") from None


def cli(clouds, state, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**clouds["env"], "DILOCO_STATE_DIR": str(state)})


def test_one_run_across_four_backends_survives_a_killed_replica_and_ends_bit_identical(tmp_path, s3, clouds):
    state = tmp_path / "state"
    spec = four_clouds_spec(tmp_path, s3, clouds, steps=160, sync_every=20,
                            restart="backoff = 0.2\nmax_restarts_per_rank = 3")
    dry = cli(clouds, state, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    for title in ("# group here: 1 × local, rank 0", "# group k8s: 1 × eks, rank 1",
                  "# group sm: 1 × sagemaker, rank 2", "# group modal: 1 × modal, rank 3"):
        assert title in dry.stdout
    assert "testing" not in dry.stdout.replace("diloco_sagemaker.testing", "").replace("diloco_modal.testing", "")
    priced = {line.split()[0]: line for line in dry.stderr.splitlines() if line.startswith("    ") and " × " in line}
    assert "cross-region" in priced["k8s"] and "same-region" in priced["sm"] and "internet" in priced["modal"]

    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**clouds["env"], "DILOCO_STATE_DIR": str(state)})
    first = launcher.stdout.readline()
    assert "here 1 × local, k8s 1 × eks, sm 1 × sagemaker, modal 1 × modal" in first, first
    run_id = first.split()[1].rstrip(":")
    waited(launcher, lambda: wait_for_round(state, run_id, 2, timeout=150))
    handles = {r["rank"]: r["handle"] for r in record_of(state, run_id)["ranks"]}
    assert [handles[r]["backend_name"] for r in range(4)] == ["local", "eks", "sagemaker", "modal"]
    job = handles[1]["metadata"]["job"]
    assert clouds["k8s"].kill_pod(job, 0, signal.SIGKILL) or clouds["k8s"].kill_pod(job, 1, signal.SIGKILL)
    out, _ = launcher.communicate(timeout=900)
    assert launcher.returncode == 0, out

    record = record_of(state, run_id)
    one_global_model(record)  # every replica of every group holds the same θ
    ranks = record["ranks"]
    assert [r["group"] for r in ranks] == ["here", "k8s", "sm", "modal"]
    assert [r["restarts"] for r in ranks] == [0, 1, 0, 0]
    relaunched = [h["backend_name"] for h in ranks[1]["attempts"]]
    assert relaunched == ["eks", "eks"] and ranks[1]["handle"]["metadata"]["job"].endswith("-r1-a1")
    failed = [e for e in events_of(state, run_id) if e["event"] == "failed"]
    assert [(e["rank"], e["group"]) for e in failed] == [(1, "k8s")]
    logs = cli(clouds, state, "logs", run_id, "--rank", "1", "--attempt", "1", "-n", "2000").stdout
    joined = [line for line in logs.splitlines() if "joined at round" in line]
    assert joined and int(joined[-1].split("joined at round ")[1].split()[0]) >= 2, logs[-2000:]

    status = cli(clouds, state, "status", run_id, "--json")
    view = json.loads(status.stdout)
    assert {row["group"] for row in view["timeline"]} == {"here", "k8s", "sm", "modal"}
    # each group: the members it had in the run's last round, of its replicas (on a loaded machine a slow
    # replica may miss the last round: the others wait for it only the grace window)
    last = [e for e in events_of(state, run_id) if e["event"] == "round"][-1]
    in_last = {g: int(r in last["members"]) for r, g in enumerate(["here", "k8s", "sm", "modal"])}
    assert view["progress"]["groups"] == {g: [in_last[g], 1] for g in in_last} and sum(in_last.values()) >= 1
    timeline = cli(clouds, state, "status", run_id, "--timeline").stdout
    assert "group" in timeline and "modal" in timeline
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=f"runs/{run_id}/")["Contents"]]
    assert any("/reduced/" in k for k in keys)  # they met in S3


def test_cancel_from_another_shell_stops_every_group(tmp_path, s3, clouds):
    state = tmp_path / "state"
    spec = four_clouds_spec(tmp_path, s3, clouds, steps=4000, sync_every=20)
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", str(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**clouds["env"], "DILOCO_STATE_DIR": str(state)})
    run_id = launcher.stdout.readline().split()[1].rstrip(":")
    waited(launcher, lambda: wait_for_round(state, run_id, 1, timeout=150))
    proc = cli(clouds, state, "cancel", run_id)
    assert proc.returncode == 0 and "cancelled run" in proc.stdout, proc.stderr
    launcher.communicate(timeout=300)
    assert record_of(state, run_id)["state"] == "STOPPED"
    # SageMaker takes a while to stop a job (Stopping reads as still running, as on the service)
    deadline = time.monotonic() + 90
    while True:
        live = json.loads(cli(clouds, state, "status", run_id, "--json").stdout)["live"]
        if set(live.values()) <= {"cancelled", "failed", "succeeded"} or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert set(live.values()) <= {"cancelled", "failed", "succeeded"}, live  # no group left running
    assert len(live) == 4
    job = next(r for r in record_of(state, run_id)["ranks"] if r["group"] == "sm")["handle"]["metadata"]["job"]
    assert clouds["sm"].job(job)["TrainingJobStatus"] == "Stopped"  # StopTrainingJob, not a failure
    # (the `clouds` fixture then checks that no replica process is left on any stand-in)


def test_the_clouds_example_prices_each_group_by_where_it_runs(tmp_path):
    """examples/tiny-lm/diloco-clouds.toml: its dry run shows each group's plan and its price."""
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(ROOT / "examples" / "tiny-lm" /
                                                                         "diloco-clouds.toml")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DILOCO_STATE_DIR": str(tmp_path / "state"), "AWS_REGION": "us-east-1",
                               "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "example-secret-value"})
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("# group")] == [
        "# group k8s: 2 × eks (A10G), ranks 0-1", "# group sm: 2 × sagemaker (T4), ranks 2-3",
        "# group modal: 2 × modal (T4), ranks 4-5"]
    priced = {line.split()[0]: line for line in proc.stderr.splitlines() if line.startswith("    ") and " × " in line}
    assert "same-region" in priced["k8s"] and "cross-region (us-west-2" in priced["sm"] and "internet" in priced["modal"]
    assert "example-secret-value" not in proc.stdout + proc.stderr
    # the AWS keys are the Modal group's alone (`secrets = []` in the others: their role reaches the bucket)
    sections = dict(zip(("k8s", "sm", "modal"), proc.stdout.split("# group ")[1:]))
    assert "AWS_ACCESS_KEY_ID" in sections["modal"]
    assert "AWS_ACCESS_KEY_ID" not in sections["k8s"] and "AWS_ACCESS_KEY_ID" not in sections["sm"]
