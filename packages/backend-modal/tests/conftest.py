"""The Modal double (diloco_modal.testing) around every test that needs Modal's cloud."""

from __future__ import annotations

import time

import pytest


@pytest.fixture
def modal_token(monkeypatch):
    """A configured Modal token, as `modal token new` leaves one (the double never checks its value)."""
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-test")


@pytest.fixture
def fake_modal(tmp_path, modal_token, monkeypatch):
    from diloco_modal.testing import ROOT_ENV, FakeModal

    root = tmp_path / "modal-cloud"
    with FakeModal(root, grace_seconds=2.0) as fake:
        monkeypatch.setenv(ROOT_ENV, str(root))
        yield fake
    deadline = time.monotonic() + 10
    while fake.live_processes() and time.monotonic() < deadline:  # SIGKILLed processes take a moment to go
        time.sleep(0.1)
    assert not fake.live_processes()
