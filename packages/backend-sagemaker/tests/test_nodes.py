"""Replicas of several instances (`nodes = K`): one training job of InstanceCount K, each instance
told its node by the bootstrap from its own resourceconfig.json; the stand-in runs each instance
as its own container and fails the job when one fails. (A K-node replica of real replica
processes, killed and relaunched: tests/test_sagemaker_e2e.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from botocore.exceptions import ClientError

from conftest import ROLE
from diloco.errors import UserError
from diloco.procgroup import node_env, replica_command
from diloco.protocol import ReplicaHandle, ReplicaStatus
from diloco.testing import plan_for
from diloco_sagemaker import bootstrap
from diloco_sagemaker.executor import SageMakerExecutor
from diloco_sagemaker.testing import containers
from test_standin import request, sm, wait_status

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:1"


def jobs(monkeypatch, n=2, **kw) -> list[dict]:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    options = {k: kw.pop(k) for k in ("instance_type",) if k in kw}
    ex = SageMakerExecutor(role=ROLE, image=IMAGE, **options)
    return plan_for(ex, n, "train:main", run_id="island-1", rendezvous="s3://bucket/runs", **kw).body["jobs"]


def test_a_replica_of_two_nodes_is_one_job_of_two_instances_running_the_node_command(monkeypatch):
    for job in jobs(monkeypatch, gpu="H100:8", processes_per_replica=8, nodes=2):
        assert job["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100}
        assert job["AlgorithmSpecification"]["ContainerArguments"] == replica_command(8, 2)  # every node runs it
        assert job["Environment"]["DILOCO_REPLICAS"] == "2" and "PET_NODE_RANK" not in job["Environment"]
    (one,) = jobs(monkeypatch, n=1, gpu="A10G", nodes=2)
    assert one["ResourceConfig"]["InstanceCount"] == 2
    assert one["AlgorithmSpecification"]["ContainerArguments"] == replica_command(1, 2)
    assert SageMakerExecutor.capabilities.multi_node


@pytest.mark.parametrize("fields,words", [
    ({"gpu": "A10G:4", "processes_per_replica": 4, "instance_type": "ml.g5.xlarge"},
     "processes_per_replica = 4 is per node, but ml.g5.xlarge has 1 GPU: use at most 1"),
    ({"gpu": "H100:16", "processes_per_replica": 16, "nodes": 2},
     'no SageMaker training instance has 16 × H100 (`gpu` is per node: 16 × H100 are nodes = 2 of gpu = "H100:8")'),
    ({"gpu": "A10G:3", "processes_per_replica": 3}, "no SageMaker training instance has 3 × A10G; choose A10G:1"),
])
def test_what_cannot_run_on_an_instance_is_one_line(monkeypatch, fields, words):
    with pytest.raises(UserError) as err:
        jobs(monkeypatch, **fields)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_each_instance_is_its_node_by_sagemakers_host_order():
    twelve = [f"algo-{i}" for i in range(12, 0, -1)]  # listed any way: the order is lexicographic
    assert bootstrap.node_placement({"current_host": "algo-2", "hosts": ["algo-2", "algo-1"]}) == node_env(1, "algo-1")
    assert bootstrap.node_placement({"current_host": "algo-10", "hosts": twelve})["PET_NODE_RANK"] == "1"
    assert bootstrap.node_placement({"current_host": "algo-2", "hosts": twelve})["PET_NODE_RANK"] == "4"
    assert bootstrap.node_placement({"current_host": "algo-1", "hosts": ["algo-1"]}) == {}  # one instance: nothing
    reached = {"algo-1": "127.0.0.1:41234", "algo-2": "127.0.0.1:41235"}
    assert bootstrap.node_placement({"current_host": "algo-2", "hosts": ["algo-1", "algo-2"]}, reached) == \
        node_env(1, "127.0.0.1", 41234)
    assert str(bootstrap.NODE_PORT) == node_env(0, "x")["PET_MASTER_PORT"]  # the bootstrap imports no diloco
    for bad in ({"current_host": "algo-3", "hosts": ["algo-1", "algo-2"]}, {"current_host": "a", "hosts": "a,b"},
                {"current_host": "algo-1", "hosts": ["algo-1", "algo-1"]}):
        with pytest.raises(ValueError):
            bootstrap.node_placement(bad)


def test_the_bootstrap_starts_the_node_command_with_its_node(tmp_path):
    """bootstrap.py as the container runs it (standard library only): the command sees its node as
    torchrun's variables, the stand-in's host map does not reach it, and the log names the node."""
    root = tmp_path / "ml"
    config = root / "input" / "config" / "resourceconfig.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(containers.resource_config("algo-2", containers.host_names(2), "ml.m5.xlarge")))
    probe = ("import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
             "if k.startswith(('PET_', 'DILOCO_SAGEMAKER'))}))")
    env = {"PATH": "/usr/bin:/bin", bootstrap.ML_ROOT_ENV: str(root), bootstrap.HOSTS_ENV: '{"algo-1": "127.0.0.1:4567"}'}

    def container() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, bootstrap.__file__, sys.executable, "-c", probe], env=env,
                              capture_output=True, text=True, timeout=60)

    out = container()
    assert out.returncode == 0, out.stderr
    first, seen = out.stdout.splitlines()
    assert first == "diloco: node 1 of 2 on algo-2; node 0's store at 127.0.0.1:4567"
    assert json.loads(seen) == node_env(1, "127.0.0.1", 4567)
    config.write_text('{"current_host": "algo-9", "hosts": ["algo-1", "x"]}')  # the platform's file, broken
    out = container()
    assert out.returncode == 1 and "cannot tell which node of the replica this instance is" in out.stdout
    assert "algo-9" in (root / "output" / "failure").read_text()


NODE = '''import json, os, sys, time
ml = os.environ["DILOCO_ML_ROOT"]  # the stand-in's /opt/ml of this instance
cfg = json.load(open(ml + "/input/config/resourceconfig.json"))
host = cfg["current_host"]
print("HOST", host, cfg["hosts"], sorted(json.loads(os.environ["DILOCO_SAGEMAKER_HOSTS"])), flush=True)
if sys.argv[1] == "fail" and host == "algo-2":
    open(ml + "/output/failure", "w").write("exit code 3: node algo-2 broke")
    sys.exit(3)
if sys.argv[1] in ("fail", "hold"):
    time.sleep(600)  # until SageMaker stops it
print('diloco: replica result: {"result": "%s"}' % host, flush=True)
'''


def two_instance_job(aws, name: str, mode: str) -> None:
    aws["client"].put_object(Bucket="diloco-sm", Key=f"{name}/node.py", Body=NODE.encode())
    req = request(name, **{"ResourceConfig.InstanceCount": 2, "AlgorithmSpecification.ContainerEntrypoint": [
        "python", "/opt/ml/input/data/code/node.py", mode]})
    req["InputDataConfig"] = [{"ChannelName": "code", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": f"s3://diloco-sm/{name}/"}}}]
    sm().create_training_job(**req)


def test_each_instance_is_its_own_container_node_0_speaks_for_the_job_and_one_failing_fails_it(sagemaker, aws):
    """Two jobs of two instances at once: one whose instances both end well (the result is node
    0's, the log both instances'), one whose algo-2 fails while algo-1 would sleep for ten minutes
    (the job fails at once with algo-2's cause: algo-1 was stopped with it). The account's quota
    counts their instances."""
    sagemaker.quota("ml.m5.xlarge", 4)
    two_instance_job(aws, "island-hold-1", "hold")  # jobs that run until stopped: the quota is full
    two_instance_job(aws, "island-hold-2", "hold")  # whatever the machine's pace
    with pytest.raises(ClientError, match="request delta of 2 Instances"):
        two_instance_job(aws, "island-over", "ok")
    for name in ("island-hold-1", "island-hold-2"):
        wait_status(name, "InProgress")  # reads lag behind a create (the service's, and the stand-in's)
        sm().stop_training_job(TrainingJobName=name)
        wait_status(name, "Stopped")
    two_instance_job(aws, "island-ok", "ok")
    two_instance_job(aws, "island-fail", "fail")
    started = time.monotonic()
    job = wait_status("island-fail", "Failed")
    assert job["FailureReason"] == "AlgorithmError: exit code 3: node algo-2 broke"  # the failed instance's own
    assert time.monotonic() - started < 60  # not the ten minutes algo-1 would have slept
    wait_status("island-ok", "Completed")
    for host, log in (("algo-1", "container.log"), ("algo-2", "container-algo-2.log")):
        text = (sagemaker.root / "jobs" / "island-ok" / log).read_text()
        assert f"HOST {host} ['algo-1', 'algo-2'] ['algo-1', 'algo-2']" in text, text  # its own resourceconfig
    ex = SageMakerExecutor(role=ROLE, image=IMAGE, s3_prefix="s3://diloco-sm/sagemaker")
    ok, failed = (ReplicaHandle(0, "sagemaker", {"job": job, "region": "us-east-1", "created": time.time()})
                  for job in ("island-ok", "island-fail"))
    done, broke = ex.collect([ok, failed])
    assert (done.status, done.result) == (ReplicaStatus.SUCCEEDED, "algo-1")  # node 0's, not algo-2's
    assert (broke.status, broke.exit_code) == (ReplicaStatus.FAILED, 3) and broke.error.startswith("node algo-2 broke")
    logs = ex.stream_logs(ok)
    assert "[algo-1] HOST algo-1" in logs and "[algo-2] HOST algo-2" in logs, logs
