"""Which package a release tag publishes, checked against that package's version.

    python scripts/release_package.py core-v0.2.0        # prints packages/core
    python scripts/release_package.py --check-all        # every package's tag would be accepted

Tags are `<folder>-v<version>` for a folder under packages/ (core-v*, replica-v*,
backend-eks-v*, backend-modal-v*, backend-sagemaker-v*, backend-slurm-v*); the version must equal the one in that
package's pyproject.toml, so a tag can never publish a wheel whose version says something else.
The release workflow (.github/workflows/release.yml) runs this before building.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"^(?P<folder>[a-z][a-z0-9-]*)-v(?P<version>\d+(\.\d+)*([ab]|rc)?\d*(\.post\d+)?(\.dev\d+)?)$")


def packages() -> dict[str, str]:
    """{folder: version} for every package."""
    out = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        out[pyproject.parent.name] = tomllib.loads(pyproject.read_text())["project"]["version"]
    return out


def package_for(tag: str) -> str:
    m = TAG.match(tag)
    found = packages()
    if not m:
        raise SystemExit(f"error: tag {tag!r} is not <package>-v<version> (e.g. core-v0.2.0); "
                         f"packages: {', '.join(found)}")
    folder, version = m["folder"], m["version"]
    if folder not in found:
        raise SystemExit(f"error: tag {tag!r} names no package folder {folder!r}; packages: {', '.join(found)}")
    if found[folder] != version:
        raise SystemExit(f"error: tag {tag!r} says {version} but packages/{folder}/pyproject.toml says "
                         f"{found[folder]}: bump the version there first (or fix the tag)")
    return f"packages/{folder}"


def main(argv: list[str]) -> int:
    if argv == ["--check-all"]:
        for folder, version in packages().items():
            assert package_for(f"{folder}-v{version}") == f"packages/{folder}"
        for bad in ("core-0.1.0", "nosuch-v0.1.0", "core-v9.9.9"):
            try:
                package_for(bad)
            except SystemExit:
                continue
            raise AssertionError(f"tag {bad!r} was accepted")
        print(f"release tags: {', '.join(f'{f}-v{v}' for f, v in packages().items())}")
        return 0
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    print(package_for(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
