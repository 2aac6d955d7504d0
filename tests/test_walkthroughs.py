"""docs/walkthroughs: each page's spec dry-runs as the page says (as far as this machine allows:
no cluster, no cloud), what the page claims of the plan is in it, and every diloco command it
shows exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "walkthroughs").glob("*.md"))
FAKE_AWS = {"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "AKIAWALKTHROUGH", "AWS_SECRET_ACCESS_KEY": "walk-secret"}


def dryrun(page: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """The page's ```toml walkthrough block, dry-run beside the tiny LM it trains (a hidden,
    ignored file in examples/tiny-lm, so the entrypoint resolves as on the user's machine)."""
    block = re.search(r"```toml walkthrough\n(.*?)```", page.read_text(), re.S)
    assert block, f"{page.name} has no ```toml walkthrough block"
    spec = ROOT / "examples" / "tiny-lm" / f".walkthrough-{page.stem}-{os.getpid()}.toml"
    spec.write_text(block.group(1))
    try:
        return subprocess.run([sys.executable, "-m", "diloco", "dryrun", str(spec)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **FAKE_AWS, "DILOCO_STATE_DIR": str(tmp_path / "state")})
    finally:
        spec.unlink()


def test_there_are_the_three_new_users_pages():
    assert [p.stem for p in PAGES] == ["sagemaker-spot-and-modal", "slurm-university"]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_each_pages_spec_dry_runs_and_shows_no_secret(page, tmp_path):
    proc = dryrun(page, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "walk-secret" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    if page.stem == "slurm-university":  # what the page says of the batch script
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
