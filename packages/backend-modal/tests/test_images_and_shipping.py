"""What leaves the machine: the default image (the launcher's diloco as wheels, no package index)
and the workdir (only the shipment: never credentials, never .gitignored files), as the fake
Modal server recorded them from the real client."""

from __future__ import annotations

import hashlib
import json

import pytest

from diloco.errors import BackendError, UserError
from diloco.testing import launch, plan_for
from diloco_modal.definition import CODE_DIR
from diloco_modal.executor import ModalExecutor

REPORT = "diloco.testing.entrypoints:report"


def test_the_default_image_installs_the_launchers_wheels_and_needs_no_index(fake_modal):
    executor = ModalExecutor()
    plan = plan_for(executor, 1, REPORT, run_id="r1")
    (result,) = executor.collect(executor.submit(plan), timeout=60)
    assert result.status == "succeeded", result.error
    images = fake_modal.images()
    assert all(i["status"] == "success" for i in images)
    commands = [c for i in images for c in i["dockerfile_commands"]]
    assert not any("diloco-core" in c or "diloco-replica" in c for c in commands)  # never from an index
    wheels = plan.body["image"]["wheels"]
    assert f"RUN python -m pip install {' '.join(w['path'] for w in wheels)}" in commands
    installed = next(i for i in images if any("/opt/diloco/wheels/" in c for c in i["dockerfile_commands"]))
    for wheel in wheels:  # the planned bytes, copied into the image before the install step
        assert installed["files"][wheel["path"]] == wheel["sha256"]
        assert hashlib.sha256(fake_modal.store.blob_path(wheel["sha256"]).read_bytes()).hexdigest() == wheel["sha256"]


def test_installing_diloco_from_the_index_fails_as_the_image_build_would(fake_modal):
    """What the default image did before: diloco is not published, so pip finds no version."""
    with pytest.raises(BackendError, match=r"(?s)ImageBuildError: .*No matching distribution found for "
                                           r"diloco-core==0\.2\.0"):
        launch(ModalExecutor(pip=["diloco-core==0.2.0"]), 1, REPORT, run_id="r1")


def workdir_with_secrets(root):
    files = {
        "train.py": "def main():\n    return 1\n",
        "pkg/__init__.py": "",
        "pkg/model.py": "W = 1\n",
        ".gitignore": "outputs/\n*.log\n",
        "sub/.env": "API_KEY=leaked\n",  # credentials, at any depth
        ".env": "API_KEY=leaked\n",
        ".aws/credentials": "[default]\naws_secret_access_key=leaked\n",
        "a/b/key.pem": "-----BEGIN PRIVATE KEY-----\n",
        "notes/credentials.json": "{}\n",
        "outputs/ckpt.bin": "x" * 100,  # .gitignored
        "run.log": "noise\n",
        "weights.ckpt": "x" * 100,  # [backend] ignore
        ".git/config": "[core]\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"train.py", "pkg/__init__.py", "pkg/model.py", ".gitignore"}


REGISTRY = "ghcr.io/me/trainer:1"  # an image that holds diloco: the workdir is what these tests look at


def test_credentials_and_gitignored_files_are_never_uploaded(fake_modal, tmp_path):
    """`.env`, `.aws/credentials`, keys are never uploaded at any depth, nor what .gitignore names:
    the fake server kept every uploaded file, and none of those is among them."""
    work = tmp_path / "work"
    shipped = workdir_with_secrets(work)
    executor = ModalExecutor(image=REGISTRY)
    (handle,) = launch(executor, 1, REPORT, run_id="r1", workdir=str(work))
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "succeeded", result.error
    uploaded = fake_modal.uploaded_files()
    for never in ("sub/.env", ".env", ".aws/credentials", "a/b/key.pem", "notes/credentials.json",
                  "outputs/ckpt.bin", "run.log", ".git/config"):
        assert f"{CODE_DIR}/{never}" not in uploaded, never
    assert {f"{CODE_DIR}/{rel}" for rel in shipped} <= uploaded
    assert "leaked" not in json.dumps(fake_modal.rpcs())


def test_backend_ignore_adds_patterns_and_the_dry_run_counts_exactly_what_is_uploaded(fake_modal, tmp_path):
    work = tmp_path / "work"
    shipped = workdir_with_secrets(work)
    executor = ModalExecutor(image=REGISTRY, ignore=["*.ckpt"])
    plan = plan_for(executor, 1, REPORT, run_id="r1", workdir=str(work))
    summary = plan.body["image"]["workdir"]["shipment"]
    assert summary["files"] == len(shipped) and summary["ignore"] == ["*.ckpt"]
    assert summary["bytes"] == sum((work / rel).stat().st_size for rel in shipped)
    (handle,) = executor.submit(plan)
    (result,) = executor.collect([handle], timeout=60)
    assert result.status == "succeeded", result.error
    uploaded = {f for f in fake_modal.uploaded_files() if f.startswith(CODE_DIR + "/")}
    assert uploaded == {f"{CODE_DIR}/{rel}" for rel in shipped}
    container_files = {f for f in fake_modal.spec(handle.metadata["id"])["files"] if f.startswith(CODE_DIR)}
    assert container_files == uploaded  # the container holds what was shipped, and nothing else


def test_a_workdir_that_changed_since_the_plan_is_refused(fake_modal, tmp_path):
    work = tmp_path / "work"
    workdir_with_secrets(work)
    executor = ModalExecutor(image=REGISTRY)
    plan = plan_for(executor, 1, REPORT, run_id="r1", workdir=str(work))
    (work / "added_later.py").write_text("x = 2\n")
    with pytest.raises(UserError, match="changed since it was planned: plan and launch again"):
        executor.submit(plan)
    assert fake_modal.objects() == []


def test_a_container_holds_only_its_declared_environment(fake_modal, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-launchers-own-credential")
    executor = ModalExecutor()
    handles = launch(executor, 1, "os:environ.copy", run_id="r1")  # the replica's whole environment
    (result,) = executor.collect(handles, timeout=60)
    assert result.status == "succeeded" and "AWS_SECRET_ACCESS_KEY" not in result.result
