"""Fixtures: replicas as real processes (diloco's local executor), a real S3 API (moto)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.local.executor import LocalProcessExecutor
from diloco.testing import launch

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def store_uri(tmp_path) -> str:
    return (tmp_path / "store").as_uri()


class Replicas:
    """Launches entrypoints from replica_jobs.py as real processes and collects their results."""

    def __init__(self, run_id: str):
        self.executor = LocalProcessExecutor(grace_period=1)
        self.run_id = run_id
        self.handles = []

    def launch(self, fn: str, n: int, *, rendezvous: str, settings: dict | None = None, args: dict | None = None,
               ranks=None, attempt: int = 0, env: dict | None = None, timeout: float = 300, processes: int = 1):
        extra = {"DILOCO_SETTINGS": json.dumps(settings or {}), **(env or {})}
        handles = launch(self.executor, n, f"replica_jobs:{fn}", args, run_id=self.run_id, rendezvous=rendezvous,
                         ranks=ranks, attempt=attempt, env=extra, timeout=timeout, processes_per_replica=processes,
                         workdir=str(HERE))
        self.handles += handles
        return handles

    def results(self, handles, timeout: float = 300):
        res = self.executor.collect(handles, timeout=timeout)
        for r, h in zip(res, handles):
            assert r.status == "succeeded", f"rank {r.rank}: {r.error}\n{self.executor.stream_logs(h)}"
        return [r.result for r in res]

    def cancel_all(self):
        for h in self.handles:
            self.executor.cancel(h)


@pytest.fixture
def replicas(request):
    r = Replicas(run_id=f"t-{request.node.name[:40].lower().replace('_', '-').replace('[', '-').strip(']')}")
    yield r
    r.cancel_all()
    r.executor.close()


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on 127.0.0.1 and a fresh bucket; AWS_* env points every process at it."""
    from diloco.testing.s3server import moto_s3

    with moto_s3() as server:
        for k, v in server["env"].items():
            monkeypatch.setenv(k, v)
        yield server


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped in CI, run by scripts/gpu-check")
