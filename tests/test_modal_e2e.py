"""The tiny-LM DiLoCo main job through `backend = "modal"`, end to end against the fake Modal server.

Every CLI call is another process running the real modal client, pointed at the fake Modal
server (diloco_modal.testing: a gRPC servicer of modal_proto's ModalClient service in its own
process), so durable handles are exercised for real. Each sandbox or function input is a
detached local process that holds only what a Modal container would. Remote means remote:
replicas meet in an s3:// rendezvous on a moto server; AWS credentials reach them only as the
spec's forwarded secrets (a Modal secret: attached to the sandbox, or bound to the function's call).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, events_of, on_s3, one_global_model, placed_by_groups, record_of, tiny_spec, wait_for_round
from diloco.testing.scenarios import StandIn, killed_launcher_is_resumed

pytest.importorskip("diloco_modal")


@pytest.fixture
def cloud(tmp_path):
    from diloco_modal.testing import FakeModal

    # grace: a loaded test machine took over 3 s to stop a replica
    fake = FakeModal(tmp_path / "modal-cloud", grace_seconds=10.0).start()
    try:
        yield fake
        deadline = time.monotonic() + 15
        while fake.live_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        leftover = fake.live_processes()
    finally:
        fake.stop()  # terminate anything a failed test left
    assert not leftover, f"processes still running in Modal containers: {leftover}"
    assert fake.unimplemented() == [] and fake.server_errors() == []


def modal_spec(tmp_path, s3, backend: str = "", **kw):
    spec = on_s3(tiny_spec(tmp_path, **kw), s3)
    text = spec.read_text().replace('backend = "local"\n', "")
    text = text.replace("round_timeout = 120", "round_timeout = 10\ncheckpoint_every = 2")
    text += '\n[backend]\nname = "modal"\n' + (backend or 'app_name = "tiny-lm"\n')
    spec.write_text(text)
    return spec


def cli_env(cloud, state, token=True):
    env = {**os.environ, "DILOCO_STATE_DIR": str(state), **cloud.env}
    if not token:
        for k in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
            env.pop(k, None)
        env["MODAL_CONFIG_PATH"] = str(state / "no-modal.toml")
    return env


def modal_cli(cloud, state, *args, timeout=600, token=True):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(cloud, state, token))


def start(cloud, state, *args):
    proc = subprocess.Popen([sys.executable, "-m", "diloco", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env(cloud, state))
    return proc, proc.stdout.readline().split()[1].rstrip(":")


def test_tiny_lm_through_modal_survives_a_kill_a_preemption_and_a_timeout(tmp_path, cloud, s3):
    """A SIGKILLed container (rank 2) is relaunched; a preempted one (rank 1) and one that reached its
    timeout (rank 3, exit 124) too, without spending the restart budget; the run goes on."""
    state = tmp_path / "state"
    spec = modal_spec(tmp_path, s3, steps=200, sync_every=25, restart="backoff = 0.2\nmax_restarts_per_rank = 3")
    dry = modal_cli(cloud, state, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout[dry.stdout.index("{"):])
    assert plan["mode"] == "sandbox" and len(plan["sandboxes"]) == 4
    assert "testing" not in dry.stdout.replace("diloco_modal.testing", "")  # moto's credentials never shown
    assert plan["sandboxes"][0]["secrets"]["forwarded"] == {  # cloud variables travel only as secrets
        k: "REDACTED" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION")}
    launcher, run_id = start(cloud, state, "run", str(spec))
    wait_for_round(state, run_id, 2)
    ids = {r["rank"]: r["handle"]["metadata"]["id"] for r in record_of(state, run_id)["ranks"]}
    # what the dry run showed is what was created (its run id aside); the secrets' values only in the container
    planned = json.loads(json.dumps(plan["sandboxes"][0]).replace(plan["sandboxes"][0]["tags"]["diloco-run"], run_id))
    created = cloud.spec(ids[0])
    for key in ("command", "name", "tags", "timeout", "workdir", "gpu"):
        assert created[key] == planned[key], key
    assert {f"/root/diloco-workdir/{f['path']}" for f in plan["image"]["workdir"]["shipment"]["largest"]} <= \
        set(created["files"])  # the shipped workdir, as the dry run listed it
    forwarded = {k: v for k, v in created["env"].items() if k in planned["secrets"]["forwarded"]}
    assert {k: v for k, v in created["env"].items() if k not in forwarded} == planned["env"]
    assert set(forwarded) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"}
    assert "REDACTED" not in forwarded.values()
    assert cloud.kill(ids[2], signal.SIGKILL)  # a crashed container
    assert cloud.preempt(ids[1])  # Modal takes a GPU sandbox's machine away
    cloud.expire(ids[3])  # one rank's sandbox reaches Modal's limit on its life
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    record = record_of(state, run_id)
    one_global_model(record)
    ranks = record["ranks"]
    assert ranks[2]["restarts"] == 1 and ranks[2]["handle"]["metadata"]["attempt"] == 1
    assert ranks[1]["restarts"] == 0 and ranks[1]["preemptions"] == 1  # not a failure: no budget spent
    assert ranks[3]["restarts"] == 0 and ranks[3]["time_limits"] == 1  # a time limit: its own budget
    assert ranks[3]["handle"]["metadata"]["attempt"] == 1
    kinds = [(e["event"], e.get("rank")) for e in events_of(state, run_id)]
    assert ("preempted", 1) in kinds and ("failed", 2) in kinds and ("failed", 1) not in kinds
    assert ("failed", 3) not in kinds
    timed_out = next(e for e in events_of(state, run_id) if e["event"] == "time_limit" and e.get("rank") == 3)
    assert "timed out (exit code 124)" in timed_out["error"]
    assert cloud.exit(ids[3])["status"] == "timeout"
    preempted = next(e for e in events_of(state, run_id) if e["event"] == "preempted")
    assert "preempted: the platform sent SIGINT" in preempted["error"]
    for rank in (1, 2, 3):  # the relaunched replicas rejoined from the store, not from scratch
        logs = modal_cli(cloud, state, "logs", run_id, "--rank", str(rank), "--attempt", "1").stdout
        joined = [line for line in logs.splitlines() if "joined at round" in line]
        assert joined and int(joined[0].split("joined at round ")[1].split()[0]) >= 2, logs[-2000:]
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=f"runs/{run_id}/")["Contents"]]
    assert any("/reduced/" in k for k in keys)  # they met in S3


def standin(cloud) -> StandIn:
    return StandIn(cloud.live_processes, env=cloud.env)  # the plain diloco CLI, its modal client pointed at the fake


def test_a_killed_launcher_is_resumed_from_another_process(tmp_path, cloud, s3):
    killed_launcher_is_resumed(standin(cloud), tmp_path / "state",
                               modal_spec(tmp_path, s3, steps=150, sync_every=25, replicas=2))


def test_no_modal_token_is_one_line(tmp_path, cloud, s3):
    proc = modal_cli(cloud, tmp_path / "state", "run", str(modal_spec(tmp_path, s3)), token=False)
    assert proc.returncode == 2 and "no Modal token configured: run `modal token new`" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert cloud.objects() == []  # nothing launched


FUNCTION_APP = """
import modal

import diloco_modal

app = modal.App("tiny-lm-fn")
image = diloco_modal.replica_image().add_local_python_source("tiny_lm")


@app.function(image=image, timeout=3600)
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)
"""


def test_function_mode_preemption_restarts_the_input_and_the_replica_rejoins(tmp_path, cloud, s3):
    """Modal restarts a preempted function input (run_replica raises KeyboardInterrupt on the
    SIGINT); the launcher sees the call go on, and the restarted replica rejoins from the store."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "tiny-lm" / "tiny_lm.py", work / "tiny_lm.py")
    (work / "tiny_lm_fn.py").write_text(FUNCTION_APP)
    state = tmp_path / "state"
    spec = modal_spec(tmp_path, s3, backend='function = "tiny_lm_fn:replica"\ndeploy = true\n', steps=200,
                      sync_every=25, replicas=2)
    spec.write_text(spec.read_text().replace(str(ROOT / "examples" / "tiny-lm"), str(work)))
    launcher, run_id = start(cloud, state, "run", str(spec))
    wait_for_round(state, run_id, 2)
    call_id = record_of(state, run_id)["ranks"][1]["handle"]["metadata"]["id"]
    assert cloud.preempt(call_id)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    record = record_of(state, run_id)
    one_global_model(record)
    assert len(cloud.restarts(call_id)) == 1  # the same call, its input restarted in a new container
    assert record["ranks"][1]["restarts"] == 0 and record["ranks"][1]["handle"]["metadata"]["id"] == call_id
    logs = modal_cli(cloud, state, "logs", run_id, "--rank", "1").stdout
    joined = [line for line in logs.splitlines() if "joined at round" in line]
    assert joined and int(joined[-1].split("joined at round ")[1].split()[0]) >= 2, logs[-2000:]


ISLAND_APP = """
import modal
import modal.experimental

import diloco_modal

app = modal.App("tiny-lm-island")
image = diloco_modal.replica_image().add_local_python_source("tiny_lm")
clustered = getattr(modal, "clustered", None) or modal.experimental.clustered  # modal 1.6, and 1.5


@app.function(image=image, gpu="H100:8", timeout=3600)
@clustered(size=2)
def island(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)
"""


def island_spec(tmp_path, s3, work):
    """Replica 0 on the local backend, replica 1 a clustered Modal call of two containers."""
    spec = on_s3(tiny_spec(tmp_path, steps=80, sync_every=20, restart="backoff = 0.2"), s3)
    text = placed_by_groups(spec).replace(str(ROOT / "examples" / "tiny-lm"), str(work))
    text = text.replace("round_timeout = 120", "round_timeout = 10\ncheckpoint_every = 1")
    spec.write_text(text + """
[[group]]
name = "here"
replicas = 1
[group.backend]
name = "local"

[[group]]
name = "island"
replicas = 1
nodes = 2
[group.backend]
name = "modal"
function = "tiny_lm_island:island"
deploy = true
""")
    return spec


def test_a_replica_of_two_containers_loses_one_and_rejoins_as_one_attempt(tmp_path, cloud, s3):
    """`nodes = 2` on Modal: the replica is one call of a clustered function, its two containers
    one gloo group (torch's static rendezvous on container 0). Container 1 is killed mid-run: Modal
    ends the call with container 0, the supervisor relaunches the replica once (a new call, both
    containers), and it rejoins from the store while replica 0 trains on; both end with the same
    θ, the island's read from its container 0's result."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "tiny-lm" / "tiny_lm.py", work / "tiny_lm.py")
    (work / "tiny_lm_island.py").write_text(ISLAND_APP)
    state = tmp_path / "state"
    spec = island_spec(tmp_path, s3, work)
    dry = modal_cli(cloud, state, "dryrun", str(spec))
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout[dry.stdout.index("{", dry.stdout.index("# group island")):])
    assert plan["cluster_size"] == 2 and [(s["rank"], s["nodes"]) for s in plan["spawn"]] == [(1, 2)]
    launcher, run_id = start(cloud, state, "run", str(spec))
    wait_for_round(state, run_id, 1)
    lost = record_of(state, run_id)["ranks"][1]["handle"]["metadata"]["id"]
    assert [m["rank"] for m in cloud.members(lost)] == [0, 1]
    assert cloud.kill(lost, signal.SIGKILL, node=1)  # container 1's machine is gone, with all it ran
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    record = record_of(state, run_id)
    one_global_model(record)  # bit-identical θ; the island's read from its container 0's result line
    ranks = record["ranks"]
    assert ranks[0]["restarts"] == 0 and ranks[1]["restarts"] == 1  # one attempt lost, counted once
    again = ranks[1]["handle"]["metadata"]
    assert again["attempt"] == 1 and again["id"] != lost and len(cloud.members(again["id"])) == 2
    assert cloud.exit(lost)["node"] == 1  # the call failed for container 1, and took container 0 with it
    failed = [e for e in events_of(state, run_id) if e["event"] == "failed"]
    assert [e["rank"] for e in failed] == [1], failed
    logs = modal_cli(cloud, state, "logs", run_id, "--rank", "1", "--attempt", "1").stdout
    joined = [line for line in logs.splitlines() if "joined at round" in line]
    assert joined and int(joined[0].split("joined at round ")[1].split()[0]) >= 1, logs[-2000:]
