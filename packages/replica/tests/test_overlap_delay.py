"""The delayed merge (`overlap_delay`): an overlapped round's outer step reaches the model exactly τ
inner steps after its snapshot, waiting for the round there if it has not arrived, so a run
repeats itself step for step whatever the store's speed; merged on arrival, it does not. The
settings refuse a delay that cannot work, in one line.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from diloco.bootstrap.context import ReplicaContext
from diloco.errors import SpecError
from diloco.spec.settings import DilocoSettings
from diloco.store.objectstore import open_store
from diloco_replica import DiLoCo

from conftest import Replicas


def test_the_round_is_merged_at_the_delay_and_not_before():
    """One replica alone: its round arrives within a step, yet stays in flight until τ = 3."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, ReplicaContext(0, 1, "run-delay"), store=open_store(f"memory://{uuid.uuid4().hex}"),
                    sync_every=5, overlap=True, overlap_delay=3, total_steps=15)
    in_flight = []
    for _ in diloco.steps():
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if diloco.in_flight:  # give the round time to arrive: a merge on arrival would take it now
            while not diloco.sync.arrived():
                pass
        diloco.step()
        in_flight.append(diloco.in_flight)
    # rounds start after steps 5 and 10; each is merged 3 steps later (the last one when the loop ends)
    assert in_flight == [False] * 4 + [True, True, True, False, False, True, True, True, False, False, True]
    assert diloco.round == 3


def final_digests(runs: list[tuple[str, dict, float]]) -> list[set[str]]:
    """Each run (a store URI, settings, every store request `latency_s` late): two replicas; each
    run's θ digests at the end. The runs go side by side: they mostly wait (steps sleep, the slow
    store sleeps), so together they take little more than one."""
    launched = []
    try:
        for store_uri, settings, latency_s in runs:
            replicas = Replicas(run_id=f"t-delay-{uuid.uuid4().hex[:8]}")
            launched.append((replicas, replicas.launch(
                "mlp_rounds", 2, rendezvous=store_uri, env={"DILOCO_STORE_LATENCY_S": str(latency_s)},
                settings={"sync_every": 12, "checkpoint_every": 100, "overlap": True, **settings},
                args={"steps": 24, "dim": 32, "step_sleep": 0.05, "slow_ranks": [0, 1]})))
        return [{r["final"] for r in replicas.results(handles)} for replicas, handles in launched]
    finally:
        for replicas, _ in launched:
            replicas.cancel_all()


def test_a_delayed_merge_repeats_step_for_step_whatever_the_stores_speed(tmp_path):
    """Rounds every 12 steps of 50 ms. A round through the slow store (every request 0.1 s late)
    takes over a second: merged on arrival, round 1 lands at the next round; through the plain
    store it takes well under the 0.6 s to that round, and lands steps earlier."""
    delayed = {"overlap_delay": 4}
    fast, slow, fast_on_arrival, slow_on_arrival = final_digests([
        (f"file://{tmp_path / 'a'}", delayed, 0.0), (f"file://{tmp_path / 'b'}", delayed, 0.1),
        (f"file://{tmp_path / 'c'}", {}, 0.0), (f"file://{tmp_path / 'd'}", {}, 0.1)])
    assert len(fast) == 1 and fast == slow
    # merged on arrival, the merge's step follows the store's speed, and so does the model
    assert fast_on_arrival != slow_on_arrival


@pytest.mark.parametrize("table,words", [
    ({"overlap_delay": 3}, "`diloco.overlap_delay` applies to overlapped rounds only"),
    ({"overlap": True, "overlap_delay": 11, "sync_every": 20, "fragments": 2}, "use at most 10"),
    ({"overlap": True, "overlap_delay": 0}, "overlap_delay"),
])
def test_a_delay_that_cannot_work_is_refused_in_one_line(table, words):
    with pytest.raises(SpecError) as err:
        DilocoSettings.from_table(table, where="spec.toml")
    assert words in str(err.value) and "\n" not in str(err.value)
