"""What arrives from outside is checked before it is believed: a handle read back from a run
record, a call's output record, a call's log text (the user's own output)."""

from __future__ import annotations

import sys

import pytest

from diloco.errors import UserError
from diloco.protocol import ReplicaHandle
from diloco.testing import launch
from diloco_modal.executor import ModalExecutor

APP = '''
import sys

import modal

import diloco_modal

app = modal.App("{name}")


@app.function(timeout=600)
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)


@app.function(timeout=600)
def not_a_replica(rank: int, **launch):
    print("a config error (exit code 78)", file=sys.stderr, flush=True)  # text, not how the call ended
    raise RuntimeError("the function failed before any replica ran")
'''


@pytest.mark.parametrize("metadata", [
    {"mode": "sandbox", "id": "fc-0123456789abcdefABCDEF"},  # a call's id read as a sandbox
    {"mode": "function", "id": "sb-0123456789abcdefABCDEF"},
    {"mode": "pod", "id": "sb-0123456789abcdefABCDEF"},
    {"mode": "sandbox", "id": "sb-../../../etc"},
    {"mode": "sandbox"},
    {"mode": "sandbox", "id": 12},
])
def test_a_handle_that_names_no_modal_object_is_refused_before_any_call(fake_modal, metadata):
    handle = ReplicaHandle(0, "modal", {"run_id": "r1", "attempt": 0, **metadata})
    for use in (ModalExecutor().poll, ModalExecutor().cancel, ModalExecutor().stream_logs):
        with pytest.raises(UserError, match=r"the run record's handle of rank 0 is not a Modal (sandbox|function "
                                            r"call)") as err:
            use(handle)
        assert len(str(err.value).splitlines()) == 1
    assert fake_modal.rpcs() == []


def test_a_failure_names_the_dashboard_of_its_own_id_not_a_url_from_the_record(fake_modal):
    executor = ModalExecutor()
    (handle,) = launch(executor, 1, "diloco.testing.entrypoints:fail_on", {"fail_rank": 0}, run_id="r1")
    tampered = ReplicaHandle(0, "modal", {**handle.metadata, "url": "https://phish.example/login"})
    (result,) = ModalExecutor().collect([tampered], timeout=60)
    assert result.status == "failed" and "phish.example" not in result.error
    assert f"https://modal.com/id/{handle.metadata['id']}" in result.error


@pytest.fixture
def app_module(fake_modal, tmp_path, monkeypatch):
    name = f"arrive_app_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(APP.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_calls_exit_code_comes_from_its_output_record_not_from_its_log_text(fake_modal, app_module):
    """A line of output that says "(exit code 78)" is not how the call ended: read as such, the
    run stopped on a config error it never had (or a later failure read as a preemption)."""
    executor = ModalExecutor(function=f"{app_module}:not_a_replica", deploy=True)
    (handle,) = launch(executor, 1, "diloco.testing.entrypoints:report", run_id="r1")
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "failed" and result.exit_code != 78
    assert "the function failed before any replica ran" in result.error
    good = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    (handle,) = launch(good, 2, "diloco.testing.entrypoints:fail_on", {"fail_rank": 0}, run_id="r2", ranks=[0])
    (result,) = good.collect([handle], timeout=60)
    assert result.status == "failed" and result.exit_code == 1  # run_replica's own failure: its exit code


def test_an_output_status_modal_adds_later_reads_as_failed_not_as_a_crash():
    from modal_proto import api_pb2

    from diloco_modal.calls import from_result

    assert from_result(api_pb2.GenericResult(status=99, exception="new")).status == "failed"
    assert from_result(api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS)).status == \
        "succeeded"
    timeout = from_result(api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT))
    assert timeout.status == "failed" and timeout.exit_code == 124
    failed = from_result(api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
                                               exception="ReplicaFailed('deliberate (exit code 3)')"))
    assert failed.exit_code == 3
    spoofed = from_result(api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
                                                exception="RuntimeError('x (exit code 78)')"))
    assert spoofed.exit_code is None
