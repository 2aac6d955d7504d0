"""Replicas of several machines: one call of a clustered Modal function (`@modal.clustered`),
planned, and run by the fake Modal cloud's K containers (real client, fake server). The replica
processes themselves (torchrun across containers, training) run in tests/test_modal_e2e.py,
where torch is installed."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from diloco.errors import UserError
from diloco.testing import launch, plan_for
from diloco.testing import wait_for_status as wait_for
from diloco.testing.scenarios import wait_until_nothing_runs
from diloco_modal.executor import ModalExecutor
from diloco_modal.testing.store import read_jsonl

EP = "diloco.testing.entrypoints:report"
APP = '''
import json
import os
import time

import modal
import modal.experimental

import diloco_modal
from diloco_modal.cluster import placement

app = modal.App("{name}")
clustered = getattr(modal, "clustered", None) or modal.experimental.clustered  # modal 1.6, and 1.5


@app.function(gpu="H100:8", timeout=600)
@clustered(size=2)
def placed(rank: int, diloco_env: dict, processes_per_replica: int = 1, nodes: int = 1):
    """Where this container stands (no replica: torch is not installed here), then a sleep."""
    node = placement(nodes)
    where = {{"rank": rank, "node": node.node_rank, "hf": os.environ.get("HF_TOKEN"), **node.env}}
    print("placed " + json.dumps(where), flush=True)
    time.sleep(float(diloco_env.get(f"SLEEP_NODE_{{node.node_rank}}", "0")))
    return node.node_rank


@app.function(gpu="H100:8", timeout=600)
@clustered(size=2)
def island(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)


@app.function(timeout=600)
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)
'''
BAD_APPS = '''
import modal
import modal.experimental

clustered = getattr(modal, "clustered", None) or modal.experimental.clustered

cpu_only = modal.App("cpu-only-cluster")
@cpu_only.function()
@clustered(size=2)
def f():
    pass

half_host = modal.App("half-host-cluster")
@half_host.function(gpu="H100:4")
@clustered(size=2)
def g():
    pass

too_big = modal.App("too-big-cluster")
@too_big.function(gpu="H100:8")
@clustered(size=33)
def h():
    pass
'''


@pytest.fixture
def app_module(fake_modal, tmp_path, monkeypatch):
    name = f"cluster_app_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(APP.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def output_by_node(fake, call_id: str) -> dict[int, str]:
    """Each container's stdout, rebuilt from the call's log chunks (node rank → text)."""
    tasks = {m["task_id"]: m["rank"] for m in fake.members(call_id)}
    out: dict[int, str] = {}
    for row in read_jsonl(fake.store.container_dir(call_id) / "logs.jsonl"):
        if row["fd"] == 1 and row["task_id"] in tasks:
            out[tasks[row["task_id"]]] = out.get(tasks[row["task_id"]], "") + row["data"]
    return out


def placed_lines(fake, call_id: str) -> dict[int, dict]:
    return {node: json.loads(text.split("placed ", 1)[1].splitlines()[0])
            for node, text in output_by_node(fake, call_id).items() if "placed " in text}


def test_a_replica_of_two_nodes_is_one_clustered_call_in_the_plan_and_sandboxes_refuse_it():
    assert ModalExecutor.capabilities.multi_node
    plan = plan_for(ModalExecutor(function="app:island"), 3, EP, run_id="r1", nodes=2, processes_per_replica=8)
    assert plan.body["cluster_size"] == 2  # the function must be @modal.clustered(size=2)
    assert [(s["rank"], s["nodes"], s["processes_per_replica"]) for s in plan.body["spawn"]] == \
        [(0, 2, 8), (1, 2, 8), (2, 2, 8)]  # exactly the keywords each spawn sends, processes per container
    one = plan_for(ModalExecutor(function="app:replica"), 1, EP, run_id="r1")
    assert "cluster_size" not in one.body and "nodes" not in one.body["spawn"][0]  # a one-node input as before
    with pytest.raises(UserError) as err:
        plan_for(ModalExecutor(), 2, EP, run_id="r1", nodes=2, gpu="H100:8")
    assert "only as one call of a clustered function, never sandboxes" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_each_container_gets_its_node_and_the_call_ends_with_rank_0(fake_modal, app_module):
    """Both containers get the same input, their node rank, and container 0's address and port
    (torchrun's own variables), and the forwarded secret (the call goes to the function's variant,
    `with_options`, still a cluster); rank 0 returning ends the call, and container 1, still
    asleep, is ended after the grace period."""
    executor = ModalExecutor(function=f"{app_module}:placed", deploy=True)
    (handle,) = launch(executor, 1, EP, run_id="r1", nodes=2, env={"SLEEP_NODE_1": "60"},
                       secret_env={"HF_TOKEN": "hf-for-every-container-42"})
    call_id = handle.metadata["id"]
    assert wait_for(executor, handle, {"succeeded", "failed"}, timeout=60) == "succeeded"
    placed = placed_lines(fake_modal, call_id)
    assert sorted(placed) == [0, 1]
    assert [placed[n]["PET_NODE_RANK"] for n in (0, 1)] == ["0", "1"] and {p["rank"] for p in placed.values()} == {0}
    assert {p["hf"] for p in placed.values()} == {"hf-for-every-container-42"}
    assert {p["PET_MASTER_ADDR"] for p in placed.values()} == {fake_modal.members(call_id)[0]["address"]}
    assert len({p["PET_MASTER_PORT"] for p in placed.values()}) == 1  # the fake's port for this cluster
    assert [m["address"] for m in fake_modal.members(call_id)] == ["127.0.0.1", "127.0.0.2"]
    assert wait_until_nothing_runs(fake_modal.live_processes, 10) == []  # container 1 did not outlive the call


def test_one_container_lost_fails_the_call_and_ends_the_other(fake_modal, app_module):
    executor = ModalExecutor(function=f"{app_module}:placed", deploy=True)
    (handle,) = launch(executor, 1, EP, run_id="r1", nodes=2, env={"SLEEP_NODE_0": "120", "SLEEP_NODE_1": "120"})
    call_id = handle.metadata["id"]
    deadline = time.monotonic() + 60
    while len(placed_lines(fake_modal, call_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(ValueError, match="name one with node=0..1"):
        fake_modal.kill(call_id)
    with pytest.raises(NotImplementedError, match="does not model preempting one of its containers"):
        fake_modal.preempt(call_id)
    assert fake_modal.kill(call_id, signal.SIGKILL, node=1)  # the machine of container 1 is gone
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "failed"  # Modal's account of it is the cause line, the logs under it
    assert "failed: container 1 of the cluster's 2 (task ta-" in result.error.splitlines()[0], result.error
    ended = fake_modal.exit(call_id)
    assert ended["status"] == "failure" and ended["node"] == 1
    assert "container 1 of the cluster's 2" in ended["exception"]
    assert wait_until_nothing_runs(fake_modal.live_processes, 10) == []  # container 0 was ended with it


def test_a_cluster_reaching_its_timeout_ends_every_container(fake_modal, app_module):
    executor = ModalExecutor(function=f"{app_module}:placed", deploy=True)
    (handle,) = launch(executor, 1, EP, run_id="r1", nodes=2, env={"SLEEP_NODE_0": "120", "SLEEP_NODE_1": "120"})
    call_id = handle.metadata["id"]
    deadline = time.monotonic() + 60
    while len(fake_modal.members(call_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    fake_modal.expire(call_id)
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "failed" and result.exit_code == 124  # a time limit, relaunched at once
    assert wait_until_nothing_runs(fake_modal.live_processes, 10) == []


@pytest.mark.parametrize("function,nodes,said", [
    ("replica", 2, "nodes = 2, but this call runs on a plain Modal function (one container per call)"),
    ("island", 1, "nodes = 1, but this call runs on a cluster of 2 containers"),
])
def test_a_cluster_of_another_size_than_nodes_stops_the_run_in_one_line(fake_modal, app_module, function, nodes,
                                                                       said):
    """Before anything starts: exit 78 (a configuration error, never relaunched into the same
    function), its cause the first line of the error."""
    executor = ModalExecutor(function=f"{app_module}:{function}", deploy=True)
    (handle,) = launch(executor, 1, EP, run_id="r1", nodes=nodes)
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "failed" and result.exit_code == 78, result.error
    assert said in result.error.splitlines()[0], result.error


def test_modal_refuses_clusters_it_does_not_offer(fake_modal, tmp_path, monkeypatch):
    """As the service does, at deploy: a CPU-only cluster, containers holding part of a host's GPUs,
    more than 32 containers."""
    import importlib

    import modal

    (tmp_path / "bad_clusters.py").write_text(BAD_APPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = importlib.import_module("bad_clusters")
    try:
        for app, said in ((bad.cpu_only, "CPU-only clusters are not supported"),
                          (bad.half_host, "each container must request all GPUs on its host (H100:8)"),
                          (bad.too_big, "a cluster has at most 32 containers")):
            with pytest.raises(modal.exception.InvalidError, match=re.escape(said)):
                app.deploy()
    finally:
        sys.modules.pop("bad_clusters", None)


def test_the_lines_of_a_clustered_calls_containers_are_rebuilt_per_container():
    """Two containers write at once: chunks interleave, and each line is joined within its own
    container's stream (the result line is container 0's, whole)."""
    from diloco_modal.logtail import lines_of

    def entry(message, second, task):
        return SimpleNamespace(message=message, timestamp=second, source="stdout", context_ids=["in-1", task])

    entries = [entry("diloco: replica re", 0, "ta-0"), entry("node 1 st", 1, "ta-1"), entry("sult: {}\n", 2, "ta-0"),
               entry("opped\n", 3, "ta-1")]
    assert lines_of(entries, whole=True) == ["diloco: replica result: {}", "node 1 stopped"]
