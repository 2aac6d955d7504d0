"""The CreateTrainingJob request and the DescribeTrainingJob reading, as data (no AWS)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from conftest import ROLE, needs_replica
from diloco.errors import SpecError, UserError
from diloco.plugins.discovery import make_executor
from diloco.protocol import ReplicaStatus
from diloco.testing import plan_for
from diloco_sagemaker import status as st
from diloco_sagemaker.executor import SageMakerExecutor
from diloco_sagemaker.instances import instance_type
from diloco_sagemaker.options import SageMakerOptions
from diloco_sagemaker.trainingjob import job_name

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:1"
RDV = "s3://bucket/runs"


def plan(monkeypatch, n=2, **kw):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    launch = {k: kw.pop(k) for k in ("gpu", "timeout", "env", "secret_env", "processes_per_replica", "ranks",
                                      "attempt", "workdir") if k in kw}
    ex = SageMakerExecutor(**{"role": ROLE, "image": IMAGE, **kw})
    return plan_for(ex, n, "train:main", {"lr": 0.1}, run_id="tiny-lm-20261122-101010-ab12", rendezvous=RDV,
                    **launch).body


@pytest.mark.parametrize("gpu,expected", [
    ("H100", "ml.p5.48xlarge"), ("H100:1", "ml.p5.4xlarge"), ("H100:8", "ml.p5.48xlarge"), ("A100", "ml.p4d.24xlarge"),
    ("a10g", "ml.g5.xlarge"), ("A10G:4", "ml.g5.12xlarge"), ("T4", "ml.g4dn.xlarge"), (None, "ml.m5.xlarge")])
def test_the_gpu_picks_the_instance(gpu, expected):
    assert instance_type(gpu) == expected


@pytest.mark.parametrize("gpu,words", [("H100:2", "choose H100:1 (ml.p5.4xlarge), H100:8 (ml.p5.48xlarge)"), ("B9000", "unknown GPU type"),
                                       ("A10G:3", "A10G:1 (ml.g5.xlarge), A10G:4")])
def test_a_gpu_with_no_instance_is_one_line_naming_the_choices(gpu, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        instance_type(gpu)
    assert instance_type(gpu, "ml.p5e.48xlarge") == "ml.p5e.48xlarge"  # the override always wins


def test_job_names_are_valid_unique_and_say_rank_and_attempt():
    assert job_name("tiny-lm-20261122-101010-ab12", 3, 1) == "tiny-lm-20261122-101010-ab12-r3-a1"
    long_a, long_b = "a" * 30 + "-20261122-101010-ab12", "a" * 30 + "-20261122-101010-cd34"
    a, b = job_name(long_a, 12, 3), job_name(long_b, 12, 3)
    assert len(a) <= 63 and a.endswith("-r12-a3") and a != b
    from diloco.runrecord.state import new_run_id  # 63 characters, 64 random bits at the end: the part a name cuts

    ids = {new_run_id("a-long-model-name-for-a-big-sweep-run") for _ in range(20_000)}
    assert len({job_name(run_id, 255, 99) for run_id in ids}) == len(ids) == 20_000


def test_one_job_per_replica_with_everything_the_spec_says(monkeypatch):
    req = plan(monkeypatch, gpu="H100:8", processes_per_replica=8, timeout=7200, spot=True, max_wait=10800,
               subnets=["subnet-1"], security_groups=["sg-1"], tags={"team": "llm"}, volume_size_gb=500)
    assert req["region"] == "eu-west-1" and len(req["jobs"]) == 2
    job = req["jobs"][1]
    assert job["TrainingJobName"] == "tiny-lm-20261122-101010-ab12-r1-a0" and job["RoleArn"] == ROLE
    assert job["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 500}
    assert job["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 10800}
    assert job["EnableManagedSpotTraining"] is True
    assert job["VpcConfig"] == {"Subnets": ["subnet-1"], "SecurityGroupIds": ["sg-1"]}
    algo = job["AlgorithmSpecification"]
    assert algo["TrainingImage"] == IMAGE
    assert algo["ContainerEntrypoint"] == ["python", "/opt/ml/input/data/diloco/bootstrap.py"]
    assert algo["ContainerArguments"][:3] == ["python", "-m", "diloco_replica.torchrun"]  # torchrun over 8 GPUs
    assert "--nproc-per-node" in algo["ContainerArguments"] and "8" in algo["ContainerArguments"]
    channel = job["InputDataConfig"][0]
    assert channel["ChannelName"] == "diloco"
    assert channel["DataSource"]["S3DataSource"]["S3Uri"] == \
        "s3://bucket/diloco-sagemaker/tiny-lm-20261122-101010-ab12/code/"
    assert job["OutputDataConfig"]["S3OutputPath"] == "s3://bucket/diloco-sagemaker/tiny-lm-20261122-101010-ab12/output"
    tags = {t["Key"]: t["Value"] for t in job["Tags"]}
    assert tags == {"team": "llm", "diloco-run": "tiny-lm-20261122-101010-ab12", "diloco-rank": "1",
                    "diloco-attempt": "0"}
    env = job["Environment"]
    assert env["REPLICA_RANK"] == "1" and env["DILOCO_REPLICAS"] == "2" and env["DILOCO_RENDEZVOUS"] == RDV
    assert env["AWS_REGION"] == "eu-west-1" and env["LR"] == "0.1" and "WORLD_SIZE" not in env  # torchrun's
    assert "PYTHONPATH" not in env  # the launcher's paths mean nothing on the instance


def test_warm_pools_and_single_process_replicas(monkeypatch):
    job = plan(monkeypatch, n=1, gpu="A10G", keep_alive=1800)["jobs"][0]
    assert job["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 1800
    assert job["AlgorithmSpecification"]["ContainerArguments"] == ["python", "-m", "diloco.bootstrap.runner"]
    assert job["Environment"]["DILOCO_REPLICAS"] == "1" and job["EnableManagedSpotTraining"] is False
    assert "MaxWaitTimeInSeconds" not in job["StoppingCondition"]


def test_secrets_never_reach_the_job_environment(monkeypatch):
    req = plan(monkeypatch, env={"WANDB_API_KEY": "wandb-value-123", "PLAIN": "ok"},
               secret_env={"HF_TOKEN": "hf-value-456"}, secret_refs={"DB_PASSWORD": "prod/db#password"})
    text = json.dumps(req)
    assert "wandb-value-123" not in text and "hf-value-456" not in text
    env = req["jobs"][0]["Environment"]
    assert "HF_TOKEN" not in env and "WANDB_API_KEY" not in env and env["PLAIN"] == "ok"
    assert json.loads(env["DILOCO_SECRETS_MANAGER_REFS"]) == {
        "HF_TOKEN": "diloco/tiny-lm-20261122-101010-ab12#HF_TOKEN",
        "WANDB_API_KEY": "diloco/tiny-lm-20261122-101010-ab12#WANDB_API_KEY", "DB_PASSWORD": "prod/db#password"}
    assert req["secrets_manager"] == {"secret": "diloco/tiny-lm-20261122-101010-ab12",
                                      "forwarded": ["HF_TOKEN", "WANDB_API_KEY"],
                                      "references": {"DB_PASSWORD": "prod/db#password"}}


@pytest.mark.parametrize("kw,words", [
    ({"role": "diloco-role"}, "not an IAM role ARN"),
    ({"spot": True, "keep_alive": 60}, "does not work with spot"),
    ({"keep_alive": 7200}, "`backend.keep_alive` must be at most 3600"),
    ({"subnets": ["subnet-1"]}, "needs both `subnets` and `security_groups`"),
    ({"s3_prefix": "gs://b/p"}, "must be an s3:// URI"),
    ({"image": IMAGE, "pytorch_version": "2.8"}, "not both"),
])
def test_bad_options_are_one_line_naming_the_key(kw, words):
    with pytest.raises(UserError, match=words):
        SageMakerExecutor(**{"role": ROLE, **kw})


@pytest.mark.parametrize("table,key,words", [
    ({"subnets": "subnet-1"}, "subnets", "must be list[str], got 'subnet-1' (a string)"),
    ({"pip": "torch"}, "pip", "must be list[str]"),
    ({"keep_alive": 7200}, "keep_alive", "must be at most 3600"),
    ({"keep_alive": -1}, "keep_alive", "must be at least 0"),
    ({"volume_size_gb": 0}, "volume_size_gb", "must be at least 1"),
    ({"volume_size_gb": 1.5}, "volume_size_gb", "must be int"),
    ({"max_wait": float("inf")}, "max_wait", "must be a finite number"),
    ({"max_wait": float("nan")}, "max_wait", "must be a finite number"),
    ({"spot": "yes"}, "spot", "must be bool"),
    ({"tags": {"team": 1}}, "tags", "must be dict[str, str]"),
    # tags land in run.json and the dry run: a secret-looking key would put its value there
    ({"tags": {"auth": "x"}}, "tags.auth", "looks like a secret"),
    ({"tags": {"WandbApiKey": "x"}}, "tags.WandbApiKey", "looks like a secret"),
    # secret_refs set variables in the container: not the ones replicas need for themselves
    ({"secret_refs": {"PATH": "prod/db#password"}}, "secret_refs.PATH", "sets PATH"),
    ({"secret_refs": {"REPLICA_RANK": "prod/db#password"}}, "secret_refs.REPLICA_RANK", "sets REPLICA_RANK"),
    ({"secret_refs": {"LD_PRELOAD": "prod/db#password"}}, "secret_refs.LD_PRELOAD", "sets LD_PRELOAD"),
    ({"workdir": "."}, "workdir", "unknown key"),  # the code comes from the request's workdir, not an option
])
def test_a_bad_backend_option_is_one_line_naming_the_key(table, key, words):
    with pytest.raises(SpecError) as err:
        make_executor(SageMakerExecutor, {"role": ROLE, **table}, source="spec.toml")
    text = str(err.value)
    assert len(text.splitlines()) == 1 and f"`backend.{key}`" in text and words in text, text


@pytest.mark.parametrize("key", ["s3_prefix", "output_path"])
@pytest.mark.parametrize("uri, secret", [
    ("s3://AKIAEXAMPLEKEY:wJalrXUtnFEMIK7MDENG@bucket/x", "wJalrXUtnFEMIK7MDENG"),
    ("s3://bucket/x?X-Amz-Signature=deadbeefcafe1234", "deadbeefcafe1234"),
])
def test_credentials_in_an_s3_uri_option_are_refused_without_echoing_them(key, uri, secret):
    """From a spec's table and from options built in Python alike: the URI is recorded with the run."""
    with pytest.raises(SpecError) as err:
        make_executor(SageMakerExecutor, {"role": ROLE, key: uri}, source="spec.toml")
    with pytest.raises(UserError) as whole:
        SageMakerExecutor(SageMakerOptions(role=ROLE, **{key: uri}))
    for text in (str(err.value), str(whole.value)):
        assert len(text.splitlines()) == 1 and f"`backend.{key}`" in text and "carries" in text, text
        assert secret not in text and "AKIAEXAMPLEKEY" not in text


def test_secret_refs_may_name_secret_variables():
    """secret_refs maps variable names (HF_TOKEN) to references: those names are what it is for."""
    ex = make_executor(SageMakerExecutor, {"role": ROLE, "image": IMAGE, "secret_refs": {"HF_TOKEN": "prod/hf"}})
    assert ex.options.secret_refs == {"HF_TOKEN": "prod/hf"}


def test_the_executor_declares_its_options_and_capabilities():
    assert SageMakerExecutor.Options is SageMakerOptions
    caps = SageMakerExecutor.capabilities
    assert caps.relaunches_one_rank and caps.process_groups and caps.status_detail
    assert not caps.shares_launcher_filesystem and not caps.inter_replica_network
    given = SageMakerOptions(role=ROLE, image=IMAGE, spot=True)
    assert SageMakerExecutor(given).options is given
    assert SageMakerExecutor(given, spot=False).options.spot is False  # overrides on top, checked again
    built = make_executor(SageMakerExecutor, {"role": ROLE, "image": IMAGE, "keep_alive": 60})
    assert built.options == SageMakerOptions(role=ROLE, image=IMAGE, keep_alive=60)
    with pytest.raises(UserError, match="does not work with spot"):  # check() runs on options given whole too
        SageMakerExecutor(SageMakerOptions(role=ROLE, spot=True, keep_alive=60))


def test_the_workdir_shipped_is_the_requests(monkeypatch, tmp_path):
    (tmp_path / "train.py").write_text("x = 1\n")
    body = plan(monkeypatch, n=1, workdir=str(tmp_path))
    assert body["code"]["s3_uri"] == "s3://bucket/diloco-sagemaker/tiny-lm-20261122-101010-ab12/code/"
    assert body["code"]["workdir"] == str(tmp_path)
    assert body["code"]["shipped"] == {"root": str(tmp_path.resolve()), "files": 1, "bytes": 6,
                                       "largest": [{"path": "train.py", "bytes": 6}], "ignore": []}
    assert plan(monkeypatch, n=1, workdir=str(tmp_path), include_workdir=False)["code"]["workdir"] is None
    assert plan(monkeypatch, n=1)["code"]["workdir"] is None  # no workdir in the request: nothing shipped


def test_relaunching_one_rank_plans_only_that_job(monkeypatch):
    body = plan(monkeypatch, n=4, ranks=[2], attempt=3)
    assert [j["TrainingJobName"] for j in body["jobs"]] == ["tiny-lm-20261122-101010-ab12-r2-a3"]
    env = body["jobs"][0]["Environment"]
    assert env["REPLICA_RANK"] == "2" and env["DILOCO_REPLICAS"] == "4"


def test_a_dry_run_without_a_role_plans_but_submitting_needs_one(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    ex = SageMakerExecutor(image=IMAGE)
    planned = plan_for(ex, 1, "train:main", rendezvous=RDV, run_id="norole-1")
    assert planned.body["jobs"][0]["RoleArn"].startswith("<[backend] role")
    with pytest.raises(UserError, match=r"\[backend\] role is needed"):
        ex.submit(planned)  # before any AWS call: no credentials are needed to get this far


@pytest.mark.parametrize("kw,launch,words", [
    ({"spot": True, "max_wait": 100}, {"timeout": 3600}, "max_wait .* must be at least the timeout"),
    ({"max_wait": 100}, {}, "only applies with spot"),
    ({}, {"timeout": 40 * 24 * 3600}, "outside SageMaker's MaxRuntimeInSeconds"),
    ({}, {"env": {"BIG": "x" * 2000}}, r"\[env\] BIG is 2000 characters; SageMaker allows at most 512"),
    ({}, {"env": {"BIG": "x" * 600}}, r"\[env\] BIG is 600 characters; SageMaker allows at most 512"),  # 513-1024
    ({"tags": {"team": "llm!"}}, {}, r"SageMaker would refuse rank 0's CreateTrainingJob: Value 'llm!' at "
                                    r"'tags.1.member.value' failed to satisfy constraint: Member must satisfy regular "
                                    r"expression pattern"),
])
def test_bad_launches_are_one_line(monkeypatch, kw, launch, words):
    with pytest.raises(UserError, match=words):
        plan(monkeypatch, **kw, **launch)


def test_no_region_is_one_line(monkeypatch, tmp_path):
    for k in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(UserError, match="no AWS region: set \\[backend\\] region"):
        plan_for(SageMakerExecutor(role=ROLE, image=IMAGE), 1, "train:main", rendezvous=RDV)


def test_no_s3_prefix_without_an_s3_rendezvous(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(UserError, match="s3_prefix is needed"):
        plan_for(SageMakerExecutor(role=ROLE, image=IMAGE), 1, "train:main", rendezvous="gs://b/runs")


@needs_replica
def test_the_official_pytorch_image_through_the_images_extra(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    ex = SageMakerExecutor(role=ROLE, pytorch_version="2.8", py_version="py312")
    monkeypatch.setitem(sys.modules, "sagemaker.core.image_uris", None)  # the extra is not installed
    monkeypatch.setitem(sys.modules, "sagemaker.core", None)
    with pytest.raises(UserError, match=r"pip install 'diloco-backend-sagemaker\[images\]'"):
        plan_for(ex, 1, "train:main", rendezvous=RDV, gpu="H100")
    calls = []
    core = types.ModuleType("sagemaker.core")
    core.image_uris = types.SimpleNamespace(retrieve=lambda *a, **k: calls.append((a, k)) or "763.dkr/pytorch:2.8")
    monkeypatch.setitem(sys.modules, "sagemaker", types.ModuleType("sagemaker"))
    monkeypatch.setitem(sys.modules, "sagemaker.core", core)
    job = plan_for(ex, 1, "train:main", rendezvous=RDV, gpu="H100").body["jobs"][0]
    assert job["AlgorithmSpecification"]["TrainingImage"] == "763.dkr/pytorch:2.8"
    assert calls == [(("pytorch", "us-west-2"), {"version": "2.8", "py_version": "py312",
                                                  "instance_type": "ml.p5.48xlarge", "image_scope": "training"})]
    installs = json.loads(job["Environment"]["DILOCO_WHEELS"])  # the official image has no diloco: shipped
    assert [p.split("==")[0] for p in installs] == ["diloco-core", "diloco-replica"]
    assert "DILOCO_PIP_INSTALL" not in job["Environment"]  # nothing from an index


def official_image(monkeypatch, uri: str) -> None:
    core = types.ModuleType("sagemaker.core")
    core.image_uris = types.SimpleNamespace(retrieve=lambda *a, **k: uri)
    monkeypatch.setitem(sys.modules, "sagemaker", types.ModuleType("sagemaker"))
    monkeypatch.setitem(sys.modules, "sagemaker.core", core)


@pytest.mark.parametrize("py_version,uri", [("py310", "763.dkr/pytorch-training:2.1.0-gpu-py310"),
                                            (None, "763.dkr/pytorch-training:2.1.0-gpu-py310-cu121-ubuntu20.04")])
def test_an_official_image_whose_python_cannot_hold_diloco_is_refused_at_plan_time(monkeypatch, py_version, uri):
    official_image(monkeypatch, uri)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    ex = SageMakerExecutor(role=ROLE, pytorch_version="2.1", py_version=py_version)
    with pytest.raises(UserError) as err:
        plan_for(ex, 1, "train:main", rendezvous=RDV)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and "with Python 3.10 cannot install diloco-" in text and "py311" in text, text


@needs_replica
def test_the_official_image_plan_lists_the_wheels_shipped_and_installs_them_without_an_index(monkeypatch):
    official_image(monkeypatch, "763.dkr/pytorch-training:2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    body = plan_for(SageMakerExecutor(role=ROLE, pytorch_version="2.8"), 1, "train:main", rendezvous=RDV).body
    wheels = body["code"]["wheels"]
    files = [w["file"] for w in wheels["files"]]
    assert wheels["python"] == "3.12" and files[0].startswith("diloco_core-") and files[1].startswith("diloco_replica-")
    assert not any(f.startswith(("torch-", "numpy-")) for f in files)  # the image holds them
    env = body["jobs"][0]["Environment"]
    assert json.loads(env["DILOCO_WHEELS"]) == wheels["install"] and "DILOCO_PIP_INSTALL" not in env


def test_launcher_values_over_512_characters_ship_in_a_file_and_the_version_stays(monkeypatch):
    body = plan(monkeypatch, n=2, env={"PLAIN": "ok"})
    assert body["code"]["env_files"] == {}
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    ex = SageMakerExecutor(role=ROLE, image=IMAGE)
    long = plan_for(ex, 2, "train:main", {"prompt": "p" * 700}, run_id="long-args-1", rendezvous=RDV).body
    (name, values), = long["code"]["env_files"].items()
    assert set(values) == {"PROMPT", "DILOCO_ENTRYPOINT_ARGS"} and len(values["PROMPT"]) == 700
    for job in long["jobs"]:  # both ranks share the file: the values are the same
        env = job["Environment"]
        assert env["DILOCO_ENV_FILE"] == name and max(map(len, env.values())) <= 512
        assert env["DILOCO_VERSION"].startswith("diloco-core==")  # core's check of the replica's diloco


def test_no_image_is_one_line(monkeypatch):
    with pytest.raises(UserError, match="image is needed"):
        plan(monkeypatch, image=None)


def job(status, secondary, **kw):
    return {"TrainingJobName": "j-r0-a0", "TrainingJobStatus": status, "SecondaryStatus": secondary, **kw}


@pytest.mark.parametrize("status,secondary,expected", [
    ("InProgress", "Starting", "pending"), ("InProgress", "LaunchingMLInstances", "pending"),
    ("InProgress", "Downloading", "pending"), ("InProgress", "Interrupted", "pending"),
    ("InProgress", "Restarting", "pending"), ("InProgress", "Pending", "pending"),
    ("InProgress", "Training", "running"), ("InProgress", "Uploading", "running"),
    ("Completed", "Completed", "succeeded"), ("Failed", "Failed", "failed"),
    ("Stopping", "Stopping", "running"), ("Stopped", "Stopped", "cancelled"),
    ("Stopped", "MaxRuntimeExceeded", "failed"), ("Stopped", "MaxWaitTimeExceeded", "failed"),
])
def test_statuses_map_onto_the_protocol(status, secondary, expected):
    assert st.replica_status(job(status, secondary)) == ReplicaStatus(expected)


def test_a_spot_interruption_reads_as_waiting_with_the_reason():
    j = job("InProgress", "Interrupted", SecondaryStatusTransitions=[{"Status": "Training"}, {"Status": "Interrupted"}])
    assert st.detail(j).startswith("Interrupted: spot capacity was reclaimed")
    assert "spot interruptions so far: 1" in st.detail(j)
    assert st.detail(job("InProgress", "Training")) is None


def test_a_job_stopped_from_outside_says_by_what_and_a_timed_out_one_is_not_cancelled():
    assert "was stopped by a StopTrainingJob call" in st.detail(job("Stopped", "Stopped"))
    assert st.detail(job("Stopped", "MaxRuntimeExceeded")) is None


def test_failures_read_cause_first_with_the_replicas_exit_code():
    own = job("Failed", "Failed", FailureReason="AlgorithmError: exit code 78: store s3://b/r ignores create-only puts")
    assert st.exit_code(own) == 78 and st.failure_cause(own) == "store s3://b/r ignores create-only puts"
    bare = job("Failed", "Failed", FailureReason="AlgorithmError: , exit code: 137")
    assert st.exit_code(bare) == 137 and st.failure_cause(bare) == "killed by SIGKILL (exit code 137) in j-r0-a0"
    late = job("Stopped", "MaxRuntimeExceeded")
    assert st.exit_code(late) == 124 and "ran past the spec's timeout" in st.failure_cause(late)
    other = job("Failed", "Failed", FailureReason="CapacityError: Unable to provision requested ML compute capacity.")
    assert st.exit_code(other) is None and st.failure_cause(other).startswith("CapacityError")


def test_listing_backends_does_not_import_boto3():
    import subprocess

    code = ("import sys; from diloco.plugins.discovery import backends; names = list(backends()); "
            "print('sagemaker' in names, 'boto3' in sys.modules, 'botocore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "False"], out.stdout + out.stderr


@pytest.mark.skipif(not __import__("os").environ.get("DILOCO_ISOLATED_ENV"),
                    reason="needs the isolated sagemaker environment")
@pytest.mark.parametrize("module", ["torch", "numpy", "diloco_replica", "kubernetes", "modal", "sagemaker"])
def test_installing_core_and_this_backend_pulls_no_torch(module):
    import importlib.util

    assert importlib.util.find_spec(module) is None
