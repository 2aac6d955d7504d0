"""A simulated cluster (the strict Kubernetes stand-in: API server, Job controller, kubelet)."""

from __future__ import annotations

import pytest

# the namespaces the tests use: creating anywhere else is refused (404), as on a cluster
NAMESPACES = ["conformance", "locked", "pull", "cancel", "runs", "exact", "relaunch", "undo", "checks", "lifecycle",
              "islands"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from diloco_eks.testing import SimulatedCluster

    with SimulatedCluster(tmp_path_factory.mktemp("cluster"), namespaces=NAMESPACES) as sim:
        yield sim
    assert not sim.error_traces, sim.error_traces


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_STATE_DIR", str(tmp_path / "state"))
