"""The backend contract itself: request → plan → submit, with secrets apart.

The example backend of docs/writing-a-backend.md is taken from the doc itself, installed as a
package (a module plus its dist-info with the `diloco` entry point, the layout pip leaves), and
run through the conformance kit, `diloco backends`, `diloco dryrun` and the hello job. The kit
itself is run on the example broken one rule at a time: it must fail, naming the rule and the
guide's section that states it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import write_spec
from diloco import testing
from diloco.errors import BackendError, UserError
from diloco.options import option
from diloco.protocol import Capabilities, ReplicaHandle, ReplicaStatus
from diloco.inputs.replicaenv import REDACTED
from diloco.request import LaunchPlan, LaunchRequest, Secrets
from diloco.submitting import start_each
from diloco.testing import ExecutorConformance

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "writing-a-backend.md"
HELLO = ROOT / "examples" / "hello"


def example_backend_source() -> str:
    text = DOC.read_text()
    section = text.split("## A complete backend", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def install_example(site: Path) -> None:
    """Install the doc's backend as pip would lay it out: the module, and dist-info with its entry point."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "diloco_box.py").write_text(example_backend_source())
    info = site / "diloco_backend_box-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: diloco-backend-box\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[diloco]\nbox = diloco_box\n")


def _load_example():
    """The doc's backend as a module, compiled from the doc's own text (for the kit, in-process)."""
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("diloco_box_doc", loader=None))
    sys.modules["diloco_box_doc"] = module  # dataclasses look their module up while the class is made
    exec(compile(example_backend_source(), str(DOC), "exec"), module.__dict__)
    return module


box = _load_example()


def test_the_example_is_the_size_the_guide_says():
    """The guide claims an exact size for its backend, so the claim cannot drift from the code."""
    code, total = map(int, re.search(r"in (\d+) lines of code \((\d+) with\s+blank lines\)", DOC.read_text()).groups())
    lines = example_backend_source().splitlines()
    assert (len([x for x in lines if x.strip()]), len(lines)) == (code, total)


class TestExampleBackendConformance(ExecutorConformance):
    root: Path

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path / "box"

    def make_executor(self):
        return box.BoxExecutor(root=str(self.root))


def test_example_backend_installs_and_runs_the_hello_job(cli, tmp_path):
    site = tmp_path / "site"
    install_example(site)
    env = {"PYTHONPATH": str(site)}
    listing = cli("backends", env=env, check_rc=0).stdout
    assert "box" in listing and "diloco-backend-box" in listing
    options = json.loads(cli("backends", "box", "--json", env=env, check_rc=0).stdout)["options"]
    assert [o["name"] for o in options] == ["root"] and options[0]["help"]
    spec = write_spec(tmp_path, f'entrypoint = "hello:main"\nreplicas = 2\nworkdir = "{HELLO}"\ntimeout = 60\n'
                                f'secrets = ["BOX_API_TOKEN"]\n[args]\nsteps = 2\n[restart]\nmonitor_interval = 0.1\n'
                                f'[backend]\nname = "box"\nroot = "{tmp_path / "boxes"}"\n')
    secret = {"BOX_API_TOKEN": "box-secret-value-91"}
    dry = cli("dryrun", str(spec), env={**env, **secret}, check_rc=0)
    rows = json.loads(dry.stdout)
    assert [r["rank"] for r in rows] == [0, 1] and rows[1]["env"]["REPLICA_RANK"] == "1"
    assert rows[0]["env"]["BOX_API_TOKEN"] == REDACTED and "box-secret-value-91" not in dry.stdout
    run = cli("run", str(spec), env={**env, **secret}, check_rc=0)
    assert "2 × box" in run.stdout and "SUCCEEDED" in run.stdout
    bad = write_spec(tmp_path, 'entrypoint = "hello:main"\nreplicas = 2\n[backend]\nname = "box"\nroot = 3\n',
                     name="bad.toml")
    proc = cli("dryrun", str(bad), env=env)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "`backend.root` must be str, got 3 (an integer)" in proc.stderr


def test_the_plan_a_dry_run_prints_is_the_plan_run_submits(project, monkeypatch):
    """`diloco dryrun` prints `plan_run(spec).render()`; `diloco run` submits that very plan object."""
    from diloco.launching import launcher
    from diloco.local.executor import LocalProcessExecutor
    from diloco.spec.runspec import load_spec

    monkeypatch.setattr(launcher, "new_run_id", lambda name: "same-run-20260101-000000-abcd")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-value-77")
    spec = load_spec(write_spec(project, 'backend = "local"\nreplicas = 2\nentrypoint = "job:main"\n'
                                         'secrets = ["HF_TOKEN"]\n[env]\nVISIBLE = "1"\n'))
    shown = launcher.plan_run(spec).render()
    submitted: list[LaunchPlan] = []
    real_submit = LocalProcessExecutor.submit

    def spy(self, plan):
        submitted.append(plan)
        return real_submit(self, plan)

    monkeypatch.setattr(LocalProcessExecutor, "submit", spy)
    sup = launcher.new_run(spec)
    first_plan = sup.launcher.first_plan
    sup.start()
    try:
        assert submitted == [first_plan]  # the object planned before the record existed, not a re-plan
        assert submitted[0].render() == shown
        assert "hf-secret-value-77" not in shown and "hf-secret-value-77" not in sup.record.path.read_text()
        results = sup.executor.collect([r.handle for r in sup.ranks], timeout=60)
        assert [r.status for r in results] == ["succeeded", "succeeded"]
    finally:
        for r in sup.ranks:
            sup.executor.cancel(r.handle)


def test_secrets_never_print_and_a_plan_cannot_carry_one():
    secrets = Secrets({"HF_TOKEN": "hf-value-123456"})
    assert "hf-value-123456" not in repr(secrets) and dict(secrets) == {"HF_TOKEN": REDACTED}
    with pytest.raises(TypeError):
        json.dumps(secrets)
    request = LaunchRequest(run_id="r1", n_replicas=2, entrypoint="job:main", secrets=secrets,
                            env={"WANDB_API_KEY": "wandb-value-987654", "PLAIN": "x"})
    assert request.secrets.names == ["HF_TOKEN", "WANDB_API_KEY"] and "WANDB_API_KEY" not in request.env
    assert "value" not in json.dumps(request.to_dict())
    with pytest.raises(BackendError, match="put the value of secret HF_TOKEN into its plan"):
        LaunchPlan("leaky", request, {"env": {"HF_TOKEN": "hf-value-123456"}})
    with pytest.raises(BackendError, match="not plain data"):
        LaunchPlan("odd", request, {"handle": object()})


@pytest.mark.parametrize("fields, expected", [
    ({"n_replicas": 0}, "`n_replicas` must be at least 1, got 0"),
    ({"ranks": (0, 0)}, "must be distinct"),
    ({"ranks": (2,)}, "within 0..1"),
    ({"attempt": -1}, "`attempt` must be at least 0, got -1"),
    ({"attempt": 1.5}, "`attempt` must be int, got 1.5"),
    ({"timeout": float("nan")}, "`timeout` must be a finite number"),
    ({"processes_per_replica": 0}, "`processes_per_replica` must be at least 1, got 0"),
    ({"processes_per_replica": 65}, "`processes_per_replica` must be at most 64, got 65"),
    ({"run_id": "../etc"}, "`run_id` must be lowercase letters"),
    ({"diloco_version": "latest"}, "`diloco_version` must read 'diloco-core==X"),
    ({"entrypoint": "not a ref"}, "is not 'module:function'"),
    ({"env": {"BAD NAME": "1"}}, "environment variable name 'BAD NAME' is not valid"),
])
def test_a_request_is_checked_when_built(fields, expected):
    base = {"run_id": "r1", "n_replicas": 2, "entrypoint": "job:main"}
    with pytest.raises(UserError, match=re.escape(expected)):
        LaunchRequest(**{**base, **fields})


def test_a_request_survives_the_record_without_its_secrets():
    request = LaunchRequest(run_id="r1", n_replicas=3, entrypoint=["python", "t.py"], args={"lr": 0.1},
                            secrets=Secrets({"HF_TOKEN": "v" * 10}), rendezvous="s3://b/p", gpu="H100:8",
                            processes_per_replica=8, workdir="/w")
    data = json.loads(json.dumps(request.to_dict()))
    again = LaunchRequest.from_dict(data, {"HF_TOKEN": "v" * 10})
    assert again == request and again.for_ranks([1], 2).ranks == (1,)
    assert LaunchRequest.from_dict(data).secrets.names == []  # values come only from the resuming shell


# The kit on a broken backend: each rule broken alone must fail the kit's check, naming the rule
# and where the guide states it (a bare AssertionError told a backend's author nothing).

def kit_for(executor_type: type, root: Path) -> ExecutorConformance:
    """The kit over `executor_type`, to call one of its checks directly."""

    class Kit(ExecutorConformance):
        def make_executor(self):
            return executor_type(root=str(root))

    return Kit()


def fails(kit_check, *words: str, section: str) -> None:
    with pytest.raises(AssertionError) as caught:
        kit_check()
    message = str(caught.value)
    assert all(w in message for w in words) and message.endswith(f"(see docs/writing-a-backend.md#{section})"), message


class StrLogPath(box.BoxExecutor):
    def log_path(self, handle):
        return str(super().log_path(handle))  # `diloco logs --follow` calls .stat() on it


class RenamedAttempt(box.BoxExecutor):
    def submit(self, plan):
        return [ReplicaHandle(h.rank, h.backend_name, {("try" if k == "attempt" else k): v for k, v in h.metadata.items()})
                for h in super().submit(plan)]


class ForgetsItCancelled(box.BoxExecutor):
    """Cancels without a marker: the runner writes no result on SIGTERM, so the replica reads failed."""
    started: list[ReplicaHandle] = []

    def submit(self, plan):
        handles = super().submit(plan)
        self.started.extend(handles)
        return handles

    def cancel(self, handle):
        if self.poll(handle) is ReplicaStatus.RUNNING:
            os.killpg(handle.metadata["pid"], signal.SIGTERM)


def test_the_kit_wants_log_path_a_path(tmp_path):
    fails(kit_for(StrLogPath, tmp_path).test_log_path_is_a_local_file_the_output_grows_in,
          "log_path returned str", "pathlib.Path", section="capabilities")


def test_the_kit_wants_the_handles_attempt(tmp_path):
    kit = kit_for(RenamedAttempt, tmp_path)
    fails(kit.test_handles_in_rank_order_and_results_shape, "has no `attempt` 0", section="handles")
    fails(kit.test_relaunch_one_rank_as_new_attempt, "has no `attempt` 1", "diloco logs --attempt", section="handles")


def test_the_kit_wants_a_cancelled_replica_to_read_cancelled(tmp_path):
    kit = kit_for(ForgetsItCancelled, tmp_path)
    kit.wait_timeout = 10.0  # how long it waits for "cancelled", which never comes
    try:
        fails(kit.test_cancel_is_idempotent, "writes no result on SIGTERM", section="variables-and-the-result-file")
    finally:
        for h in ForgetsItCancelled.started:  # the kit stopped before cancelling the other rank
            box.BoxExecutor(root=str(tmp_path)).cancel(h)


@pytest.mark.parametrize("capabilities, words", [
    ({"preemption_signal": "SIGFOO"}, "'SIGFOO' is not a signal name"),
    ({"cloud": "aws-east-1"}, "cloud 'aws-east-1' is not one of"),
    ({"status_detail": True}, "capabilities.status_detail is true but the executor has no `status_detail(handle)`"),
])
def test_the_kit_wants_what_capabilities_declare(tmp_path, capabilities, words):
    broken = type("Broken", (box.BoxExecutor,), {"capabilities": Capabilities(**capabilities)})
    fails(kit_for(broken, tmp_path).test_capabilities_hold, words, section="capabilities")


def test_the_kit_wants_capabilities_on_the_class(tmp_path):
    class OnlyOnInstances(box.BoxExecutor):
        capabilities = None

        def __init__(self, options=None, /, **overrides):
            super().__init__(options, **overrides)
            self.capabilities = box.BoxExecutor.capabilities

    fails(kit_for(OnlyOnInstances, tmp_path).test_satisfies_protocol, "on the class", section="capabilities")


def test_the_kit_wants_statuses_not_strings(tmp_path):
    class PlainStrings(box.BoxExecutor):
        def poll(self, handle):
            return super().poll(handle).value  # `diloco logs --follow` asks it `.is_terminal`

    fails(kit_for(PlainStrings, tmp_path).test_statuses_are_protocol_values, "returns a ReplicaStatus",
          section="the-contract")


def test_the_kit_wants_number_options_bounded(tmp_path):
    @dataclass(frozen=True)
    class Unbounded:
        root: str = option("/tmp", help="where")
        retries: int = option(3, help="retries", min=0)

    broken = type("Broken", (box.BoxExecutor,), {"Options": Unbounded})
    fails(kit_for(broken, tmp_path).test_every_number_option_is_bounded, "['retries']", "min=, max=",
          section="options")


def test_every_section_the_kit_names_is_in_the_guide():
    anchors = set(re.findall(r'"#([a-z-]+)"', Path(testing.__file__).read_text()))
    headings = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^## (.+)$", DOC.read_text(), re.M)}
    assert anchors and anchors <= headings, anchors - headings


def test_option_errors_name_the_executors_backend():
    with pytest.raises(UserError, match=r"unknown key `backend.nope` for backend 'box'"):
        box.BoxExecutor(nope=1)


@pytest.mark.parametrize("error, kept", [
    (BackendError("quota exceeded"), "launching rank 2 on Box failed: quota exceeded; the 2 replica(s) already "
                                     "started were cancelled"),
    (KeyError("JobArn"), None),
    (KeyboardInterrupt(), None),
])
def test_a_failed_submit_undoes_the_started_ranks_whatever_the_error(error, kept):
    """An SDK error the backend never wrapped, or a Ctrl-C, leaves no rank training and billing."""
    cancelled = []

    def start(rank):
        if rank == 2:
            raise error
        return ReplicaHandle(rank, "box", {"attempt": 0})

    with pytest.raises(type(error)) as caught:
        start_each(range(4), start, lambda h: cancelled.append(h.rank), platform="Box")
    assert cancelled == [0, 1]
    if kept:  # diloco's own errors: one line of the same type
        assert str(caught.value) == kept
    else:  # anything else: unchanged, traceback and all, with what was undone as a note
        assert caught.value is error
        assert error.__notes__ == ["diloco: launching rank 2 on Box failed; the 2 replica(s) already started were "
                                   "cancelled"]
