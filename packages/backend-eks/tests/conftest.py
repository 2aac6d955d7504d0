"""A simulated cluster (kmock's Kubernetes API emulator + a test-side Job controller/kubelet)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from diloco_eks.testing import SimulatedCluster

    with SimulatedCluster(tmp_path_factory.mktemp("cluster")) as sim:
        yield sim
    assert not sim.error_traces, sim.error_traces


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_STATE_DIR", str(tmp_path / "state"))
