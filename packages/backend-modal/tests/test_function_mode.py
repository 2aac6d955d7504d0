"""Function mode: your own `@app.function`, spawned once per replica (through the Modal double)."""

from __future__ import annotations

import sys

import pytest

from diloco.errors import UserError
from diloco.testing import launch, plan_for
from diloco_modal.executor import ModalExecutor

EP = "diloco.testing.entrypoints:report"
APP = '''
import modal

import diloco_modal

app = modal.App("{name}")


@app.function(timeout=600, secrets=[modal.Secret.from_name("hf")])
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)


def not_a_function():
    pass
'''


@pytest.fixture
def app_module(fake_modal, tmp_path, monkeypatch):
    from diloco_modal.testing import _write_json

    name = f"fn_app_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(APP.format(name=name))
    fake_modal.config["pythonpath"] = [str(tmp_path)]
    _write_json(fake_modal.root / "config.json", fake_modal.config)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_function_whose_app_is_not_deployed_is_one_clear_error(fake_modal, app_module):
    executor = ModalExecutor(function=f"{app_module}:replica")
    with pytest.raises(UserError, match=r"is not deployed \(its app is not running\): run `modal deploy`"):
        launch(executor, 2, EP, run_id="r1")
    assert fake_modal.objects() == []


def test_the_functions_own_secrets_reach_the_replica_and_spawns_carry_the_rank(fake_modal, app_module):
    fake_modal.add_secret("hf", {"HF_TOKEN": "hf_from_a_modal_secret"})
    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    handles = launch(executor, 2, "os:getenv", {"key": "HF_TOKEN"}, run_id="r1")
    results = executor.collect(handles, timeout=60)
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    assert [r.result for r in results] == ["hf_from_a_modal_secret"] * 2  # read back as JSON from the logs
    by_name = ModalExecutor(function=f"{app_module}/replica")  # a deployed function, found by name
    (again,) = launch(by_name, 2, EP, run_id="r2", ranks=[1], attempt=3)
    (res,) = by_name.collect([again], timeout=60)
    assert res.result["rank"] == 1 and res.result["attempt"] == 3


def test_not_a_modal_function_is_refused(fake_modal, app_module):
    with pytest.raises(UserError, match="is a function, not a Modal function: decorate it"):
        launch(ModalExecutor(function=f"{app_module}:not_a_function"), 1, EP, run_id="r1")


def test_a_preempted_call_is_restarted_by_modal_on_the_same_input(fake_modal, app_module):
    """Modal retries a preempted function input itself: the call goes on, the replica restarts."""
    import time

    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    fake_modal.add_secret("hf", {})
    (handle,) = launch(executor, 1, "diloco.testing.entrypoints:sleep", {"seconds": 3}, run_id="r1")
    deadline = time.monotonic() + 30
    while executor.poll(handle) != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert fake_modal.preempt(handle.metadata["id"])
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "succeeded"
    assert "input restarted" in executor.stream_logs(handle)


def test_a_function_object_from_python_is_spawned_and_a_non_function_is_a_type_error(fake_modal, app_module):
    import importlib

    module = importlib.import_module(app_module)
    fake_modal.add_secret("hf", {})
    fake_modal.deploy(module.app)
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


def test_the_function_plan_is_exactly_what_submit_spawns(fake_modal, app_module):
    """Each spawn gets the planned rank, environment and process count; the forwarded secrets'
    values are added only to `diloco_secrets`, the input Modal receives them in."""
    from diloco_modal.testing import _read_json

    fake_modal.add_secret("hf", {})
    executor = ModalExecutor(function=f"{app_module}:replica", deploy=True)
    plan = plan_for(executor, 3, EP, run_id="r1", ranks=[2, 0], attempt=1, env={"PLAIN": "visible"},
                    secret_env={"WANDB_API_KEY": "wandb-secret-value-99"})
    assert "wandb-secret-value-99" not in plan.render()
    handles = executor.submit(plan)
    assert [h.rank for h in handles] == [2, 0] and all(h.attempt == 1 for h in handles)
    for handle, row in zip(handles, plan.body["spawn"]):
        spawned = _read_json(fake_modal.root / "objects" / handle.metadata["id"] / "spec.json")
        assert spawned["kwargs"] == {"rank": row["rank"], "diloco_env": row["diloco_env"],
                                     "processes_per_replica": row["processes_per_replica"],
                                     "diloco_secrets": {"WANDB_API_KEY": "wandb-secret-value-99"}}
        assert row["diloco_secrets"] == {"WANDB_API_KEY": "REDACTED"} and row["diloco_env"]["PLAIN"] == "visible"
        assert handle.metadata["app"] == plan.body["function"] and "wandb-secret-value-99" not in handle.to_json()
    results = executor.collect(handles, timeout=60)
    assert [(r.status, r.result["rank"], r.result["attempt"]) for r in results] == [("succeeded", 2, 1),
                                                                                  ("succeeded", 0, 1)]
