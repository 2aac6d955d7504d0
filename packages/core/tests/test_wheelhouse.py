"""Wheels of the launcher's own diloco (diloco.shipping.wheelhouse), and the replica's version check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest

from diloco.errors import EXIT_CONFIG, UserError
from diloco.request import LaunchRequest
from diloco.shipping.wheelhouse import build_wheel, dependency_wheels, launcher_wheels, run_versions, wheel_fits


def _fake_site(tmp_path, name: str, *, editable: bool, requires: tuple[str, ...] = ()) -> None:
    """A distribution installed in a directory put on sys.path: regular (files listed in RECORD)
    or editable (a .pth naming its source directory), as pip leaves them."""
    site = tmp_path / "site"
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nRequires-Python: >=3.11\n{meta}")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    if editable:
        src = tmp_path / "src"
        (src / name).mkdir(parents=True)
        (src / name / "__init__.py").write_text("VALUE = 'from source'\n")
        (src / name / "__pycache__").mkdir()
        (src / name / "__pycache__" / "x.pyc").write_text("")
        (site / f"_{name}.pth").write_text(f"{src}\n")
        (info / "direct_url.json").write_text(json.dumps({"url": f"file://{src}", "dir_info": {"editable": True}}))
        (info / "RECORD").write_text(f"_{name}.pth,,\n{name}-1.0.dist-info/METADATA,,\n")
    else:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("VALUE = 'installed'\n")
        (info / "RECORD").write_text(f"{name}/__init__.py,,\n{name}-1.0.dist-info/METADATA,,\n"
                                     f"../../bin/{name},,\n")
    sys.path.insert(0, str(site))


@pytest.fixture
def on_path():
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.mark.parametrize("editable", [False, True])
def test_a_wheel_is_rebuilt_from_an_installed_distribution(tmp_path, on_path, editable):
    _fake_site(tmp_path, "demo_pkg", editable=editable)
    wheel = build_wheel("demo_pkg", tmp_path / "out")
    assert wheel.name == "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        body = zf.read("demo_pkg/__init__.py").decode()
        record = zf.read("demo_pkg-1.0.dist-info/RECORD").decode()
    assert names == {"demo_pkg/__init__.py", "demo_pkg-1.0.dist-info/METADATA", "demo_pkg-1.0.dist-info/WHEEL",
                     "demo_pkg-1.0.dist-info/RECORD"}  # no scripts outside the package, no caches
    assert body == ("VALUE = 'from source'\n" if editable else "VALUE = 'installed'\n")
    assert "demo_pkg/__init__.py,sha256=" in record
    again = build_wheel("demo_pkg", tmp_path / "again")
    assert again.read_bytes() == wheel.read_bytes()  # reproducible: the image layer is cached


def test_the_launchers_diloco_installs_offline_and_is_the_code_that_runs_here(tmp_path):
    core = build_wheel("diloco-core", tmp_path / "wheels")
    import diloco.bootstrap.runner

    with zipfile.ZipFile(core) as zf:
        assert zf.read("diloco/bootstrap/runner.py") == open(diloco.bootstrap.runner.__file__, "rb").read()
        assert zf.read("diloco_core-%s.dist-info/entry_points.txt" % metadata.version("diloco-core"))
    deps = dependency_wheels(tmp_path / "deps", roots=["diloco-core"])
    names = {w.name.split("-")[0].lower() for w in deps}
    assert {"pluggy", "click", "obstore", "pathspec", "packaging"} <= names
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", tmp_path / "deps", core],
                   check=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    out = subprocess.run([py, "-c", "import diloco.bootstrap.runner as r; print(r.installed_version('diloco-core'))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    assert out == metadata.version("diloco-core")


def test_launcher_wheels_are_core_and_replica_or_one_line_naming_the_fix(tmp_path):
    try:
        metadata.version("diloco-replica")
    except metadata.PackageNotFoundError:
        with pytest.raises(UserError, match="pip install --no-deps diloco-replica next to the launcher"):
            launcher_wheels(tmp_path)
        return
    wheels = launcher_wheels(tmp_path)
    assert [w.name.split("-")[0] for w in wheels] == ["diloco_core", "diloco_replica"]
    assert all(wheel_fits(w, "3.11") for w in wheels)


def test_wheel_fits_reads_tags_and_requires_python(tmp_path, on_path):
    _fake_site(tmp_path, "demo_pkg", editable=False)
    wheel = build_wheel("demo_pkg", tmp_path)
    assert wheel_fits(wheel, "3.11") and wheel_fits(wheel, "3.12")
    assert not wheel_fits(wheel, "3.10")  # Requires-Python >=3.11: a py310 image cannot install it
    native = wheel.with_name("demo_pkg-1.0-cp311-abi3-manylinux_2_17_x86_64.whl")
    native.write_bytes(wheel.read_bytes())
    assert wheel_fits(native, "3.12", "manylinux_2_31_x86_64")
    assert not wheel_fits(native, "3.12", "manylinux_2_31_aarch64")
    newer_glibc = wheel.with_name("demo_pkg-1.0-cp311-abi3-manylinux_2_34_x86_64.whl")
    newer_glibc.write_bytes(wheel.read_bytes())
    assert not wheel_fits(newer_glibc, "3.12", "manylinux_2_31_x86_64")


def test_a_missing_dependency_is_named_in_one_line(tmp_path, on_path):
    _fake_site(tmp_path, "demo_pkg", editable=False, requires=("not-installed-anywhere>=1",))
    with pytest.raises(UserError, match=r"not-installed-anywhere \(needed by demo_pkg\) is not installed"):
        dependency_wheels(tmp_path / "deps", roots=["demo_pkg"])


def test_the_run_records_its_diloco_and_every_replica_gets_it():
    request = LaunchRequest(run_id="r", n_replicas=2, entrypoint="m:f")
    assert request.diloco_version == run_versions()
    assert request.replica_env(1)["DILOCO_VERSION"] == run_versions()
    recorded = {**request.to_dict(), "diloco_version": "diloco-core==0.1.0"}
    assert LaunchRequest.from_dict(recorded).replica_env(0)["DILOCO_VERSION"] == "diloco-core==0.1.0"
    with pytest.raises(UserError, match="diloco_version"):
        LaunchRequest(run_id="r", n_replicas=1, entrypoint="m:f", diloco_version="$(rm -rf /)")


def test_a_replica_holding_another_diloco_stops_in_one_line(tmp_path):
    result = tmp_path / "result.json"
    env = {**os.environ, "DILOCO_ENTRYPOINT": "json:dumps", "REPLICA_RANK": "0", "DILOCO_REPLICAS": "1",
           "DILOCO_RESULT_PATH": str(result), "DILOCO_VERSION": "diloco-core==0.0.1"}
    proc = subprocess.run([sys.executable, "-m", "diloco.bootstrap.runner"], env=env, capture_output=True, text=True)
    assert proc.returncode == EXIT_CONFIG
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "diloco-core 0.0.1" in lines[0] and "diloco-core " + metadata.version("diloco-core") \
        in lines[0]
    assert json.loads(result.read_text())["exit_code"] == EXIT_CONFIG
