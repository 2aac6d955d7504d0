"""The tiny-LM DiLoCo main job through `backend = "sagemaker"`, end to end without AWS's cloud.

The real boto3 clients talk HTTP to a moto server (S3 for the rendezvous and the code, CloudWatch
Logs, IAM, Secrets Manager) and, through AWS_ENDPOINT_URL_SAGEMAKER, to the training-job control
plane in diloco_sagemaker.testing, whose instances run each job as local processes with the
/opt/ml layout, the job's Environment, the role's credentials and an interpreter holding only
what the image declares. The launcher's shell is an IAM user holding exactly the README's
policy, every call authorized by the control plane. Every CLI call is its own process, so
durable handles (job names) are exercised for real. The spec's forwarded AWS keys reach the
replicas through Secrets Manager, never the job's Environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from diloco.testing.scenarios import StandIn, killed_launcher_is_resumed
from conftest import events_of, on_s3, one_global_model, record_of, tiny_spec, wait_for_round

pytest.importorskip("diloco_sagemaker")

ROLE = "arn:aws:iam::123456789012:role/diloco-sagemaker"


@pytest.fixture
def plane(tmp_path, s3):
    from diloco_sagemaker.testing import FakeSageMaker, create_execution_role

    assert create_execution_role(s3["env"]["AWS_ENDPOINT_URL"]) == ROLE
    with FakeSageMaker(tmp_path / "sagemaker", aws_endpoint=s3["env"]["AWS_ENDPOINT_URL"], grace_seconds=3.0,
                       spot_wait_seconds=3.0, stopping_seconds=2.0) as fake:
        yield fake
        deadline = time.monotonic() + 20
        while fake.live_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        leftover = fake.live_processes()
    assert not leftover, f"processes still running on SageMaker test instances: {leftover}"


def sm_spec(tmp_path, s3, **kw):
    spec = on_s3(tiny_spec(tmp_path, **kw), s3)
    text = spec.read_text().replace('backend = "local"\n', "")
    text = text.replace("round_timeout = 120", "round_timeout = 15\ncheckpoint_every = 2")
    text += (f'\n[backend]\nname = "sagemaker"\nrole = "{ROLE}"\nspot = true\n'
             f'image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco-replica:test"\n')
    spec.write_text(text)
    return spec


def cli_env(plane, state):
    return {**os.environ, "DILOCO_STATE_DIR": str(state), **plane.env}


def sm_cli(plane, state, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env(plane, state))


def start(plane, state, *args):
    proc = subprocess.Popen([sys.executable, "-m", "diloco", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env(plane, state))
    return proc, proc.stdout.readline().split()[1].rstrip(":")


def hold_back(plane, job, until, timeout: float = 300) -> None:
    """`job`'s container at a tenth of its pace (stopped 0.9 s of every second) until `until()`: it
    trains on, slower than any relaunch here, without the multi-second stalls a replica held still
    would make the others wait out (a round's grace window, a takeover's timeout)."""
    deadline = time.monotonic() + timeout
    try:
        while not until() and time.monotonic() < deadline and plane.kill(job, signal.SIGSTOP):
            time.sleep(0.9)
            plane.kill(job, signal.SIGCONT)
            time.sleep(0.1)
    finally:
        plane.kill(job, signal.SIGCONT)
    assert until(), f"timed out holding {job} back"


def read(path) -> str:
    return path.read_text() if path.exists() else ""


def grouped(spec, groups):
    """`spec` with its replicas placed by [[group]] tables of (name, replicas, nodes), each with the
    spec's [backend] table."""
    text, _, backend = spec.read_text().partition("\n[backend]\n")
    text = text.replace("replicas = 4\n", "").replace("replicas = 2\n", "")
    for name, replicas, nodes in groups:
        text += f'\n[[group]]\nname = "{name}"\nreplicas = {replicas}\nnodes = {nodes}\n[group.backend]\n{backend}'
    spec.write_text(text)
    return spec


def test_tiny_lm_on_sagemaker_survives_a_lost_instance_a_spot_interruption_and_a_max_runtime(tmp_path, plane, s3):
    """One run, three disturbances. Rank 2 is a replica of two instances (`nodes = 2`: one job of
    InstanceCount 2, each instance its node from its own resourceconfig.json, torchrun on each
    joined on algo-1); algo-2's container is killed (a bad node): the job fails, the stand-in
    stopping algo-1 as SageMaker does, and rank 2 is relaunched once, as one job of two instances
    (one restart spent, node 0's result its own). Rank 1's spot capacity is reclaimed (SageMaker
    retries the job itself: same job, no budget). Rank 3's job reaches MaxRuntimeInSeconds:
    Training → Stopping → Stopped/MaxRuntimeExceeded; Stopping must read as still running (not
    cancelled: that would be a cancel from outside diloco), the end as a time limit (exit 124),
    relaunched without spending the restart budget. Rank 0 trains on at a tenth of its pace from
    the disturbances until rank 2's relaunch has rejoined, so that the comebacks land in a run
    that goes on at any machine's pace (a relaunch is a job, its containers, torch imported on each
    node: seconds, against rounds of a fraction of one); all four end on one θ, bit for bit."""
    import boto3

    state = tmp_path / "state"
    spec = grouped(sm_spec(tmp_path, s3, steps=200, sync_every=25, restart="backoff = 0.2\nmax_restarts_per_rank = 3"),
                   [("pair", 2, 1), ("island", 1, 2), ("last", 1, 1)])
    dry = sm_cli(plane, state, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    groups = [json.JSONDecoder().raw_decode(part[part.index("{"):])[0] for part in dry.stdout.split("# group ")[1:]]
    planned = {**groups[0], "jobs": [job for group in groups for job in group["jobs"]]}
    shown = json.dumps(planned["jobs"])
    assert [j["ResourceConfig"]["InstanceCount"] for j in planned["jobs"]] == [1, 1, 2, 1]
    assert len(planned["jobs"]) == 4 and set(planned["secrets_manager"]["forwarded"]) == {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"}  # cloud variables: secrets only
    assert "testing" not in dry.stdout.replace("diloco_sagemaker.testing", "")  # no credential value shown
    launcher, run_id = start(plane, state, "run", str(spec))
    wait_for_round(state, run_id, 2)
    jobs = {r["rank"]: r["handle"]["metadata"]["job"] for r in record_of(state, run_id)["ranks"]}
    dry_id = next(t["Value"] for t in planned["jobs"][0]["Tags"] if t["Key"] == "diloco-run")
    assert [plane.received(jobs[r]) for r in range(4)] == json.loads(shown.replace(dry_id, run_id))  # as shown
    assert plane.kill(jobs[2], signal.SIGKILL, host="algo-2")  # one instance lost: the job fails
    assert plane.interrupt(jobs[1])  # spot capacity reclaimed: SageMaker retries the job itself
    assert plane.expire(jobs[3])  # rank 3's job reaches its MaxRuntimeInSeconds now
    relaunched = plane.root / "jobs" / (jobs[2].removesuffix("-a0") + "-a1")
    hold_back(plane, jobs[0], lambda: "joined at round" in read(relaunched / "container.log"))
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    record = record_of(state, run_id)
    one_global_model(record)
    ranks = record["ranks"]
    assert jobs[2].endswith("-a0")  # attempt 0; the relaunch is the same name with -a1 (the run id may hold "-a0" too)
    assert ranks[2]["restarts"] == 1 and ranks[2]["handle"]["metadata"]["job"] == jobs[2].removesuffix("-a0") + "-a1"
    assert plane.received(ranks[2]["handle"]["metadata"]["job"])["ResourceConfig"]["InstanceCount"] == 2  # whole
    assert ranks[1]["restarts"] == 0 and ranks[1]["handle"]["metadata"]["job"] == jobs[1]  # same job, no budget
    assert (ranks[3]["restarts"], ranks[3]["time_limits"]) == (0, 1)  # a time limit: relaunched, no budget
    assert ranks[3]["handle"]["metadata"]["job"] == jobs[3].removesuffix("-a0") + "-a1"
    assert [r["time_limits"] for r in ranks[:3]] == [0, 0, 0] and ranks[0]["restarts"] == 0
    events = events_of(state, run_id)
    kinds = [(e["event"], e.get("rank")) for e in events]
    assert ("failed", 2) in kinds and ("failed", 1) not in kinds and ("failed", 3) not in kinds
    assert kinds.count(("failed", 2)) == kinds.count(("relaunch_scheduled", 2)) == 1  # one instance: one loss
    member_of = r"attempt 1\] INFO round \d+: loss \S+ members \[([\d, ]+)\] sync"  # not "(not a member)"
    rounds = re.findall(member_of, read(relaunched / "container.log"))
    assert any({"0", "2"} <= set(m.split(", ")) for m in rounds), rounds  # back in rounds with rank 0 training
    assert ("store_unreachable", None) not in kinds  # the launcher's policy covers its write proof
    pending = [e for e in events if e["event"] == "pending" and e["rank"] == 1]
    assert pending and "spot interruptions so far: 1" in pending[0]["reason"], pending
    for rank, attempt in ((1, 0), (2, 1), (3, 1)):  # each came back from the store, not from scratch
        logs = sm_cli(plane, state, "logs", run_id, "--rank", str(rank), "--attempt", str(attempt), "-n", "2000").stdout
        joined = [line for line in logs.splitlines() if "joined at round" in line]
        assert joined and int(joined[-1].split("joined at round ")[1].split()[0]) >= 2, logs[-2000:]
        if rank == 2:  # both instances, each its node, in one log
            assert "[algo-2] diloco: node 1 of 2 on algo-2" in logs and "[algo-1] diloco: node 0 of 2" in logs
    launcher_shell = boto3.session.Session(aws_access_key_id=plane.launcher_keys["AWS_ACCESS_KEY_ID"],
                                           aws_secret_access_key=plane.launcher_keys["AWS_SECRET_ACCESS_KEY"])
    described = launcher_shell.client("sagemaker", endpoint_url=plane.endpoint).describe_training_job(
        TrainingJobName=jobs[0])
    assert "testing" not in json.dumps(described["Environment"])  # the forwarded keys went to Secrets Manager
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=f"runs/{run_id}/")["Contents"]]
    assert any("/reduced/" in k for k in keys)  # they met in S3
    from diloco_sagemaker.permissions import launcher_actions

    # the launcher's shell held exactly the README's policy; a run without a cancel needed all of it but StopTrainingJob
    assert set(plane.authorized) | {"sagemaker:StopTrainingJob"} == set(launcher_actions())


def standin(plane) -> StandIn:
    return StandIn(plane.live_processes, env=plane.env)


def test_a_killed_launcher_is_reattached_from_another_process(tmp_path, plane, s3):
    state, cloud = tmp_path / "state", standin(plane)

    def follow_a_log(run_id):  # while no launcher runs: the logs come from CloudWatch, to the result line
        follow = cloud.cli(state, "logs", run_id, "--rank", "0", "--follow")
        assert follow.returncode == 0 and "diloco: replica result:" in follow.stdout

    killed_launcher_is_resumed(cloud, state, sm_spec(tmp_path, s3, steps=150, sync_every=25, replicas=2),
                               follow_a_log)


def test_a_file_rendezvous_is_refused_in_one_line(tmp_path, plane, s3):
    spec = sm_spec(tmp_path, s3)
    spec.write_text(spec.read_text().replace(f'rendezvous = "{s3["uri"]}"', 'rendezvous = "file:///tmp/shared"'))
    proc = sm_cli(plane, tmp_path / "state", "run", str(spec))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "file://" in proc.stderr and "s3://" in proc.stderr
