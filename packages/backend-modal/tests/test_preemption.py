"""A preempted sandbox that is still finishing when Modal's grace period ends: killed, and preempted."""

from __future__ import annotations

from diloco.bootstrap.failures import is_preemption
from diloco.supervise.policy import Action, Failure, RestartSettings, decide
from diloco.testing import launch, wait_for_output
from diloco_modal.executor import ModalExecutor

SLOW_TO_LEAVE = '''
import time


def main():
    print("training", flush=True)
    try:
        time.sleep(300)
    finally:  # the round in flight when the notice came, still being finished
        time.sleep(120)
'''


def test_a_replica_killed_at_the_end_of_the_grace_period_is_preempted_not_failed(fake_modal, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "slow_to_leave.py").write_text(SLOW_TO_LEAVE)
    executor = ModalExecutor(image="ghcr.io/me/trainer:1")
    (handle,) = launch(executor, 1, "slow_to_leave:main", run_id="r1", workdir=str(work))
    assert "training" in wait_for_output(executor, handle, "training", timeout=60)
    assert fake_modal.preempt(handle.metadata["id"])  # SIGINT, 2 s of grace (conftest), then the kill
    (result,) = executor.collect([handle], timeout=60)
    assert (result.status, result.exit_code) == ("failed", 137), result
    assert result.error.startswith("preempted: the platform sent SIGINT"), result.error
    assert is_preemption(result.exit_code, result.error)
    settings = RestartSettings.from_table({"max_restarts_per_rank": 0}, n_replicas=1)
    decision = decide(settings, Failure(result.exit_code, result.error, None, 0.0), rank=0, restarts=0,
                      restarts_used=0, preemptions_used=0, peers=[])
    assert decision.preempted and decision.action is Action.RELAUNCH  # no failure budget left, none spent
