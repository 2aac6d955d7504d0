"""Function mode: your own `@app.function`, spawned once per replica (real client, fake Modal server)."""

from __future__ import annotations

import sys

import pytest


from diloco.errors import UserError
from diloco.testing import launch, plan_for, wait_for_output
from diloco.testing import wait_for_status as wait_for
from diloco_modal.executor import ModalExecutor

EP = "diloco.testing.entrypoints:report"
SLEEP = "diloco.testing.entrypoints:sleep"
APP = '''
import os

import modal

import diloco_modal

app = modal.App("{name}")


@app.function(timeout=600, secrets=[modal.Secret.from_name("hf")])
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)


def not_a_function():
    pass


def hf_token():
    return os.environ.get("HF_TOKEN")
'''


@pytest.fixture
def app_module(fake_modal, tmp_path, monkeypatch):
    """A module defining the app, in the spec's workdir (modal mounts it into the function's container)."""
    name = f"fn_app_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(APP.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_modal.add_secret("hf", {})
    yield name
    sys.modules.pop(name, None)




def test_a_function_whose_app_is_not_deployed_gets_advice_that_works(fake_modal, app_module):
    """`modal deploy` elsewhere never hydrates a 'module:fn' object: the advice is deploy = true
    or the deployed name, and both work."""
    with pytest.raises(UserError, match=r"is not deployed with this run: set \[backend\] deploy = true .* or deploy "
                                        r"the app yourself \(`modal deploy`\) and set \[backend\] function = "
                                        r"'APP-NAME/replica'"):
        launch(ModalExecutor(function=f"{app_module}:replica"), 2, EP, run_id="r1")
    assert fake_modal.objects() == []
    (first,) = launch(ModalExecutor(function=f"{app_module}:replica", deploy=True), 1, EP, run_id="r2")
    (second,) = launch(ModalExecutor(function=f"{app_module}/replica"), 1, EP, run_id="r3")
    results = ModalExecutor().collect([first, second], timeout=60)
    assert [r.status for r in results] == ["succeeded", "succeeded"]


def test_the_functions_own_secrets_reach_the_replica_and_spawns_carry_the_rank(fake_modal, app_module):
    fake_modal.add_secret("hf", {"HF_TOKEN": "hf_from_a_modal_secret"})
    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    handles = launch(executor, 2, f"{app_module}:hf_token", run_id="r1")
    results = executor.collect(handles, timeout=60)
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    assert [r.result for r in results] == ["hf_from_a_modal_secret"] * 2  # read back as JSON from the logs
    by_name = ModalExecutor(function=f"{app_module}/replica")  # a deployed function, found by name
    (again,) = launch(by_name, 2, EP, run_id="r2", ranks=[1], attempt=3)
    (res,) = by_name.collect([again], timeout=60)
    assert res.result["rank"] == 1 and res.result["attempt"] == 3


def test_an_unknown_deployed_function_is_modals_not_found_in_one_line(fake_modal, app_module):
    with pytest.raises(UserError, match=r"Modal cannot find what spawn rank 0 needs: .*App 'nope' not found in "
                                        r"environment 'main'"):
        launch(ModalExecutor(function="nope/replica"), 1, EP, run_id="r1")


def test_not_a_modal_function_is_refused(fake_modal, app_module):
    with pytest.raises(UserError, match="is a function, not a Modal function: decorate it"):
        launch(ModalExecutor(function=f"{app_module}:not_a_function"), 1, EP, run_id="r1")


def test_a_preempted_call_is_restarted_by_modal_on_the_same_input(fake_modal, app_module):
    """Modal restarts an input only when the function raises KeyboardInterrupt: the replica exits
    75 on the SIGINT, run_replica raises KeyboardInterrupt, the input restarts and succeeds.

    The notice is sent once the replica prints from inside its entrypoint (its handler is set,
    its 4 s are running), never timed from the `running` status: that lags the container by the
    call graph's delay, and under load a notice timed from it landed as the entrypoint returned,
    so the input restarted with no preemption for the replica to report."""
    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    (handle,) = launch(executor, 1, SLEEP, {"seconds": 4}, run_id="r1")
    assert "rank 0 sleeping" in wait_for_output(executor, handle, "rank 0 sleeping")
    call_id = handle.metadata["id"]
    assert fake_modal.preempt(call_id)
    (result,) = executor.collect([handle], timeout=90)
    assert result.status == "succeeded", result.error
    assert len(fake_modal.restarts(call_id)) == 1  # one input, restarted once in a new container
    logs = executor.stream_logs(handle)
    assert "preempted: the platform sent SIGINT" in logs and "input restarted" in logs


def test_a_failure_that_is_not_a_preemption_fails_the_input(fake_modal, app_module):
    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    (handle,) = launch(executor, 2, "diloco.testing.entrypoints:fail_on", {"fail_rank": 0}, run_id="r1", ranks=[0])
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "failed" and "deliberate failure on rank 0" in result.error
    assert fake_modal.restarts(handle.metadata["id"]) == []


def test_a_lagging_call_graph_never_reads_as_failed_and_cancel_still_cancels(fake_modal, app_module):
    """The call graph is best-effort: here it stays empty for 60 s after each spawn. The call is
    neither failed while it runs nor after it ended (its output says so), and cancel cancels."""
    fake_modal.store.configure(call_graph_lag=60.0)
    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    quick, slow = launch(executor, 2, SLEEP, {"seconds": 0}, run_id="r1", ranks=[0]) + \
        launch(executor, 2, SLEEP, {"seconds": 120}, run_id="r1", ranks=[1])
    assert executor.poll(slow).value in ("pending", "running")  # an empty graph is not a failure
    assert wait_for(executor, quick, {"succeeded", "failed"}) == "succeeded"
    assert executor.poll(slow).value in ("pending", "running")
    executor.cancel(slow)
    assert fake_modal.exit(slow.metadata["id"])["status"] == "terminated"  # cancelled although the graph is empty
    assert executor.poll(slow) == "cancelled"


def test_the_call_graph_alone_only_ends_a_call_on_a_terminal_status():
    from types import SimpleNamespace as NS

    from modal.types import InputStatus

    from diloco_modal.calls import from_graph

    def graph(status, task="ta-1"):
        return [NS(function_call_id="fc-1", status=status, task_id=task)]

    assert from_graph([], "fc-1").status == "pending"  # absent: not known yet, never failed
    assert from_graph(graph(InputStatus.PENDING, ""), "fc-1").status == "pending"
    assert from_graph(graph(InputStatus.PENDING), "fc-1").status == "running"
    assert from_graph(graph(InputStatus.SUCCESS), "fc-1").status == "succeeded"
    assert from_graph(graph(InputStatus.TERMINATED), "fc-1").status == "cancelled"
    assert from_graph(graph(InputStatus.TIMEOUT), "fc-1").exit_code == 124


def test_a_function_object_from_python_is_spawned_and_a_non_function_is_a_type_error(fake_modal, app_module):
    import importlib

    module = importlib.import_module(app_module)
    module.app.deploy()
    (handle,) = launch(ModalExecutor(function=module.replica), 1, EP, run_id="r1")
    (result,) = ModalExecutor().collect([handle], timeout=60)  # another instance: the id is enough
    assert result.status == "succeeded" and result.result["rank"] == 0
    with pytest.raises(TypeError, match="must be a Modal function .* got function"):
        ModalExecutor(function=module.not_a_function)


def test_a_function_object_is_kept_aside_and_named_in_the_options(fake_modal, app_module):
    import importlib

    from diloco_modal.options import ModalOptions

    module = importlib.import_module(app_module)
    by_keyword = ModalExecutor(function=module.replica)
    by_options = ModalExecutor(ModalOptions(function=module.replica))  # a function object in the options, too
    for executor in (by_keyword, by_options):
        assert executor.options.function == f"{app_module}:replica" and executor.mode == "function"
        assert executor._function_obj is module.replica
    assert plan_for(by_keyword, 1, EP, run_id="r1").body["function"] == f"{app_module}:replica"
    with pytest.raises(UserError, match="deploy = true needs `function` as 'module:function'"):
        plan_for(ModalExecutor(function=module.replica, deploy=True), 1, EP, run_id="r1")  # found when planning
    assert fake_modal.objects() == []


def test_the_function_plan_is_exactly_what_submit_spawns_as_cbor(fake_modal, app_module):
    """Each spawn gets the planned rank, environment and process count, as CBOR (plain data, no
    pickle), and nothing else: the forwarded secrets are a Modal secret (test_secrets)."""
    from modal_proto import api_pb2

    from diloco_modal.testing.call import decode_input

    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    plan = plan_for(executor, 3, EP, run_id="r1", ranks=[2, 0], attempt=1, env={"PLAIN": "visible"},
                    secret_env={"WANDB_API_KEY": "wandb-secret-value-99"})
    assert "wandb-secret-value-99" not in plan.render()
    assert plan.body["secrets"] == {"forwarded": {"WANDB_API_KEY": "REDACTED"}}
    handles = executor.submit(plan)
    assert [h.rank for h in handles] == [2, 0] and all(h.attempt == 1 for h in handles)
    for handle, row in zip(handles, plan.body["spawn"]):
        sent = fake_modal.spec(handle.metadata["id"])["input"]
        assert sent["format"] == api_pb2.DATA_FORMAT_CBOR
        assert decode_input(sent) == ([], {"rank": row["rank"], "diloco_env": row["diloco_env"],
                                           "processes_per_replica": row["processes_per_replica"]})
        assert row["diloco_env"]["PLAIN"] == "visible"
        assert handle.metadata["app"] == plan.body["function"] and "wandb-secret-value-99" not in handle.to_json()
    results = executor.collect(handles, timeout=60)
    assert [(r.status, r.result["rank"], r.result["attempt"]) for r in results] == [("succeeded", 2, 1),
                                                                                  ("succeeded", 0, 1)]
