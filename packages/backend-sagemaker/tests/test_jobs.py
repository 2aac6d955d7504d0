"""What a user of the sagemaker backend sees, through real boto3 → the training-job control plane
(diloco_sagemaker.testing) and a moto server for S3, CloudWatch Logs, IAM and Secrets Manager."""

from __future__ import annotations

import json
import signal
import time

import boto3
import pytest


from conftest import ROLE
from diloco.errors import UserError
from diloco.protocol import ReplicaStatus
from diloco.testing import SLEEP, launch, plan_for, wait_for_output
from diloco.testing import wait_for_status as wait_for
from diloco_sagemaker.executor import SageMakerExecutor

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:test"
TRAIN = '''import hashlib, os, time


def main(ctx, seconds=0.0, version="v1"):
    token = os.environ.get("HF_TOKEN", "")
    print(f"training {version} rank={ctx.rank} token_sha={hashlib.sha256(token.encode()).hexdigest()[:12]} "
          f"db={os.environ.get('DB_PASSWORD', '')[:2]}", flush=True)
    time.sleep(float(seconds))
    return {"version": version, "rank": ctx.rank, "cwd": os.getcwd()}
'''


def executor(**kw) -> SageMakerExecutor:
    return SageMakerExecutor(**{"role": ROLE, "image": IMAGE, "s3_prefix": "s3://diloco-sm/sagemaker", **kw})




def client(service: str):
    """A client of the launcher's shell: the control plane's endpoints, the launcher's IAM user."""
    return boto3.session.Session().client(service)


def admin(plane, service: str):
    """moto directly, as the account's administrator (what the launcher may not do)."""
    return boto3.session.Session().client(service, endpoint_url=plane.config["aws_endpoint"], region_name="us-east-1",
                                          aws_access_key_id="testing", aws_secret_access_key="testing")


def job_name(handle) -> str:
    return handle.metadata["job"]


@pytest.fixture
def workdir(tmp_path):
    d = tmp_path / "project"
    d.mkdir()
    (d / "mytrain.py").write_text(TRAIN)
    (d / ".venv").mkdir()
    (d / ".venv" / "huge.bin").write_bytes(b"0" * 1000)  # never shipped
    return d


def test_a_spot_interruption_waits_and_comes_back_without_failing(sagemaker):
    ex = executor(spot=True)
    (h,) = launch(ex, 1, SLEEP, {"seconds": 4}, run_id="spot-1", timeout=600)
    assert "sleeping" in wait_for_output(ex, h, "sleeping")  # the replica is training
    assert sagemaker.interrupt(job_name(h))
    seen, details = set(), set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = ex.poll(h)
        seen.add(status.value)
        if status is ReplicaStatus.PENDING:
            details.add(ex.status_detail(h) or "")
        if status.is_terminal:
            break
        time.sleep(0.05)
    assert status is ReplicaStatus.SUCCEEDED and {"pending", "running"} <= seen
    assert any(d.startswith("Interrupted: spot capacity was reclaimed") for d in details), details
    job = client("sagemaker").describe_training_job(TrainingJobName=job_name(h))
    assert [t["Status"] for t in job["SecondaryStatusTransitions"]].count("Training") == 2
    assert ex.stream_logs(h).count("rank 0 sleeping 4") == 2  # both instance starts, two log streams


def test_the_workdir_and_secrets_reach_the_container_but_not_the_job_description(sagemaker, workdir, monkeypatch):
    sm = admin(sagemaker, "secretsmanager")
    try:
        sm.create_secret(Name="prod/db", SecretString=json.dumps({"password": "pw-from-secrets-manager"}))
    except sm.exceptions.ResourceExistsException:
        pass
    ex = executor(secret_refs={"DB_PASSWORD": "prod/db#password"})
    token = "hf-token-value-0123456789"
    reach_moto = {"AWS_ENDPOINT_URL": sagemaker.config["aws_endpoint"]}  # a real container reaches AWS itself
    handles = launch(ex, 2, "mytrain:main", {"version": "v1"}, run_id="code-1", timeout=600,
                     secret_env={"HF_TOKEN": token}, env=reach_moto, workdir=str(workdir))
    results = ex.collect(handles, timeout=90)
    assert [r.status for r in results] == ["succeeded", "succeeded"], [r.error for r in results]
    assert results[1].result["version"] == "v1" and results[1].result["cwd"].endswith("opt-ml/code")
    import hashlib

    logs = ex.stream_logs(handles[0])
    assert f"token_sha={hashlib.sha256(token.encode()).hexdigest()[:12]}" in logs and "db=pw" in logs
    described = json.dumps(client("sagemaker").describe_training_job(TrainingJobName=job_name(handles[0])),
                           default=str)
    assert token not in described and "pw-from-secrets-manager" not in described
    keys = [o["Key"] for o in client("s3").list_objects_v2(Bucket="diloco-sm", Prefix="sagemaker/code-1/code/")
            ["Contents"]]
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["bootstrap.py", "secretsreader.py", "source.tar.gz"]
    # a relaunch runs the code the run started with, even after the workdir changed
    (workdir / "mytrain.py").write_text(TRAIN.replace('version="v1"', 'version="v2"'))
    again = launch(ex, 2, "mytrain:main", {}, run_id="code-1", ranks=[1], attempt=1, timeout=600,
                   secret_env={"HF_TOKEN": token}, env=reach_moto, workdir=str(workdir))
    (result,) = ex.collect(again, timeout=90)
    assert result.status == "succeeded" and (result.result["version"], result.result["rank"]) == ("v1", 1)


def test_submit_sends_exactly_the_plan_with_secret_values_only_in_secrets_manager(sagemaker, workdir):
    ex = executor()
    token = "hf-token-value-plan-0123456"
    reach_moto = {"AWS_ENDPOINT_URL": sagemaker.config["aws_endpoint"]}  # the container reads the secret there
    fields = dict(run_id="exact-1", timeout=600, secret_env={"HF_TOKEN": token}, env={"PLAIN": "shown", **reach_moto},
                  workdir=str(workdir))
    planned = plan_for(ex, 2, SLEEP, {"seconds": 0}, **fields)
    assert token not in planned.render() and "shown" in planned.render()
    handles = ex.submit(planned)
    assert [h.rank for h in handles] == [0, 1]
    assert [sagemaker.received(h.metadata["job"]) for h in handles] == planned.body["jobs"]  # the plan, verbatim
    secret = admin(sagemaker, "secretsmanager").get_secret_value(SecretId=planned.body["secrets_manager"]["secret"])
    assert json.loads(secret["SecretString"]) == {"HF_TOKEN": token}  # the values go here, and only here
    bucket, _, prefix = planned.body["code"]["s3_uri"].removeprefix("s3://").partition("/")
    keys = [o["Key"] for o in client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["bootstrap.py", "secretsreader.py", "source.tar.gz"]
    results = ex.collect(handles, timeout=90)
    assert [r.status for r in results] == ["succeeded", "succeeded"], [r.error for r in results]
    # a relaunch plan submits exactly its own jobs, handles in the request's rank order
    again = plan_for(ex, 2, SLEEP, {"seconds": 0}, **{**fields, "ranks": [1, 0], "attempt": 1})
    relaunched = ex.submit(again)
    assert [(h.rank, h.attempt) for h in relaunched] == [(1, 1), (0, 1)]
    assert [sagemaker.received(h.metadata["job"]) for h in relaunched] == again.body["jobs"]
    assert sagemaker.received("exact-1-r0-a2") is None
    results = ex.collect(relaunched, timeout=90)
    assert [r.status for r in results] == ["succeeded", "succeeded"], [r.error for r in results]


def test_kill_timeout_and_stop_read_as_a_user_expects(sagemaker):
    ex = executor()
    killed, late, stopped = (launch(ex, 1, SLEEP, {"seconds": 60}, run_id=f"end-{i}", timeout=t)[0]
                             for i, t in ((1, 600), (2, 4), (3, 600)))
    for h in (killed, stopped):
        assert wait_for(ex, h, {"running"}) == "running"
    assert sagemaker.kill(job_name(killed), signal.SIGKILL)
    ex.cancel(stopped)
    ex.cancel(stopped)  # idempotent
    res_killed, res_late, res_stopped = ex.collect([killed, late, stopped], timeout=90)
    assert res_killed.status == "failed" and res_killed.exit_code == 137
    assert res_killed.error.splitlines()[0] == f"killed by SIGKILL (exit code 137) in {job_name(killed)}"
    assert res_late.status == "failed" and res_late.exit_code == 124
    assert "ran past the spec's timeout" in res_late.error.splitlines()[0]
    assert res_stopped.status == "cancelled"
    assert client("sagemaker").describe_training_job(TrainingJobName=job_name(stopped))[
        "TrainingJobStatus"] == "Stopped"


def test_logs_before_the_stream_exists_are_a_readable_placeholder(sagemaker):
    ex = executor()
    (h,) = launch(ex, 1, SLEEP, {"seconds": 30}, run_id="logs-1", timeout=600)
    text = ex.stream_logs(h)
    if "sleeping" not in text:  # the instance may already have started
        assert text.startswith(f"(no output yet from {job_name(h)}") and "/aws/sagemaker/TrainingJobs" in text
    ex.cancel(h)
    assert wait_for(ex, h, {"cancelled"}) == "cancelled"


def test_a_role_sagemaker_cannot_assume_is_one_line(sagemaker):
    ex = executor(role="arn:aws:iam::123456789012:role/no-trust")
    with pytest.raises(UserError, match="SageMaker cannot assume role arn:aws:iam::123456789012:role/no-trust: its "
                                        "trust policy must allow sagemaker.amazonaws.com"):
        launch(ex, 1, SLEEP, run_id="role-1")


def test_access_denied_names_the_action(sagemaker):
    sagemaker.deny("CreateTrainingJob")
    with pytest.raises(UserError, match="AWS denied CreateTrainingJob .* not authorized to perform: "
                                        "sagemaker:CreateTrainingJob"):
        launch(executor(), 1, SLEEP, run_id="deny-1")


def test_a_quota_at_rank_1_stops_rank_0_and_names_the_instance_type(sagemaker):
    sagemaker.quota("ml.g5.xlarge", 1)
    ex = executor()
    with pytest.raises(UserError) as err:
        launch(ex, 2, SLEEP, {"seconds": 60}, run_id="quota-1", gpu="A10G", timeout=600)
    text = str(err.value)
    assert text.startswith("launching rank 1 on SageMaker failed: SageMaker quota reached for ml.g5.xlarge")
    assert "'ml.g5.xlarge for training job usage' is 1 Instances" in text and "Service Quotas" in text
    assert "the 1 job(s) already started were cancelled" in text  # diloco.submitting's words: StopTrainingJob
    deadline = time.monotonic() + 30
    while sagemaker.job("quota-1-r0-a0")["TrainingJobStatus"] != "Stopped" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sagemaker.job("quota-1-r0-a0")["TrainingJobStatus"] == "Stopped"


def test_no_credentials_is_one_line(sagemaker, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(UserError, match="no AWS credentials found: run `aws configure`"):
        launch(executor(), 1, SLEEP, run_id="creds-1")


def test_other_aws_errors_surface_as_backend_errors(sagemaker):
    ex = executor()
    (h,) = launch(ex, 1, SLEEP, {"seconds": 30}, run_id="dup-1", timeout=600)
    with pytest.raises(UserError, match="SageMaker rejected CreateTrainingJob .* already exists"):
        launch(ex, 1, SLEEP, run_id="dup-1")  # the same job name twice
    ex.cancel(h)
    assert wait_for(ex, h, {"cancelled"}) == "cancelled"
    sagemaker.deny("StopTrainingJob")
    (h2,) = launch(ex, 1, SLEEP, {"seconds": 5}, run_id="dup-2", timeout=600)
    assert wait_for(ex, h2, {"running"}) == "running"
    with pytest.raises(UserError, match="AWS denied StopTrainingJob"):
        ex.cancel(h2)  # a real error on cancel surfaces; only an already-ended job is quiet
    assert ex.collect([h2], timeout=60)[0].status == "succeeded"
