"""The backend contract itself: request → plan → submit, with secrets apart.

The example backend of docs/writing-a-backend.md is taken from the doc itself, installed as a
package (a module plus its dist-info with the `diloco` entry point, the layout pip leaves), and
run through the conformance kit, `diloco backends`, `diloco dryrun` and the hello job. The
first-contract executor (`diloco.testing.firstcontract`) runs through the same kit via the adapter.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from conftest import write_spec
from diloco.errors import BackendError, UserError
from diloco.replicaenv import REDACTED
from diloco.request import LaunchPlan, LaunchRequest, Secrets
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


def test_the_example_stays_small():
    lines = [x for x in example_backend_source().splitlines() if x.strip()]
    assert len(lines) <= 80, len(lines)  # about 60 lines of executor, plus imports and the hook


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
    from diloco import launcher
    from diloco.local import LocalProcessExecutor
    from diloco.spec import load_spec

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
    first_plan = sup.first_plan
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
    ({"n_replicas": 0}, "n_replicas must be at least 1"),
    ({"ranks": (0, 0)}, "must be distinct"),
    ({"ranks": (2,)}, "within 0..1"),
    ({"attempt": -1}, "attempt must be a whole number"),
    ({"timeout": float("nan")}, "`timeout` must be a finite number"),
    ({"processes_per_replica": 0}, "processes_per_replica must be 1..64"),
    ({"run_id": "../etc"}, "run id '../etc' must be lowercase"),
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
