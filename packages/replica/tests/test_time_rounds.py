"""Time-based rounds (`[diloco] round_seconds`): replicas of different speeds meet on the clock.

Each replica runs inner steps until its round's deadline (at most sync_every of them), states
its step count τ_i in every contribution, and a shard's mean is FedNova's normalised average,
mean_i(Δ_i / τ_i) · mean_i(τ_i): a replica that ran half the steps moves the model half as far
per step-normalised update, not half as far in total. θ_global stays bit-identical everywhere.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from diloco.errors import SpecError
from diloco.spec.settings import DilocoSettings
from diloco.store.objectstore import open_store
from diloco_replica.round.allreduce import StoreAllReduce
from diloco_replica.round.steps.upload import Uploader


def run_rounds(store, run: str, deltas: list[torch.Tensor], steps: list[int], *, cap: int = 10, codec: str = "fp32",
               cls=StoreAllReduce):
    n = len(deltas)
    results, ars = {}, {}

    def go(i: int) -> None:
        ars[i] = cls(store, run, i, n, round_timeout=10.0, poll_interval=0.005, poll_max=0.05, codec=codec,
                     step_cap=cap)
        results[i] = ars[i].run_round(1, deltas[i].clone(), steps=steps[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for ar in ars.values():
        ar.close()
    return results


def test_the_weighted_mean_is_fednovas_normalised_average_computed_by_hand():
    """Three replicas that ran 2, 5 and 10 inner steps: the mean every replica applies is
    mean(Δ_i/τ_i) · mean(τ_i), not the plain mean — and the very same bytes on each."""
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-weighted"
    deltas = [torch.randn(1001, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    steps = [2, 5, 10]
    results = run_rounds(store, run, deltas, steps)
    by_hand = sum(d.double() / t for d, t in zip(deltas, steps)) / 3 * (sum(steps) / 3)
    plain = sum(d.double() for d in deltas) / 3
    for res in results.values():
        assert res.members == [0, 1, 2]
        assert torch.allclose(res.mean.double(), by_hand, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(res.mean.double(), plain, rtol=1e-3, atol=1e-3)
    assert len({res.mean.numpy().tobytes() for res in results.values()}) == 1  # bit-identical


def test_equal_step_counts_give_the_plain_mean():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-equal"
    deltas = [torch.randn(64, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    results = run_rounds(store, run, deltas, [7, 7], codec="int8")
    plain = (deltas[0] + deltas[1]) / 2
    for res in results.values():
        assert torch.allclose(res.mean, plain, atol=0.05)  # int8 on the wire


class StatesAnImpossibleStepCount(Uploader):
    """Contributions that claim 10⁹ inner steps (a bug, or an attacker with store access)."""

    def meta(self, rnd):
        return {"steps": 10**9}


def test_a_contribution_with_an_impossible_step_count_is_left_out_with_an_incident():
    store, run = open_store(f"memory://{uuid.uuid4().hex}"), "run-bad-steps"
    deltas = [torch.randn(90, generator=torch.Generator().manual_seed(20 + i)) for i in range(3)]

    def mixed(store, run, rank, n, **kwargs):
        ar = StoreAllReduce(store, run, rank, n, **kwargs)
        if rank == 2:
            ar.uploader = StatesAnImpossibleStepCount(ar.io, codec=ar.codec, topk_density=ar.topk_density,
                                                      window=ar.window)
        return ar

    results = run_rounds(store, run, deltas, [3, 3, 3], cls=mixed)
    incidents = [i for res in results.values() for i in res.incidents]
    assert incidents and all(i["writer"] == 2 and "inner-step count 1000000000" in i["problem"] for i in incidents)
    assert len({res.mean.numpy().tobytes() for res in results.values()}) == 1


def test_a_time_based_round_needs_the_step_count():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    ar = StoreAllReduce(store, "run-no-steps", 0, 1, round_timeout=1.0, step_cap=10)
    with pytest.raises(ValueError, match="inner steps behind"):
        ar.run_round(1, torch.zeros(8))
    with pytest.raises(ValueError, match="inner steps behind"):
        ar.run_round(1, torch.zeros(8), steps=11)
    ar.close()


@pytest.mark.parametrize("table, words", [({"round_seconds": 5, "overlap": True}, "overlap = true"),
                                          ({"round_seconds": 5, "fragments": 2, "sync_every": 4}, "fragments > 1"),
                                          ({"round_seconds": 5, "transport": "topk"}, 'transport "topk"'),
                                          ({"round_seconds": 5, "sync_every": 50, "total_steps": 1020},
                                           "must be a multiple of `diloco.sync_every`"),
                                          ({"round_seconds": 0}, "round_seconds")])
def test_what_time_based_rounds_do_not_combine_with_is_refused_in_one_line(table, words):
    with pytest.raises(SpecError, match=words) as refused:
        DilocoSettings.from_table(table)
    assert "\n" not in str(refused.value)


def test_replicas_of_different_speeds_meet_on_the_clock_and_end_bit_identical(replicas, store_uri):
    """Ranks 2 and 3 take 4× as long per inner step: with round_seconds they close each round
    after fewer steps instead of holding the fast ones up; every replica ends bit-identical."""
    settings = {"sync_every": 40, "round_seconds": 0.6, "round_timeout": 20}
    handles = replicas.launch("mlp_rounds", 4, rendezvous=store_uri, settings=settings,
                              args={"steps": 160, "dim": 16, "slow_ranks": [2, 3], "step_sleep": 0.04})
    results = replicas.results(handles)
    assert len({r["final"] for r in results}) == 1
    by_rank = {r["rank"]: r for r in results}
    for rnd in ("1", "2", "3"):
        assert len({r["hashes"][rnd] for r in results}) == 1, f"replicas diverge after round {rnd}"
    # the slow ones ran fewer steps per round: summed over the middle rounds of both ranks of each
    # speed (round by round, a loaded machine can hold a fast rank back as long as a sleep)
    fast = [x["tokens"] for rank in (0, 1) for x in by_rank[rank]["rounds"][1:-1]]
    slow = [x["tokens"] for rank in (2, 3) for x in by_rank[rank]["rounds"][1:-1]]
    assert fast and slow and sum(slow) < sum(fast), (fast, slow)
    assert all(x["members"] == [0, 1, 2, 3] for r in results for x in r["rounds"])



def time_one_round(stall: str) -> float:
    """One replica alone, round_seconds = 1.0, 20 ms inner steps; a 0.6 s stall 0.2 s in: an
    evaluation (`report_eval`) or one slow step (a checkpoint save). Returns round 1's compute time."""
    import time

    from diloco.bootstrap.context import ReplicaContext
    from diloco_replica import DiLoCo

    store = open_store(f"memory://{uuid.uuid4().hex}")
    diloco = DiLoCo(torch.nn.Linear(4, 1), None, ReplicaContext(0, 1, "run-stall"), store=store, sync_every=1000,
                    round_seconds=1.0, round_timeout=5.0)
    start, stalled = time.monotonic(), False
    for _ in range(1000):
        time.sleep(0.02)
        if not stalled and time.monotonic() - start > 0.2:
            stalled = True
            time.sleep(0.6)
            if stall == "eval":
                diloco.report_eval(1.0)
        info = diloco.step(tokens=1)
        if info is not None:
            diloco.close()
            return info.compute_s
    raise AssertionError("the round never closed")


@pytest.mark.parametrize("stall", ["eval", "slow step"])
def test_an_evaluation_or_one_slow_step_does_not_close_a_round_early(stall):
    """Taking the last interval as the step time, a 0.6 s stall ending 0.82 s into a 1 s round made
    the next step look 0.6 s long, so the round closed at 0.82 s (0.82 + 0.3 past the deadline).
    Now the round runs to the step that ends nearest its deadline."""
    assert time_one_round(stall) >= 0.95
