"""The declared `[backend]` options, and the plan being exactly what `submit` hands to Modal."""

from __future__ import annotations

import math

import pytest

from diloco.errors import SpecError
from diloco.legacy import make_executor
from diloco.testing import plan_for
from diloco_modal.definition import CODE_DIR
from diloco_modal.executor import ModalExecutor
from diloco_modal.options import ModalOptions

SLEEP = "diloco.testing.entrypoints:sleep"
SECRET = "hf_value_for_the_sandbox_1234"


def test_options_are_declared_once_and_capabilities_say_what_modal_can_do():
    assert ModalExecutor.Options is ModalOptions
    caps = ModalExecutor.capabilities
    assert caps.relaunches_one_rank and caps.process_groups and caps.preemption_signal == "SIGINT"
    assert not caps.shares_launcher_filesystem and not caps.inter_replica_network and not caps.status_detail
    by_options = ModalExecutor(ModalOptions(app_name="mine", pip=["datasets"]))
    by_keywords = ModalExecutor(app_name="mine", pip=["datasets"])
    assert by_options.options == by_keywords.options and by_keywords.options.include_workdir is True
    assert ModalExecutor(by_options.options, cpu=2).options.cpu == 2.0  # overrides on top of options, checked


@pytest.mark.parametrize("table,key", [
    ({"pip": "torch"}, "pip"),  # a string where a list goes
    ({"secrets": "aws"}, "secrets"),
    ({"volumes": ["corpus"]}, "volumes"),
    ({"cpu": math.inf}, "cpu"),  # not finite
    ({"cpu": math.nan}, "cpu"),
    ({"cpu": -1}, "cpu"),  # out of range
    ({"memory": 0}, "memory"),
    ({"memory": 1.5}, "memory"),  # a float where an integer goes
    ({"include_workdir": "yes"}, "include_workdir"),
    ({"function": "no_separator"}, "function"),
    ({"workdir": "."}, "workdir"),  # the spec's top-level `workdir` is what is shipped, not an option
])
def test_a_bad_backend_option_is_one_line_naming_it(table, key):
    with pytest.raises(SpecError) as err:
        make_executor(ModalExecutor, table, source="spec.toml")
    message = str(err.value)
    assert f"backend.{key}" in message and len(message.splitlines()) == 1, message


def test_the_sandbox_plan_is_exactly_what_submit_sends(fake_modal, tmp_path, monkeypatch):
    """Each `Sandbox.create` gets the planned command, name, tags, resources and environment; the
    forwarded secret's value appears only in the one place Modal receives secrets."""
    import modal

    from diloco_modal.testing import FakeSecret, FakeVolume, _write_json

    code = tmp_path / "code"
    code.mkdir()
    fake_modal.config["image_paths"] = {CODE_DIR: str(code)}
    _write_json(fake_modal.root / "config.json", fake_modal.config)
    fake_modal.add_secret("aws", {"AWS_REGION": "eu-west-1"})
    fake_modal.add_volume("corpus")
    creates = []
    real_create = modal.Sandbox.create

    def recording_create(*args, **kwargs):
        creates.append((args, kwargs))
        return real_create(*args, **kwargs)

    monkeypatch.setattr(modal.Sandbox, "create", staticmethod(recording_create))
    executor = ModalExecutor(app_name="plan-check", secrets=["aws"], volumes={"/data": "corpus"}, cpu=1,
                             memory=512, region="us-east", cloud="aws")
    plan = plan_for(executor, 2, SLEEP, {"seconds": 60}, run_id="plan-check", gpu="T4", workdir=str(code),
                    env={"PLAIN": "visible"}, secret_env={"HF_TOKEN": SECRET})
    assert SECRET not in plan.render()
    plan.body["sandboxes"][1]["env"]["MARK"] = "from-the-plan"  # submit sends the plan, it does not plan again
    handles = executor.submit(plan)
    try:
        assert [h.rank for h in handles] == [0, 1] and len(creates) == 2
        for (args, kwargs), req in zip(creates, plan.body["sandboxes"]):
            assert list(args) == req["command"]
            for key in ("name", "tags", "gpu", "timeout", "workdir", "cpu", "memory", "region", "cloud"):
                assert kwargs[key] == req[key], key
            assert kwargs["env"] == req["env"] and SECRET not in str(kwargs["env"])
            assert kwargs["app"].name == plan.body["app"] == "plan-check"
            assert {p: v.name for p, v in kwargs["volumes"].items() if isinstance(v, FakeVolume)} == req["volumes"]
            secrets = kwargs["secrets"]
            assert all(isinstance(s, FakeSecret) for s in secrets)
            assert [s.name for s in secrets if s.name] == req["secrets"]["named"] == ["aws"]
            assert [s.values for s in secrets if not s.name] == [{"HF_TOKEN": SECRET}]  # the value, only here
            assert req["secrets"]["forwarded"] == {"HF_TOKEN": "REDACTED"}
        assert creates[1][1]["env"]["MARK"] == "from-the-plan" and "MARK" not in creates[0][1]["env"]
        assert handles[0].metadata["app"] == "plan-check" and SECRET not in handles[0].to_json()
    finally:
        for h in handles:
            executor.cancel(h)
