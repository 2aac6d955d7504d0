"""`diloco_replica.torchrun` on one node of a multi-node replica: which processes are its own, what
it writes as its node's result, and the platform variables it cannot start without."""

from __future__ import annotations

import json

from diloco.bootstrap.runner import lane_result_path
from diloco_replica import torchrun


def test_node_r_runs_the_processes_after_the_earlier_nodes():
    assert list(torchrun.node_lanes(0, 4)) == [0, 1, 2, 3]
    assert list(torchrun.node_lanes(1, 4)) == [4, 5, 6, 7]


def test_a_node_without_process_0_succeeds_plainly_and_a_failed_process_is_named_with_its_node(tmp_path):
    path = str(tmp_path / "node-1.json")
    assert torchrun.finish(path, torchrun.node_lanes(1, 2), 4, None, 0, rank=3, attempt=2) == 0
    assert json.loads(open(path).read()) == {"rank": 3, "attempt": 2, "status": "succeeded", "exit_code": 0}
    with open(lane_result_path(path, 3), "w") as f:
        json.dump({"status": "failed", "exit_code": 78, "error": "UserError: bad"}, f)
    assert torchrun.finish(path, torchrun.node_lanes(1, 2), 4, 3, 1, rank=3, attempt=2) == 78
    assert json.loads(open(path).read())["error"] == "UserError: bad\n(process 3 of 4 (node 1))"
    assert torchrun.finish(path, torchrun.node_lanes(1, 2), 4, 2, -9, rank=3, attempt=2) == 137  # no file: killed
    assert json.loads(open(path).read())["error"].startswith("process 2 of 4 (node 1) killed by SIGKILL")


def test_one_node_of_several_without_its_platforms_variables_is_a_configuration_error(monkeypatch, capsys):
    for name in ("PET_MASTER_ADDR", "PET_NODE_RANK", "PET_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code = torchrun.main(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "static", "--max-restarts", "0",
                          "-m", "diloco.bootstrap.runner"])
    assert code == 78 and "PET_NODE_RANK, PET_MASTER_ADDR" in capsys.readouterr().err


def test_torchrun_handles_the_platforms_preemption_signal_as_well_as_its_own():
    import signal

    assert torchrun.signals_to_handle("SIGTERM,SIGINT,SIGHUP,SIGQUIT", signal.SIGUSR1) == \
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert torchrun.signals_to_handle("SIGTERM,SIGINT", signal.SIGINT) == "SIGTERM,SIGINT"  # Modal's: already there
    assert torchrun.signals_to_handle("SIGTERM", None) == "SIGTERM"
