"""The reference image recipe (packages/replica/Dockerfile) pins what the packages say.

No Docker engine runs here, so the image itself is not built in CI; what can drift silently is
checked: the diloco versions it installs are the packages' own, its PyTorch base is the torch the
tests pin, and it ends in the `diloco-replica` entrypoint the backends run.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "packages" / "replica" / "Dockerfile"


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))


def version_of(package: str) -> str:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]["version"]


def test_the_image_installs_the_packages_own_versions():
    args = build_args()
    assert args["DILOCO_CORE_VERSION"] == version_of("core"), "bump DILOCO_CORE_VERSION in the Dockerfile"
    assert args["DILOCO_REPLICA_VERSION"] == version_of("replica"), "bump DILOCO_REPLICA_VERSION in the Dockerfile"
    assert '"diloco-core==${DILOCO_CORE_VERSION}"' in DOCKERFILE.read_text()
    assert '"diloco-replica==${DILOCO_REPLICA_VERSION}"' in DOCKERFILE.read_text()


def test_the_image_torch_is_the_torch_the_tests_pin():
    pinned = set(re.findall(r'"torch==([\d.]+)"', (ROOT / "hatch.toml").read_text()))
    assert pinned == {build_args()["TORCH_VERSION"]}, f"hatch.toml pins torch {pinned}; the Dockerfile's base differs"
    assert "FROM pytorch/pytorch:${TORCH_VERSION}-${CUDA_TAG}" in DOCKERFILE.read_text()
    assert f"torch=={build_args()['TORCH_VERSION']}" in (ROOT / ".ci" / "constraints.txt").read_text()


def test_the_image_runs_the_replica_entrypoint_the_backends_call():
    text = DOCKERFILE.read_text()
    assert text.rstrip().splitlines()[-1] == 'ENTRYPOINT ["diloco-replica"]'
    scripts = tomllib.loads((ROOT / "packages" / "replica" / "pyproject.toml").read_text())["project"]["scripts"]
    assert "diloco-replica" in scripts
    for readme in ("backend-eks", "backend-sagemaker"):
        assert "packages/replica/Dockerfile" in (ROOT / "packages" / readme / "README.md").read_text(), readme
