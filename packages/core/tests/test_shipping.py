"""What of a workdir ships to remote replicas (diloco.shipping.workdir): never credentials, at any depth."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from diloco.errors import UserError
from diloco.shipping.workdir import select_files


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def workdir(tmp_path):
    root = tmp_path / "work"
    _tree(root, {
        "train.py": "print('train')\n",
        "pkg/__init__.py": "",
        "pkg/model.py": "x = 1\n" * 100,
        # credentials and keys, at every depth: never shipped
        ".env": "HF_TOKEN=hf_x\n", "sub/.env.local": "A=1\n", ".envrc": "export X=1\n",
        ".aws/credentials": "[default]\n", "deep/er/.aws/config": "[x]\n", "a/b/key.pem": "-----\n",
        "tls/server.key": "k\n", "x/credentials.json": "{}\n", ".netrc": "machine x\n",
        ".git-credentials": "https://u:p@h\n", "home/.ssh/id_ed25519": "k\n",
        # not useful in a container: left out by default
        ".git/config": "[core]\n", ".venv/bin/python": "", "pkg/__pycache__/model.cpython-311.pyc": "",
        "node_modules/m/index.js": "",
        # .gitignore at the top and below
        ".gitignore": "data/\n*.log\n!.env\n",
        "data/big.bin": "0" * 1000, "run.log": "log\n", "pkg/keep.log": "log\n",
        "sub/.gitignore": "scratch.txt\n", "sub/scratch.txt": "s\n", "sub/notes.txt": "n\n", "scratch.txt": "top\n",
        # extra patterns from [backend] ignore
        "ckpt/step1.pt": "w" * 500, "ckpt/README.md": "r\n",
    })
    return root


def test_credentials_are_never_shipped_at_any_depth_and_gitignore_is_honoured(workdir):
    shipment = select_files(workdir, ignore=["ckpt/*.pt"])
    assert [f.path for f in shipment.files] == [
        ".gitignore", "ckpt/README.md", "pkg/__init__.py", "pkg/model.py", "scratch.txt", "sub/.gitignore",
        "sub/notes.txt", "train.py"]
    assert not shipment.includes(".env") and not shipment.includes("sub/.env.local")  # '!.env' cannot bring it back
    assert shipment.includes(workdir / "train.py") and not shipment.includes(workdir.parent / "train.py")


def test_a_nested_gitignore_applies_below_its_own_directory_only(workdir):
    paths = {f.path for f in select_files(workdir).files}
    assert "sub/scratch.txt" not in paths and "scratch.txt" in paths


def test_symlinks_are_not_followed(workdir, tmp_path):
    secrets = tmp_path / "elsewhere"
    _tree(secrets, {"token.txt": "t\n"})
    os.symlink(secrets, workdir / "linked")
    os.symlink(secrets / "token.txt", workdir / "token-link.txt")
    paths = {f.path for f in select_files(workdir).files}
    assert not any(p.startswith("linked") or p == "token-link.txt" for p in paths)


def test_summary_says_what_ships_and_the_largest_files(workdir):
    summary = select_files(workdir).summary(largest=2)
    shipped = select_files(workdir)
    assert summary["files"] == len(shipped.files) and summary["bytes"] == shipped.total_bytes
    assert summary["largest"] == [{"path": "pkg/model.py", "bytes": 600}, {"path": "ckpt/step1.pt", "bytes": 500}]
    assert summary["root"] == str(workdir.resolve()) and summary["ignore"] == []


def test_the_tarball_holds_exactly_the_shipment_and_is_reproducible(workdir):
    shipment = select_files(workdir)
    data = shipment.tar_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == sorted(f.path for f in shipment.files)
        assert tar.extractfile("train.py").read() == b"print('train')\n"
    assert select_files(workdir).tar_bytes() == data


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        select_files(tmp_path / "missing")
    with pytest.raises(UserError, match="list of gitignore-style patterns"):
        select_files(tmp_path, ignore="*.pt")
