"""The declared `[backend]` options, and the plan being exactly what `submit` hands to Modal."""

from __future__ import annotations

import json
import math

import pytest

from diloco.errors import SpecError
from diloco.plugins.discovery import make_executor
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


def test_the_sandbox_plan_is_exactly_what_submit_sends(fake_modal, tmp_path):
    """Each sandbox is created with the planned command, name, tags, resources and environment,
    as the real client sends them (SandboxCreate, recorded by the fake server); the forwarded
    secret's value travels only as a Modal secret, and reaches the container's environment."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("x = 1\n")
    fake_modal.add_secret("aws", {"AWS_REGION": "eu-west-1"})
    fake_modal.add_volume("corpus")
    executor = ModalExecutor(app_name="plan-check", secrets=["aws"], volumes={"/data": "corpus"}, cpu=1,
                             memory=512, region="us-east", cloud="aws")
    plan = plan_for(executor, 2, SLEEP, {"seconds": 60}, run_id="plan-check", gpu="T4", workdir=str(code),
                    env={"PLAIN": "visible"}, secret_env={"HF_TOKEN": SECRET})
    assert SECRET not in plan.render()
    plan.body["sandboxes"][1]["env"]["MARK"] = "from-the-plan"  # submit sends the plan, it does not plan again
    handles = executor.submit(plan)
    try:
        creates = fake_modal.rpcs("SandboxCreate")  # a GPU sandbox: the client's V1 path
        assert [h.rank for h in handles] == [0, 1] and len(creates) == 2
        for handle, create, req in zip(handles, creates, plan.body["sandboxes"]):
            sent = create["request"]["definition"]
            assert sent["entrypoint_args"] == req["command"] and sent["name"] == req["name"]
            assert {t["tag_name"]: t["tag_value"] for t in create["request"]["tags"]} == req["tags"]
            assert sent["timeout_secs"] == req["timeout"] and sent["workdir"] == req["workdir"] == CODE_DIR
            assert sent["resources"]["milli_cpu"] == 1000 and sent["resources"]["memory_mb"] == 512
            assert sent["resources"]["gpu_config"] == {"gpu_type": "T4", "count": 1}
            assert sent["scheduler_placement"]["regions"] == ["us-east"] and sent["cloud_provider_str"] == "aws"
            assert SECRET not in json.dumps(create)  # the value went as a secret's content, not in the definition
            started = fake_modal.spec(handle.metadata["id"])
            assert started["volumes"] == req["volumes"] == {"/data": "corpus"}
            env = started["env"]
            assert env["HF_TOKEN"] == SECRET and env["AWS_REGION"] == "eu-west-1"  # forwarded and named secrets
            assert {k: v for k, v in env.items() if k not in ("HF_TOKEN", "AWS_REGION")} == req["env"]
            assert req["secrets"] == {"forwarded": {"HF_TOKEN": "REDACTED"}, "named": ["aws"]}
        assert fake_modal.spec(handles[1].metadata["id"])["env"]["MARK"] == "from-the-plan"
        assert "MARK" not in fake_modal.spec(handles[0].metadata["id"])["env"]
        assert handles[0].metadata["app"] == "plan-check" and SECRET not in handles[0].to_json()
    finally:
        for h in handles:
            executor.cancel(h)


@pytest.mark.parametrize("line,key", [
    ('pip = "torch"', "pip"),  # on the old main this installed the packages t, o, r, c, h
    ('volumes = ["x"]', "volumes"),
    ('memory = "two"', "memory"),
    ("cpu = nan", "cpu"),
    ("cpu = inf", "cpu"),
    ("cpu = 1000", "cpu"),  # Modal's largest container has 64 cores
    ("memory = 100_000_000", "memory"),  # and 336 GiB
    ('secrets = ["aws", 3]', "secrets"),
    ('bucket_mounts = {"/ckpt" = {bucket = "b", read_only = "yes"}}', "bucket_mounts"),  # a string where a bool goes
    ('bucket_mounts = {"/ckpt" = {bucket = "b", readonly = true}}', "bucket_mounts"),  # not a CloudBucketMount key
    ('bucket_mounts = {"/ckpt" = {secret = "aws"}}', "bucket_mounts"),  # no bucket
])
def test_a_wrong_type_in_the_spec_fails_the_dry_run_in_one_line(tmp_path, line, key):
    """`diloco dryrun` on the spec: exit 2, one line naming `backend.KEY`, no traceback."""
    from click.testing import CliRunner

    from diloco.cli import main

    spec = tmp_path / "diloco.toml"
    spec.write_text('replicas = 2\nentrypoint = "train:main"\nrendezvous = "s3://bucket/runs"\n'
                    f'[backend]\nname = "modal"\n{line}\n')
    result = CliRunner().invoke(main, ["dryrun", str(spec)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"backend.{key}" in lines[0] and "Traceback" not in result.output, result.output


def test_a_wrong_type_fails_the_real_cli_without_a_traceback(tmp_path):
    import subprocess
    import sys

    spec = tmp_path / "diloco.toml"
    spec.write_text('replicas = 2\nentrypoint = "train:main"\nrendezvous = "s3://bucket/runs"\n'
                    '[backend]\nname = "modal"\npip = "torch"\n')
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and "`backend.pip` must be list[str]" in proc.stderr
