"""A round's phases add up to its compute and sync time, however late the result reaches the
training loop: the exchange laps from the round's start to the instant its phases end
(`Outcome.ended`), and the training process counts its outer phase on from there, so the
result's way back (a thread waking, a pipe from the sync process, a loaded machine) is in the
outer phase instead of nowhere (tests/test_progress_timeline.py checks it on real runs)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from diloco.bootstrap.context import ReplicaContext
from diloco.store.objectstore import open_store
from diloco_replica import DiLoCo
from diloco_replica.exchange.syncclient import InThread

HANDOFF_S = 0.15


@pytest.mark.parametrize("late", [False, True])
def test_the_phases_add_up_to_compute_and_sync_time(monkeypatch, late):
    if late:
        arrive = InThread.outcome

        def slow_to_arrive(self):
            out = arrive(self)
            time.sleep(HANDOFF_S)  # the result took this long to reach the training loop
            return out

        monkeypatch.setattr(InThread, "outcome", slow_to_arrive)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, ReplicaContext(0, 1, "run-phases"), store=open_store(f"memory://{uuid.uuid4().hex}"),
                    sync_every=3, total_steps=9)
    rows = []
    for step in diloco.steps():
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        info = diloco.step(loss=loss.item())
        if info is not None:
            rows.append(info)
    diloco.close()
    assert len(rows) == 3
    for row in rows:
        assert set(row.phases) > {"compute", "outer"}
        assert sum(row.phases.values()) == pytest.approx(row.compute_s + row.sync_s, abs=1e-6), row.phases
        assert (row.phases["outer"] >= HANDOFF_S) == late and (row.sync_s >= HANDOFF_S) == late
