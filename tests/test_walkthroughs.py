"""docs/walkthroughs: each page's spec dry-runs as the page says (as far as this machine allows:
no cluster, no cloud), what the page claims of the plan is in it, and every diloco command it
shows exists. The RunPod page's backend is loaded from the page itself as a plugin, dry-runs its
spec, passes the conformance kit's planning checks and reads RunPod's pod states as the page says."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "walkthroughs").glob("*.md"))
FAKE_AWS = {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "AKIAWALKTHROUGH", "AWS_SECRET_ACCESS_KEY": "walk-secret"}
RUNPOD_PAGE = ROOT / "docs" / "walkthroughs" / "runpod-backend.md"
RUNPOD_KEY = "rp-walk-secret-key"


def block(page: Path, language: str) -> str:
    found = re.search(rf"```{language} walkthrough\n(.*?)```", page.read_text(), re.S)
    assert found, f"{page.name} has no ```{language} walkthrough block"
    return found.group(1)


def page_plugin(page: Path, where: Path) -> dict[str, str]:
    """The environment that loads the page's ```python walkthrough block as a diloco plugin."""
    (where / "diloco_runpod.py").write_text(block(page, "python"))
    return {"DILOCO_PLUGINS": "diloco_runpod", "RUNPOD_API_KEY": RUNPOD_KEY,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))}


def spec_file(text: str, tmp_path: Path) -> Path:
    """A page's spec, its code in examples/tiny-lm as `workdir` (the spec's own directory on the
    user's machine), written under tmp_path: tests side by side never see it in the example."""
    spec = tmp_path / "diloco.toml"
    workdir = ROOT / "examples" / "tiny-lm"
    assert 'entrypoint = "tiny_lm:train"' in text, "the walkthroughs train examples/tiny-lm"
    entrypoint = 'entrypoint = "tiny_lm:train"'
    spec.write_text(text.replace(entrypoint, f'{entrypoint}\nworkdir = "{workdir}"'))
    return spec


def dryrun(page: Path, tmp_path: Path, text: str | None = None) -> subprocess.CompletedProcess:
    """The page's ```toml walkthrough block (or `text`), dry-run with the tiny LM it trains."""
    spec = spec_file(block(page, "toml") if text is None else text, tmp_path)
    plugin = page_plugin(page, tmp_path) if "```python walkthrough" in page.read_text() else {}
    env = {**os.environ, **FAKE_AWS, **plugin, "DILOCO_STATE_DIR": str(tmp_path / "state")}
    return subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_there_are_the_three_new_users_pages():
    assert [p.stem for p in PAGES] == ["runpod-backend", "sagemaker-spot-and-modal", "slurm-university"]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_each_pages_spec_dry_runs_and_shows_no_secret(page, tmp_path):
    proc = dryrun(page, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "walk-secret" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert RUNPOD_KEY not in proc.stdout + proc.stderr
    if page.stem == "runpod-backend":  # what the page says of the plan: each pod's POST body
        bodies = re.findall(r'"imageName": "ghcr.io/you/tiny-lm-diloco:0.2.0"', proc.stdout)
        assert len(bodies) == 4, proc.stdout
        for text in ('"interruptible": true', '"cloudType": "COMMUNITY"', '"gpuCount": 1', "REDACTED",
                     '"gpuTypeIds": [', "diloco-runpod-exit", "/stop"):
            assert text in proc.stdout, text
    elif page.stem == "slurm-university":  # what the page says of the batch script
        for line in ("#SBATCH --cpus-per-task=16", "#SBATCH --time=240", "#SBATCH --gpus-per-node=4",
                     "#SBATCH --account=my-project", "module load cuda/12.4"):
            assert line in proc.stdout, line
    else:  # the keys are the Modal group's alone
        spot, modal = proc.stdout.split("# group ")[1:]
        assert spot.startswith("spot:") and "AWS_ACCESS_KEY_ID" not in spot
        assert modal.startswith("modal:") and "AWS_ACCESS_KEY_ID" in modal
        assert "model size unknown" not in proc.stderr


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_diloco_command_a_page_shows_exists(page):
    commands = set(re.findall(r"^diloco (\w+)", page.read_text(), re.M))
    assert commands, page.name
    for command in sorted(commands):
        proc = subprocess.run([sys.executable, "-m", "diloco", command, "--help"], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, f"{page.name}: `diloco {command}`: {proc.stderr}"


def runpod_module(tmp_path: Path):
    (tmp_path / "diloco_runpod.py").write_text(block(RUNPOD_PAGE, "python"))
    spec = importlib.util.spec_from_file_location("diloco_runpod_walkthrough", tmp_path / "diloco_runpod.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


PLANNING_CHECKS = ["test_satisfies_protocol", "test_every_option_is_documented", "test_every_number_option_is_bounded",
                   "test_capabilities_hold", "test_plan_shows_request_without_secrets",
                   "test_plan_is_a_pure_function_of_the_request"]


@pytest.mark.parametrize("check", PLANNING_CHECKS)
def test_the_runpod_page_backend_passes_the_kits_planning_checks(check, tmp_path):
    """The kit's checks that need no platform (the others start pods: the page says to run them
    against a RunPod account)."""
    from diloco.testing import ExecutorConformance

    module = runpod_module(tmp_path)

    class Kit(ExecutorConformance):
        def make_executor(self):
            return module.RunPodExecutor(image="ghcr.io/you/replica:0.2.0")

    getattr(Kit(), check)()


def test_the_runpod_page_backend_refuses_a_file_rendezvous_in_one_line(tmp_path):
    text = block(RUNPOD_PAGE, "toml").replace("s3://my-bucket/diloco", f"file://{tmp_path}/store")
    proc = dryrun(RUNPOD_PAGE, tmp_path, text)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "file://" in proc.stderr, proc.stderr


# RunPod's pod records (REST v1 `desiredStatus`; a deleted pod answers 404) and the log tail, as
# the page's section 1 describes them, read into diloco's statuses and exit codes.
EXIT = "diloco-runpod-exit "


@pytest.mark.parametrize("pod, tail, spot, expected", [
    ({"desiredStatus": "RUNNING"}, None, False, ("running", None)),
    ({"desiredStatus": "RUNNING"}, None, True, ("running", None)),
    ({"desiredStatus": "EXITED"}, f"step 10\n{EXIT}0\n", False, ("succeeded", 0)),
    ({"desiredStatus": "EXITED"}, f"{EXIT}0\n", True, ("succeeded", 0)),
    ({"desiredStatus": "EXITED"}, f"Traceback\n{EXIT}1\n", False, ("failed", 1)),
    ({"desiredStatus": "EXITED"}, f"{EXIT}78\n", True, ("failed", 78)),
    ({"desiredStatus": "EXITED"}, f"{EXIT}0\nrestarted\n{EXIT}137\n", False, ("failed", 137)),  # the last counts
    ({"desiredStatus": "EXITED"}, "step 10\n", True, ("failed", 75)),        # RunPod stopped a spot pod
    ({"desiredStatus": "EXITED"}, "step 10\n", False, ("cancelled", None)),  # someone stopped it
    ({"desiredStatus": "EXITED"}, None, False, ("cancelled", None)),
    ({"desiredStatus": "EXITED"}, f"{EXIT}x\n", True, ("failed", 75)),       # a garbled line is no exit line
    ({"desiredStatus": "TERMINATED"}, None, True, ("cancelled", None)),
    (None, None, False, ("cancelled", None)),                                # deleted: 404
])
def test_the_runpod_page_reads_pod_states_as_it_says(pod, tail, spot, expected, tmp_path):
    status, code = runpod_module(tmp_path).status_of(pod, tail, spot)
    assert (status.value, code) == expected


def test_the_runpod_page_backend_without_an_api_key_says_so(tmp_path, monkeypatch):
    from diloco.errors import UserError
    from diloco.protocol import ReplicaHandle

    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    module = runpod_module(tmp_path)
    handle = ReplicaHandle(0, "runpod", {"pod_id": "p1", "spot": False, "attempt": 0})
    with pytest.raises(UserError, match="RUNPOD_API_KEY is not set"):
        module.RunPodExecutor(image="x").poll(handle)


def test_the_runpod_page_backend_keeps_the_last_status_while_runpod_is_throttled(tmp_path, monkeypatch):
    """RunPod's REST API answering 503 or 429 (down, throttled) leaves a pod in the status it was last
    read in; a 404 (deleted) reads as cancelled."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from diloco.protocol import ReplicaHandle, ReplicaStatus

    answers = [(503, b""), (200, b'{"desiredStatus": "RUNNING"}'), (429, b""), (503, b""), (404, b"")]
    seen = []

    class RunPod(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Authorization")))
            code, body = answers.pop(0)
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), RunPod)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        module = runpod_module(tmp_path)
        monkeypatch.setattr(module, "REST", f"http://127.0.0.1:{server.server_address[1]}/v1")
        monkeypatch.setenv("RUNPOD_API_KEY", RUNPOD_KEY)
        executor = module.RunPodExecutor(image="x")
        handle = ReplicaHandle(0, "runpod", {"pod_id": "pod-7", "spot": True, "attempt": 0})
        statuses = [executor.poll(handle) for _ in range(5)]
    finally:
        server.shutdown()
    assert statuses == [ReplicaStatus.PENDING, ReplicaStatus.RUNNING, ReplicaStatus.RUNNING, ReplicaStatus.RUNNING,
                        ReplicaStatus.CANCELLED]
    assert seen[0] == ("/v1/pods/pod-7", f"Bearer {RUNPOD_KEY}")
