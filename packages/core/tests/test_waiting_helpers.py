"""The helpers every backend builds its handles and results with (`ReplicaHandle.of`,
`ReplicaResult.failed`) and keeps its last read status in (`waiting.LastStatus`)."""

from __future__ import annotations

import pytest

from diloco.protocol import ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchRequest
from diloco.waiting import LastStatus


def test_a_handle_carries_cores_two_keys_from_the_request_and_the_platforms_own():
    request = LaunchRequest(run_id="run-7", n_replicas=4, entrypoint="job:main", attempt=3)
    h = ReplicaHandle.of(request, 2, "box", pid=41, stem="/tmp/x")
    assert h == ReplicaHandle(2, "box", {"run_id": "run-7", "attempt": 3, "pid": 41, "stem": "/tmp/x"})
    assert (h.run_id, h.attempt) == ("run-7", 3) and ReplicaHandle.from_json(h.to_json()) == h


@pytest.mark.parametrize("code, want", [(137, 137), (0, 0), (None, 1), ("oops", 1)])
def test_a_failed_result_always_has_an_exit_code(code, want):
    h = ReplicaHandle(1, "box", {"run_id": "r", "attempt": 2})
    got = ReplicaResult.failed(h, ReplicaStatus.FAILED, "killed", code)
    assert got == ReplicaResult(1, ReplicaStatus.FAILED, want, "killed", None, 2)


def test_the_last_status_stands_while_the_platform_does_not_answer():
    last = LastStatus()
    assert last.last("job-1") is ReplicaStatus.PENDING  # never read: pending
    assert last.saw("job-1", ReplicaStatus.RUNNING) is ReplicaStatus.RUNNING
    assert last.last("job-1") is ReplicaStatus.RUNNING and last.last("job-2") is ReplicaStatus.PENDING
    last.saw("job-1", ReplicaStatus.SUCCEEDED)
    assert last.last("job-1") is ReplicaStatus.SUCCEEDED
