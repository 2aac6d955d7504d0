"""What a spec becomes on Modal (dry runs: no cloud, no token) and the one-line errors around it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diloco.errors import UserError
from diloco.testing import plan_for
from diloco_modal.definition import CODE_DIR, build_image, build_mounts, modal_gpu
from diloco_modal.executor import ModalExecutor

EP = "diloco.testing.entrypoints:report"


def spec_file(tmp_path, backend: str = "", top: str = "") -> str:
    (tmp_path / "train.py").write_text("def main():\n    return 1\n")
    (tmp_path / "requirements.txt").write_text("transformers\n")
    path = tmp_path / "diloco.toml"
    path.write_text(f'replicas = 2\nentrypoint = "train:main"\nrendezvous = "s3://bucket/runs"\n{top}'
                    f'secrets = ["HF_TOKEN"]\n[backend]\nname = "modal"\n{backend}')
    return str(path)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_TOKEN": "hf_secret_value_123", **(env or {})})


def test_dryrun_shows_the_whole_sandbox_definition_without_secrets(tmp_path):
    proc = cli("dryrun", spec_file(tmp_path, 'requirements = "requirements.txt"\npip = ["datasets"]\n'
                                             'volumes = {"/data" = "corpus"}\nregion = "us-east"\n'
                                             'bucket_mounts = {"/ckpt" = {bucket = "ckpts", secret = "aws"}}\n',
                                   top='gpu = "h100:8"\n'))
    assert proc.returncode == 0, proc.stderr
    assert "hf_secret_value_123" not in proc.stdout
    plan = json.loads(proc.stdout)
    image = plan["image"]
    assert image["base"]["debian_slim"]["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    # the launcher's own diloco, as wheels named in the plan, installed from their paths in the image
    names = [w["file"] for w in image["wheels"]]
    assert [n.split("-")[0] for n in names] == ["diloco_core", "diloco_replica"]
    assert all(n.endswith(".whl") for n in names)
    assert image["steps"][:2] == [{"copy": w["file"], "to": w["path"]} for w in image["wheels"]]
    assert image["steps"][2] == {"run": "python -m pip install " + " ".join(w["path"] for w in image["wheels"])}
    assert image["steps"][3] == {"run": "python -m pip install datasets"} and image["pip"] == ["datasets"]
    assert image["steps"][4] == {"requirements": image["requirements"]}
    assert image["requirements"].endswith("requirements.txt")
    assert "diloco-core" not in json.dumps(image) and "diloco-replica" not in json.dumps(image)  # no index
    shipped = image["workdir"]
    assert shipped["local"] == str(tmp_path.resolve()) and shipped["remote"] == CODE_DIR
    assert shipped["shipment"]["files"] == 3 and shipped["shipment"]["bytes"] > 0  # train.py, requirements, diloco.toml
    assert {f["path"] for f in shipped["shipment"]["largest"]} == {"train.py", "requirements.txt", "diloco.toml"}
    sb = plan["sandboxes"][1]
    assert sb["gpu"] == "H100:8" and sb["region"] == "us-east" and sb["workdir"] == CODE_DIR
    assert sb["command"][:3] == ["python", "-m", "diloco_replica.torchrun"] and "8" in sb["command"]  # 8 GPUs, 8 processes
    assert sb["tags"] == {"diloco-run": sb["tags"]["diloco-run"], "diloco-rank": "1", "diloco-attempt": "0"}
    assert sb["name"].endswith("-r1-a0") and len(sb["name"]) <= 64
    env = sb["env"]
    assert env["REPLICA_RANK"] == "1" and env["DILOCO_REPLICAS"] == "2" and "WORLD_SIZE" not in env
    assert env["DILOCO_PREEMPTION_SIGNAL"] == "SIGINT" and env["PYTHONPATH"] == CODE_DIR
    assert sb["secrets"] == {"forwarded": {"HF_TOKEN": "REDACTED"}, "named": []}
    assert sb["volumes"] == {"/data": "corpus"} and sb["bucket_mounts"]["/ckpt"]["bucket"] == "ckpts"


@pytest.mark.parametrize("top,backend,message", [
    ('gpu = "Z100"\n', "", "unknown GPU type 'Z100' for Modal; use one of T4,"),
    ('gpu = "H100:16"\n', "", "GPU count in 'H100:16' must be a whole number from 1 to 8"),
    ("timeout = 100000\n", "", "timeout 100000s exceeds Modal's longest sandbox lifetime"),
    ("", 'requirements = "missing.txt"\n', "[backend] requirements 'missing.txt': no such file"),
    ("", 'function = "train:main"\n', "`secrets`"),
    ("", 'colour = "blue"\n', "unknown key `backend.colour` for backend 'modal'"),
])
def test_bad_input_is_one_line(tmp_path, top, backend, message):
    path = spec_file(tmp_path, backend, top=top)
    if "function" in backend:  # function mode with a spec gpu: the decorator owns the GPU
        text = open(path).read().replace('secrets = ["HF_TOKEN"]\n', 'gpu = "A100"\n')
        open(path, "w").write(text)
        message = "function mode: the GPU is set by your @app.function(gpu=...)"
    proc = cli("dryrun", path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("uri", ["file:///tmp/store", "memory://store"])
def test_a_rendezvous_modal_containers_cannot_see_is_refused(tmp_path, uri):
    path = spec_file(tmp_path)
    text = open(path).read().replace("s3://bucket/runs", uri)
    open(path, "w").write(text)
    proc = cli("dryrun", path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "modal" in proc.stderr and "s3://" in proc.stderr


def test_gpu_names_follow_modal():
    assert modal_gpu("a10g:4") == "A10G:4" and modal_gpu("H100!") == "H100!" and modal_gpu(None) is None
    assert modal_gpu("MI300X", ["MI300X"]) == "MI300X"
    with pytest.raises(UserError):
        modal_gpu("H100:0")


def test_the_definition_builds_real_modal_objects_without_a_token(tmp_path, monkeypatch):
    import modal

    from diloco_modal.wheels import materialize

    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    (tmp_path / "code").mkdir()
    plan = plan_for(ModalExecutor(volumes={"/data": "corpus"},
                                  bucket_mounts={"/b": {"bucket": "ckpts", "read_only": True}}),
                    2, EP, run_id="r1", workdir=str(tmp_path / "code")).body
    image = build_image(modal, plan["image"], materialize(plan["image"]["wheels"], tmp_path / "wheels"))
    mounts = build_mounts(modal, plan["sandboxes"][0], None)
    assert isinstance(image, modal.Image)
    assert isinstance(mounts["/data"], modal.Volume) and isinstance(mounts["/b"], modal.CloudBucketMount)
    registry = plan_for(ModalExecutor(image="ghcr.io/me/train:1"), 1, EP, run_id="r1").body["image"]
    assert registry["base"] == {"registry": "ghcr.io/me/train:1"} and registry["pip"] == [] and "wheels" not in registry
    assert isinstance(build_image(modal, registry, {}), modal.Image)


def test_wheels_that_changed_since_the_plan_are_refused(tmp_path):
    from diloco_modal.wheels import materialize

    plan = plan_for(ModalExecutor(), 1, EP, run_id="r1").body["image"]["wheels"]
    stale = [{**plan[0], "sha256": "0" * 64}, plan[1]]
    with pytest.raises(UserError, match=r"the diloco installed here changed since the plan \(diloco_core-.*whl "
                                        r"differs\): plan and launch again"):
        materialize(stale, tmp_path)


def test_listing_backends_does_not_import_modal():
    code = ("import sys; from diloco.plugins.discovery import backends; names = list(backends()); "
            "print('modal' in names, 'modal' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


@pytest.mark.skipif(not os.environ.get("DILOCO_ISOLATED_ENV"), reason="needs the isolated modal environment")
@pytest.mark.parametrize("module", ["torch", "numpy", "kubernetes"])
def test_installing_core_and_this_backend_pulls_no_torch(module):
    """diloco-replica is installed next to the launcher with --no-deps (it is packed into the
    default image as a wheel, never run here): still no torch."""
    import importlib.util

    assert importlib.util.find_spec(module) is None


def test_sandbox_names_of_long_run_ids_stay_unique_and_valid():
    """Run ids are up to 63 characters (`<slug≤30>-<YYYYmmdd-HHMMSS>-<16 hex>`), their randomness at
    the end: a name cut to Modal's 64 characters must not lose it (two runs, one sandbox name)."""
    import re

    from diloco_modal.definition import sandbox_name

    stem = "a-thirty-character-slug-for-it-20250101-120000-"
    one, two = stem + "0123456789abcdef", stem + "0123456789abcdee"
    assert len(one) == len(two) == 63
    names = {sandbox_name(run, rank, attempt) for run in (one, two) for rank in (0, 7, 1023) for attempt in (0, 99)}
    assert len(names) == 12  # every run, rank and attempt its own name
    for name in names:
        assert len(name) <= 64 and re.fullmatch(r"[a-zA-Z0-9\-_.]+", name), name
    assert sandbox_name(one, 3, 2) == sandbox_name(one, 3, 2)  # the same run finds its sandboxes again
    assert sandbox_name(one, 3, 2).startswith("a-thirty-character-slug") and sandbox_name(one, 3, 2).endswith("-r3-a2")
    assert sandbox_name("short-run", 3, 2) == "short-run-r3-a2"  # a run id that fits is kept whole
