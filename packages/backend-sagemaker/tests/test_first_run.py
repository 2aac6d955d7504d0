"""What a first real run on SageMaker would have hit (issue 23), each through the strict stand-in
and the real boto3 client: every test here failed on the code before the fix."""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time
import types

import boto3
import pytest

from conftest import ROLE, needs_replica
from diloco.protocol import ReplicaHandle, ReplicaStatus
from diloco.testing import SLEEP, launch
from diloco_sagemaker.executor import SageMakerExecutor

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:test"
OFFICIAL = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-cpu-py311-ubuntu22.04-sagemaker"
ECHO = '''import os


def main(ctx, note=""):
    return {"note": len(note), "env": len(os.environ.get("NOTE", "")), "args": len(os.environ["DILOCO_ENTRYPOINT_ARGS"])}
'''


def executor(**kw) -> SageMakerExecutor:
    return SageMakerExecutor(**{"role": ROLE, "image": IMAGE, "s3_prefix": "s3://diloco-sm/sagemaker", **kw})


def until(check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("never happened")


def test_a_timeout_reads_running_while_stopping_then_failed_124(sagemaker):
    """MaxRuntime: Training → Stopping → Stopped/MaxRuntimeExceeded. Stopping read as cancelled
    used to cancel the whole run; only the stop diloco asked for reads cancelled."""
    ex = executor()
    late, stopped = (launch(ex, 1, SLEEP, {"seconds": 60}, run_id=f"stop-{i}", timeout=600)[0] for i in (1, 2))
    for h in (late, stopped):
        until(lambda h=h: ex.poll(h) is ReplicaStatus.RUNNING)
    assert sagemaker.expire(late.metadata["job"])
    seen = []
    while not (status := ex.poll(late)).is_terminal:
        seen.append((sagemaker.job(late.metadata["job"])["TrainingJobStatus"], status.value))
        time.sleep(0.05)
    assert ("Stopping", "running") in seen and all(s != "cancelled" for _, s in seen), seen
    (result,) = ex.collect([late], timeout=0)
    assert result.status == "failed" and result.exit_code == 124
    assert result.error.startswith(f"{late.metadata['job']} ran past the spec's timeout (MaxRuntimeInSeconds)")
    ex.cancel(stopped)  # diloco's own stop: cancelled from Stopping on
    assert until(lambda: sagemaker.job(stopped.metadata["job"])["TrainingJobStatus"] == "Stopping", 10)
    assert ex.poll(stopped) is ReplicaStatus.CANCELLED
    assert until(lambda: ex.poll(stopped) is ReplicaStatus.CANCELLED and
                 sagemaker.job(stopped.metadata["job"])["TrainingJobStatus"] == "Stopped")


def test_long_entrypoint_args_ship_with_the_code_and_every_environment_value_fits(sagemaker, tmp_path):
    (tmp_path / "echo.py").write_text(ECHO)
    ex = executor()
    note = "n" * 600  # DILOCO_ENTRYPOINT_ARGS ≈ 615 characters, NOTE = 600: over SageMaker's 512
    (h,) = launch(ex, 1, "echo:main", {"note": note}, run_id="long-1", timeout=600, workdir=str(tmp_path))
    (result,) = ex.collect([h], timeout=120)
    assert result.status == "succeeded", result.error
    assert result.result["note"] == 600 and result.result["env"] == 600 and result.result["args"] > 512
    env = sagemaker.received(h.metadata["job"])["Environment"]
    assert max(len(v) for v in env.values()) <= 512 and "NOTE" not in env and env["DILOCO_ENV_FILE"].startswith("env-")


@pytest.fixture
def lagging(tmp_path, aws, monkeypatch):
    """A control plane whose reads lag 3 s behind CreateTrainingJob."""
    from diloco_sagemaker.testing import FakeSageMaker

    with FakeSageMaker(tmp_path / "lag", aws_endpoint=aws["env"]["AWS_ENDPOINT_URL"], not_found_seconds=3.0,
                       grace_seconds=2.0, step_seconds=0.1) as plane:
        for k, v in plane.env.items():
            monkeypatch.setenv(k, v)
        yield plane
        until(lambda: not plane.live_processes(), 30)


def test_a_job_not_shown_yet_is_pending_and_cancel_still_stops_it(lagging):
    ex = executor()
    (h,) = launch(ex, 1, SLEEP, {"seconds": 60}, run_id="lag-1", timeout=600)
    assert ex.poll(h) is ReplicaStatus.PENDING  # not FAILED: no second attempt while the first may live
    ex.cancel(h)  # before SageMaker shows the job: asked again until it does
    assert until(lambda: lagging.job(h.metadata["job"])["TrainingJobStatus"] == "Stopped", 30)
    gone = ReplicaHandle(0, "sagemaker", {**h.metadata, "job": "never-created-r0-a0", "created": time.time() - 3600})
    assert ex.poll(gone) is ReplicaStatus.FAILED  # past the grace period: truly gone, and said so
    (result,) = ex.collect([gone], timeout=0)
    assert result.error.startswith("the training job never-created-r0-a0 is gone: SageMaker does not know it")


def test_throttling_beyond_the_retries_answers_the_last_status(sagemaker, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    ex = executor()
    (h,) = launch(ex, 1, SLEEP, {"seconds": 8}, run_id="throttle-1", timeout=600)
    until(lambda: ex.poll(h) is ReplicaStatus.RUNNING)
    sagemaker.throttle("DescribeTrainingJob", 1000)
    assert [ex.poll(h) for _ in range(2)] == [ReplicaStatus.RUNNING] * 2  # never raises, never invents an ending
    assert "throttling" in ex.status_detail(h)
    sagemaker.throttle("DescribeTrainingJob", 0)
    assert ex.collect([h], timeout=60)[0].status == "succeeded"


def test_secrets_resolve_in_an_image_without_boto3_and_a_missing_one_is_one_line(sagemaker):
    admin = boto3.session.Session().client("secretsmanager", endpoint_url=sagemaker.config["aws_endpoint"],
                                           aws_access_key_id="testing", aws_secret_access_key="testing")
    admin.create_secret(Name="prod/db-nob3", SecretString=json.dumps({"password": "pw-123"}))
    reach_moto = {"AWS_ENDPOINT_URL": sagemaker.config["aws_endpoint"]}
    ok = executor(secret_refs={"DB_PASSWORD": "prod/db-nob3#password"})
    (h,) = launch(ok, 1, SLEEP, {"seconds": 0}, run_id="nob3-1", timeout=600, env=reach_moto)
    assert ok.collect([h], timeout=90)[0].status == "succeeded"
    missing = executor(secret_refs={"DB_PASSWORD": "prod/absent"})
    (h,) = launch(missing, 1, SLEEP, {"seconds": 0}, run_id="nob3-2", timeout=600, env=reach_moto)
    (result,) = missing.collect([h], timeout=90)
    assert result.status == "failed" and result.exit_code == 78
    assert result.error.splitlines()[0].startswith("cannot read secrets ['DB_PASSWORD'] from AWS Secrets Manager "
                                                   "with the job's execution role: SecretsError: "
                                                   "ResourceNotFoundException"), result.error


@needs_replica
def test_the_official_pytorch_image_installs_the_launchers_diloco_without_an_index(sagemaker, monkeypatch):
    core = types.ModuleType("sagemaker.core")
    core.image_uris = types.SimpleNamespace(retrieve=lambda *a, **k: OFFICIAL)
    monkeypatch.setitem(sys.modules, "sagemaker", types.ModuleType("sagemaker"))
    monkeypatch.setitem(sys.modules, "sagemaker.core", core)
    ex = SageMakerExecutor(role=ROLE, pytorch_version="2.8", s3_prefix="s3://diloco-sm/sagemaker")
    (h,) = launch(ex, 1, SLEEP, {"seconds": 0}, run_id="official-1", timeout=600)
    (result,) = ex.collect([h], timeout=180)
    assert result.status == "succeeded", result.error  # the stand-in's containers have no package index
    keys = [o["Key"] for o in boto3.session.Session().client("s3").list_objects_v2(
        Bucket="diloco-sm", Prefix="sagemaker/official-1/code/wheels/")["Contents"]]
    assert any("/diloco_core-" in k for k in keys) and not any("/torch-" in k for k in keys)


def test_credentials_and_keys_never_leave_the_workdir(sagemaker, tmp_path):
    work = tmp_path / "work"
    for rel in ("train.py", "sub/.env", ".env.local", ".aws/credentials", "x/y/id.pem", "x/server.key",
                ".netrc", "data/big.bin", "logs/run.txt", "keep/notes.md"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("secret" if rel != "train.py" else "x = 1\n")
    (work / ".gitignore").write_text("logs/\n")
    ex = executor(ignore=["data/"])
    plan = ex.plan(__import__("diloco.testing", fromlist=["request_for"]).request_for(
        1, SLEEP, {"seconds": 0}, run_id="ship-1", timeout=600, workdir=str(work)))
    assert plan.body["code"]["shipped"]["files"] == 3  # what dryrun shows: train.py, keep/notes.md, .gitignore
    ex.collect(ex.submit(plan), timeout=90)
    body = boto3.session.Session().client("s3").get_object(Bucket="diloco-sm",
                                                            Key="sagemaker/ship-1/code/source.tar.gz")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        names = sorted(tar.getnames())
    assert names == [".gitignore", "keep/notes.md", "train.py"], names
