"""Cross-package integration tests: the launcher and the replica runtime together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.testing.scenarios import events_of, one_global_model, record_of, wait_for_round  # noqa: F401 (shared)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("DILOCO_STATE_DIR", str(d))
    return d


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    """A fault-free run of the fault tests' spec (`fault_harness.spec_for`, the main job's model):
    the yardstick for their loss, run once a session for every module that compares with it."""
    from fault_harness import fault_free, spec_for

    tmp = tmp_path_factory.mktemp("reference")
    results = fault_free(spec_for(tmp), tmp / "state")
    assert len(results) == 4 and len({r["theta_digest"] for r in results}) == 1
    return results[0]


@pytest.fixture
def cli(state_dir):
    def run(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "DILOCO_STATE_DIR": str(state_dir), **(env or {})})
    return run


# The main job's model (dim 128, 2 layers) where a test compares losses across runs; the rest
# prove launches, faults and rejoins, for which a model a sixth the size trains alike, faster.
SMALL_MODEL = {"batch_size = 16": "batch_size = 8", "context = 64": "context = 32\ndim = 64\nlayers = 1\n"
               "max_bytes = 500_000", "parameters = 470528": "parameters = 84928"}


def tiny_spec(tmp_path: Path, *, steps: int = 120, sync_every: int = 20, transport: str = "fp32",
              extra: str = "", replicas: int = 4, restart: str = "", model: str = "small") -> Path:
    """The tiny-LM main job, shortened: same code, fewer steps; `model="main"` keeps its model."""
    text = (ROOT / "examples" / "tiny-lm" / "diloco.toml").read_text()
    text = text.replace('entrypoint = "tiny_lm:train"', 'entrypoint = "tiny_lm:train"\nworkdir = "{}"'.format(
        ROOT / "examples" / "tiny-lm"))
    text = text.replace("steps = 1500", f"steps = {steps}").replace("sync_every = 50", f"sync_every = {sync_every}")
    text = text.replace('transport = "fp32"', f'transport = "{transport}"').replace("replicas = 4", f"replicas = {replicas}")
    if model == "small":
        for main, small in SMALL_MODEL.items():
            assert main in text, f"examples/tiny-lm/diloco.toml no longer says {main!r}"
            text = text.replace(main, small)
    if restart:
        text = text.replace("[restart]\n", f"[restart]\n{restart}\n")
    text += extra
    path = tmp_path / "diloco.toml"
    path.write_text(text)
    return path


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on 127.0.0.1 (a real S3 API over HTTP) and a fresh bucket; the launcher's
    shell gets its AWS_* variables, replicas only what the spec passes them."""
    from diloco.testing.s3server import moto_s3

    with moto_s3() as server:
        for k, v in server["env"].items():
            monkeypatch.setenv(k, v)
        yield server


# Cloud variables reach replicas only through `secrets` (docs/security.md#variables): the
# replicas then address the store the launcher watches, from the launcher's own shell.
S3_SPEC = """rendezvous = "{uri}"
secrets = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"]
"""


def placed_by_groups(spec: Path) -> str:
    """The spec's text without its top-level backend and replica count: the [[group]] tables a
    test appends say where each replica runs."""
    return spec.read_text().replace('backend = "local"\n', "").replace("replicas = 4\n", "")


def on_s3(spec: Path, s3: dict) -> Path:
    """Point a spec at the moto S3 server the way a user would on a cloud backend."""
    text = spec.read_text()
    head, sep, rest = text.partition("\n[")
    text = head + "\n" + S3_SPEC.format(uri=s3["uri"]) + sep + rest
    spec.write_text(text)
    return spec


# Tests that mostly wait — for an outage to pass, a disk to free, a stand-in cloud's lifecycle, a
# slowed replica's timeline — rather than train. `scripts/integration-tests` (the integration
# environment's test command) runs them in a pytest process of their own beside the one running
# the tests that train: the machine's cores are busy with one of those at a time, and a waiting
# test then costs the suite none of its wall time. Each runs under the other process's load,
# which none of them may depend on (a test that flakes under load is a bug).
MOSTLY_WAITING = (
    "tests/test_full_disk.py::",
    "tests/test_store_outage.py::",
    "tests/test_progress_timeline.py::",
    "tests/test_modal_e2e.py::",
    # the stand-in clouds' end-to-end runs (pods, jobs and blob containers coming and going around
    # a few small rounds): since replicas fork from a warm template (diloco.local.warmstart) the training
    # processes no longer keep the cores busy, and this process ended at 420 s of their 1,170
    "tests/test_groups_e2e.py::",
    "tests/test_azure_store.py::",
    "tests/test_eks_e2e.py::",
    # the SageMaker stand-in's jobs, moved here when replicas of several nodes added a run to it and
    # to the tests that train (tests/test_multinode.py), to keep the three processes even
    "tests/test_sagemaker_e2e.py::",
    "tests/test_benches.py::test_the_bench_runs_in_quick_mode_and_prints_its_json[recovery.py]",
    "tests/test_benches.py::test_the_bench_runs_in_quick_mode_and_prints_its_json[scale.py]",
    "tests/test_benches.py::test_the_bench_runs_in_quick_mode_and_prints_its_json[nodes.py]",
)


# The tests that train are split once more, into two pytest processes side by side: training
# leaves a third of the machine idle (replicas starting, rounds waiting on each other, the fault
# runs' stretched phases), which the other process fills. These modules (the fault runs: kills,
# faults, a gone replica, elastic sizes, skewed clocks, killed Trainer and Lightning replicas, the
# main job; the modules whose tests compare with the fault-free `reference` are among them, so that
# session fixture runs once) go to one, every other module to the other: in CI on 2026-11-30 the
# two took 1,147 s and 1,172 s beside the other suites.
FAULT_RUNS = tuple(f"tests/{m}.py::" for m in (
    "test_fault_injection", "test_soak", "test_gone", "test_elastic", "test_process_groups",
    "test_skewed_clocks", "test_main_job", "test_hf_trainer", "test_lightning"))


def pytest_configure(config):
    config.addinivalue_line("markers", "mostly_waiting: waits more than it trains (tests/conftest.py MOSTLY_WAITING)")
    config.addinivalue_line("markers", "fault_runs: a fault run or the main job (tests/conftest.py FAULT_RUNS)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(MOSTLY_WAITING):
            item.add_marker(pytest.mark.mostly_waiting)
        elif item.nodeid.startswith(FAULT_RUNS):
            item.add_marker(pytest.mark.fault_runs)
