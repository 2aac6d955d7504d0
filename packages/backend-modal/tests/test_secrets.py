"""The spec's forwarded secrets reach a replica only as Modal secrets, in both modes: never in a
function call's input, a sandbox's command or definition, a handle or a plan. Checked on the
bytes the (fake) Modal server received, RPC by RPC, not on what the client meant to send."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from diloco.testing import launch, plan_for
from diloco_modal.executor import ModalExecutor

SECRET = "hf_forwarded_value_6c1f3a07"
OWN = "own_secret_value_93ab51"
APP = '''
import hashlib
import os

import modal

import diloco_modal

app = modal.App("{name}")


@app.function(timeout=600, secrets=[modal.Secret.from_name("own")])
def replica(rank: int, **launch):
    return diloco_modal.run_replica(rank, **launch)


def digests():
    """What the replica's environment holds, without printing a value."""
    return {{k: hashlib.sha256(os.environ[k].encode()).hexdigest() if k in os.environ else None
             for k in ("HF_TOKEN", "OWN_KEY")}}
'''


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def holding(fake, value: str) -> set[str]:
    """The RPCs whose request bytes hold `value`. A V2 sandbox carries its secrets inline, as
    `secret_sources` (how the client sends a `Secret.from_dict`): those are left out here."""
    from modal_proto import api_pb2

    found = set()
    for name, requests in fake.raw_requests().items():
        for raw in requests:
            if name == "SandboxCreateV2":
                request = api_pb2.SandboxCreateV2Request.FromString(raw)
                request.ClearField("secret_sources")
                raw = request.SerializeToString()
            if value.encode() in raw:
                found.add(name)
    return found


@pytest.fixture
def secret_app(fake_modal, tmp_path, monkeypatch):
    """A module defining an app whose function has its own Modal secret, in the spec's workdir."""
    name = f"sec_app_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(APP.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_modal.add_secret("own", {"OWN_KEY": OWN})
    yield name
    sys.modules.pop(name, None)


def test_forwarded_secrets_reach_a_function_as_a_modal_secret_never_as_its_input(fake_modal, secret_app):
    """Function mode, deployed with the run ('module:fn') and found by name ('app/fn'): the
    replica sees the forwarded value and its function's own secret; the inputs never hold it."""
    from diloco_modal.testing.call import decode_input

    module_fn = ModalExecutor(function=f"{secret_app}:replica", deploy=True)
    plan = plan_for(module_fn, 2, f"{secret_app}:digests", run_id="r1", secret_env={"HF_TOKEN": SECRET})
    assert SECRET not in plan.render()
    handles = module_fn.submit(plan)
    by_name = ModalExecutor(function=f"{secret_app}/replica")
    handles += launch(by_name, 2, f"{secret_app}:digests", run_id="r2", ranks=[1], secret_env={"HF_TOKEN": SECRET})
    results = ModalExecutor().collect(handles, timeout=60)
    assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
    assert [r.result for r in results] == [{"HF_TOKEN": digest(SECRET), "OWN_KEY": digest(OWN)}] * 3
    inputs = fake_modal.raw_requests("FunctionMap")["FunctionMap"] + \
        fake_modal.raw_requests("FunctionPutInputs")["FunctionPutInputs"]
    assert inputs and not any(SECRET.encode() in raw for raw in inputs)
    assert holding(fake_modal, SECRET) == {"SecretGetOrCreate"}  # the one place the value went
    for handle in handles:
        assert SECRET not in handle.to_json()
        args, kwargs = decode_input(fake_modal.spec(handle.metadata["id"])["input"])
        assert set(kwargs) == {"rank", "diloco_env", "processes_per_replica"}
    assert plan.body["secrets"] == {"forwarded": {"HF_TOKEN": "REDACTED"}}  # what the dry run shows


def test_without_forwarded_secrets_the_function_is_spawned_as_deployed(fake_modal, secret_app):
    """Nothing to forward: no secret is made and the deployed function is called itself."""
    executor = ModalExecutor(function=f"{secret_app}:replica", deploy=True)
    (handle,) = launch(executor, 1, f"{secret_app}:digests", run_id="r1")
    (result,) = executor.collect([handle], timeout=60)
    assert result.result == {"HF_TOKEN": None, "OWN_KEY": digest(OWN)}
    assert fake_modal.rpcs("FunctionBindParams") == []


@pytest.mark.parametrize("gpu", ["T4", None])  # a GPU sandbox goes through the client's V1 path, others V2
def test_forwarded_secrets_reach_a_sandbox_as_a_modal_secret_never_in_its_definition(fake_modal, gpu):
    executor = ModalExecutor(app_name="secrets-check")
    (handle,) = launch(executor, 1, "diloco.testing.entrypoints:sleep", {"seconds": 0}, run_id="r1", gpu=gpu,
                       secret_env={"HF_TOKEN": SECRET})
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "succeeded", result.error
    assert fake_modal.spec(handle.metadata["id"])["env"]["HF_TOKEN"] == SECRET  # in the container's environment
    creates = fake_modal.rpcs("SandboxCreate") + fake_modal.rpcs("SandboxCreateV2")
    assert len(creates) == 1 and SECRET not in json.dumps(creates[0]["request"]["definition"])
    assert holding(fake_modal, SECRET) <= {"SecretGetOrCreate"}  # not in the command, args, env or tags
    assert SECRET not in handle.to_json()


def test_the_function_mode_dry_run_names_forwarded_secrets_only(tmp_path):
    (tmp_path / "train.py").write_text("def main():\n    return 1\n")
    spec = tmp_path / "diloco.toml"
    spec.write_text('replicas = 2\nentrypoint = "train:main"\nrendezvous = "s3://bucket/runs"\n'
                    'secrets = ["HF_TOKEN"]\n[backend]\nname = "modal"\nfunction = "app-name/replica"\n')
    proc = subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_TOKEN": SECRET})
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["secrets"] == {"forwarded": {"HF_TOKEN": "REDACTED"}}
    assert all("diloco_secrets" not in row for row in plan["spawn"])


def test_a_looked_up_function_object_keeps_its_own_secrets_or_is_refused_in_one_line(fake_modal, secret_app):
    """From Python, `function=modal.Function.from_name(...)`: modal >= 1.6 keeps what Modal
    answered for it (its secrets' ids); an older client cannot tell, and says what works instead."""
    import modal

    from diloco.errors import UserError

    launch(ModalExecutor(function=f"{secret_app}:replica", deploy=True), 1, f"{secret_app}:digests", run_id="r0")
    looked_up = ModalExecutor(function=modal.Function.from_name(secret_app, "replica"))
    if tuple(int(p) for p in modal.__version__.split(".")[:2]) < (1, 6):
        with pytest.raises(UserError, match="set \\[backend\\] function = 'APP-NAME/function-name' instead"):
            launch(looked_up, 1, f"{secret_app}:digests", run_id="r1", secret_env={"HF_TOKEN": SECRET})
        return
    (handle,) = launch(looked_up, 1, f"{secret_app}:digests", run_id="r1", secret_env={"HF_TOKEN": SECRET})
    (result,) = looked_up.collect([handle], timeout=60)
    assert result.result == {"HF_TOKEN": digest(SECRET), "OWN_KEY": digest(OWN)}
