"""The fake Modal cloud (diloco_modal.testing) around every test that needs Modal's cloud: its
server in its own process, this process's real modal client pointed at it."""

from __future__ import annotations

import pytest

from diloco.testing.scenarios import wait_until_nothing_runs


@pytest.fixture
def fake_modal(tmp_path, monkeypatch):
    from diloco_modal.testing import FakeModal, forget_modal_client

    with FakeModal(tmp_path / "modal-cloud", grace_seconds=2.0, call_graph_lag=1.0) as fake:
        for key, value in fake.env.items():
            monkeypatch.setenv(key, value)
        forget_modal_client()
        yield fake  # each test's cloud is a new server: its client is made anew
    forget_modal_client()
    assert wait_until_nothing_runs(fake.live_processes, 10) == []
    assert fake.unimplemented() == [], f"the client called RPCs the fake does not implement: {fake.unimplemented()}"
    assert fake.server_errors() == [], "\n".join(fake.server_errors())
