"""`nodes`: a replica of K machines, launcher side (no torch here).

The spec key and its inheritance by groups, the layout refusals, the one command every node runs
and the variables each node gets, the local island's own rules (which node failed first, whose
result is the replica's, each node's devices), and backends that cannot place nodes together.
The replicas themselves run in tests/test_multinode.py.
"""

from __future__ import annotations

import json
import sys
from importlib.util import find_spec

import pytest

from conftest import write_spec

from diloco.errors import SpecError
from diloco.local import island
from diloco.local.executor import LocalProcessExecutor
from diloco.procgroup import check_layout, node_env, replica_command, resolve_nodes
from diloco.request import LaunchRequest
from diloco.spec.estimate import estimate, format_estimate
from diloco.spec.runspec import parse_spec

from test_process_groups import OLD_PLUGIN

torchrun_here = find_spec("torch") is not None and find_spec("diloco_replica") is not None


def spec_of(**top):
    return parse_spec({"backend": "local", "replicas": 2, "entrypoint": "job:main", **top})


def test_nodes_default_to_one_are_validated_and_groups_inherit_them():
    assert spec_of().nodes == 1 and spec_of(nodes=4).nodes == 4
    for bad in (0, 65, "2", 1.5):
        with pytest.raises(SpecError, match="`?nodes"):
            spec_of(nodes=bad)
    with pytest.raises(SpecError, match="nodes"):
        resolve_nodes(True)
    grouped = parse_spec({"entrypoint": "job:main", "nodes": 2, "group": [
        {"replicas": 1, "backend": "local"}, {"replicas": 1, "backend": "local", "nodes": 1}]})
    assert [g.nodes for g in grouped.groups] == [2, 1]
    assert "2 nodes" in grouped.groups[0].describe() and "nodes" not in grouped.groups[1].describe()


@pytest.mark.parametrize("top, message", [
    ({"gpu": "A100:8", "processes_per_replica": 16}, "processes_per_replica = 16 is per node, but gpu = 'A100:8' "
                                                       "gives each node 8 GPUs; for more processes use more nodes "
                                                       "(nodes = 2 with processes_per_replica = 8)"),
    ({"gpu": "H100:1", "processes_per_replica": 2}, "gives each node 1 GPU;"),
])
def test_more_processes_on_a_node_than_it_has_gpus_is_one_line(top, message):
    with pytest.raises(SpecError) as err:
        spec_of(**top)
    assert message in str(err.value) and "\n" not in str(err.value)
    check_layout(8, "A100:8")  # as many as the GPUs: fine
    check_layout(3, "A100")  # a bare name: the backend fills in the count (and checks it)


def test_one_command_on_every_node_and_the_variables_each_node_gets():
    assert replica_command(8) == replica_command(8, 1)  # one node: as before
    cmd = replica_command(8, 4, python="/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "diloco_replica.torchrun"] and "--standalone" not in cmd
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--nnodes"), flag("--nproc-per-node"), flag("--rdzv-backend")) == ("4", "8", "static")
    assert flag("--max-restarts") == "0" and cmd[-2:] == ["-m", "diloco.bootstrap.runner"]
    assert "--node-rank" not in cmd and "--master-addr" not in cmd  # per node: from the platform's variables
    assert replica_command(1, 2)[2] == "diloco_replica.torchrun"  # one process per node still needs torchrun
    assert node_env(3, "10.0.0.7", 29400) == {"PET_NODE_RANK": "3", "PET_MASTER_ADDR": "10.0.0.7",
                                              "PET_MASTER_PORT": "29400"}


def test_a_spec_may_not_set_what_torchrun_reads_per_node():
    with pytest.raises(SpecError, match="PET_NODE_RANK"):
        spec_of(env={"PET_NODE_RANK": "1"})


def test_a_request_of_several_nodes_counts_every_process_and_records_its_nodes():
    req = LaunchRequest(run_id="r", n_replicas=2, entrypoint="job:main", processes_per_replica=4, nodes=2)
    assert req.replica_processes == 8
    assert LaunchRequest.from_dict(req.to_dict()).nodes == 2
    assert LaunchRequest.from_dict({k: v for k, v in req.to_dict().items() if k != "nodes"}).nodes == 1


def test_the_estimate_shows_nodes_and_each_nodes_share_of_a_round():
    est = estimate(spec_of(nodes=4, processes_per_replica=2, diloco={"parameters": 1_000_000_000}))
    text = format_estimate(est)
    assert text.startswith("estimate: 2 replicas × 8 processes on 4 nodes,")
    per_node = next(line for line in text.splitlines() if "per node per round" in line)
    assert "up 1.0 GB" in per_node and "4 nodes a replica" in per_node  # 4 GB up per replica, over 4 links
    assert est.per_node(4).bytes_up == pytest.approx(est.round.bytes_up / 4)
    assert "per node" not in format_estimate(estimate(spec_of(diloco={"parameters": 10**9})))


def test_a_backend_that_cannot_place_nodes_together_says_so_at_dryrun(cli, project, state_dir):
    (project / "old_plugin.py").write_text(OLD_PLUGIN)
    env = {"DILOCO_PLUGINS": "old_plugin", "PYTHONPATH": str(project)}
    spec = write_spec(project, 'backend = "old"\nreplicas = 2\nentrypoint = "job:main"\n'
                               'rendezvous = "s3://bucket/runs"\nnodes = 2\n')
    for cmd in ("dryrun", "run"):
        proc = cli(cmd, str(spec), env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "backend 'old' cannot place several machines together" in lines[0], lines
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())


@pytest.mark.skipif(not torchrun_here, reason="torchrun needs torch and diloco-replica")
def test_the_local_dry_run_shows_the_island_and_each_replicas_devices(cli, project):
    spec = write_spec(project, 'backend = { name = "local", devices = [0, 1, 2, 3] }\nreplicas = 2\nnodes = 2\n'
                               'entrypoint = "job:main"\n')
    proc = cli("dryrun", str(spec))
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout)["processes"]
    assert first["argv"][1:4] == ["-m", "diloco.local.island", "2"] and "--nnodes" in first["argv"]
    assert first["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and second["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "2 processes on 2 nodes" in proc.stderr


@pytest.mark.skipif(not torchrun_here, reason="torchrun needs torch and diloco-replica")
def test_a_relaunch_is_planned_while_the_sink_thread_hides_torch(monkeypatch):
    """The TensorBoard sink imports tensorboardX with torch hidden from sys.modules, on its own
    thread, while the launch thread may plan a relaunch: the executor must not look torch up then
    (a `diloco scale` of a multi-process group once failed the run: "needs torch")."""
    ex = LocalProcessExecutor()
    monkeypatch.setitem(sys.modules, "torch", None)
    plan = ex.plan(LaunchRequest(run_id="r", n_replicas=1, entrypoint=["true"], processes_per_replica=2))
    assert plan.body["processes"][0]["argv"][2] == "diloco_replica.torchrun"


def test_each_node_gets_its_rank_the_first_nodes_address_its_result_and_its_devices():
    envs = island.node_environments({"DILOCO_RESULT_PATH": "/r/x.json", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, 4242)
    assert [e["PET_NODE_RANK"] for e in envs] == ["0", "1"]
    assert {e["PET_MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and {e["PET_MASTER_PORT"] for e in envs} == {"4242"}
    assert [e["DILOCO_RESULT_PATH"] for e in envs] == ["/r/x.json.node-0", "/r/x.json.node-1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]


def test_the_replicas_result_is_node_0s_or_the_first_failed_nodes(tmp_path):
    path = str(tmp_path / "x.json")
    (tmp_path / "x.json.node-0").write_text(json.dumps({"status": "succeeded", "exit_code": 0, "result": {"loss": 1}}))
    ok, code = island.replica_result(path, 2, None, rank=1, attempt=0)
    assert code == 0 and ok["result"] == {"loss": 1}
    lost, code = island.replica_result(path, 2, (1, -9), rank=1, attempt=3)  # node 1's agent SIGKILLed: no result
    assert code == 137 and lost["status"] == "failed" and lost["attempt"] == 3
    assert lost["error"].startswith("node 1 of 2 killed by SIGKILL") and "other nodes were stopped" in lost["error"]
    (tmp_path / "x.json.node-1").write_text(json.dumps({"status": "failed", "exit_code": 78, "error": "ValueError: x"}))
    named, code = island.replica_result(path, 2, (1, 78), rank=1, attempt=0)
    assert code == 78 and named["error"] == "ValueError: x\n(node 1 of 2)"


def test_the_island_refuses_a_wrong_command_line(capsys):
    assert island.main(["1", "true"]) == 78 and island.main(["x"]) == 78
    assert "NODES(>=2)" in capsys.readouterr().err


def test_a_node_that_fails_stops_the_others_and_names_itself(tmp_path, monkeypatch):
    """Two "nodes" that are plain shells: node 1 exits 3 at once, node 0 would sleep a minute."""
    monkeypatch.setenv("DILOCO_RESULT_PATH", str(tmp_path / "x.json"))
    monkeypatch.setattr(island, "STOP_GRACE_S", 2.0)
    code = island.run(2, ["bash", "-c", 'if [ "$PET_NODE_RANK" = 1 ]; then exit 3; fi; sleep 60'])
    result = json.loads((tmp_path / "x.json").read_text())
    assert code == 3 and result["error"].startswith("node 1 of 2 exited with code 3")
