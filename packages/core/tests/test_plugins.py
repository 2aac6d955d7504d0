"""Plugin discovery through real entry points in group `diloco`.

A plugin "package" is a module plus a `.dist-info` directory on PYTHONPATH: exactly what pip
leaves in site-packages, and what importlib.metadata reads — no install step needed.
"""

from __future__ import annotations

import json

import pytest
import subprocess
import sys
from pathlib import Path

from conftest import write_spec

PLUGIN = '''
from diloco import hookimpl
from diloco.local.executor import LocalProcessExecutor

class {cls}(LocalProcessExecutor):
    backend_name = "{name}"

@hookimpl
def diloco_register_executors():
    return [{cls}]
'''


def make_plugin(site: Path, dist: str, module: str, name: str, body: str | None = None) -> None:
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(body if body is not None else PLUGIN.format(cls="PluginExecutor", name=name))
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[diloco]\n{name} = {module}\n")


def test_third_party_backend_is_listed_and_runs_a_job(cli, tmp_path, project):
    site = tmp_path / "site"
    make_plugin(site, "diloco-backend-acme", "acme_plugin", "acme")
    env = {"PYTHONPATH": str(site)}
    listing = cli("backends", env=env, check_rc=0).stdout
    assert "acme" in listing and "diloco-backend-acme" in listing and "1.2.3" in listing
    assert "local" in listing and "diloco-core" in listing
    spec = write_spec(project, 'backend = "acme"\nreplicas = 2\nentrypoint = "job:main"\n'
                               '[restart]\nmonitor_interval = 0.1\n')
    proc = cli("run", str(spec), env=env, check_rc=0)
    assert "2 × acme" in proc.stdout and "SUCCEEDED" in proc.stdout


def test_two_plugins_claiming_one_name_is_an_error_naming_both(cli, tmp_path, project):
    site = tmp_path / "site"
    make_plugin(site, "diloco-backend-one", "one_plugin", "twin")
    make_plugin(site, "diloco-backend-two", "two_plugin", "twin")
    spec = write_spec(project, 'backend = "twin"\nreplicas = 1\nentrypoint = "job:main"\n')
    proc = cli("run", str(spec), env={"PYTHONPATH": str(site)})
    assert proc.returncode == 2
    assert "diloco-backend-one" in proc.stderr and "diloco-backend-two" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_broken_plugin_is_reported_not_fatal(cli, tmp_path):
    site = tmp_path / "site"
    make_plugin(site, "diloco-backend-broken", "broken_plugin", "broken", body="raise ImportError('sdk missing')\n")
    proc = cli("backends", env={"PYTHONPATH": str(site)}, check_rc=0)
    assert "local" in proc.stdout and "diloco-backend-broken failed to load" in proc.stdout
    spec = write_spec(tmp_path, 'backend = "broken"\nreplicas = 1\nentrypoint = "x:y"\n')
    bad = cli("run", str(spec), env={"PYTHONPATH": str(site)})
    assert bad.returncode == 2 and "failed to load: ImportError: sdk missing" in bad.stderr


def test_autoload_can_be_disabled(cli, tmp_path):
    site = tmp_path / "site"
    make_plugin(site, "diloco-backend-acme", "acme_plugin", "acme")
    listing = cli("backends", env={"PYTHONPATH": str(site), "DILOCO_DISABLE_PLUGIN_AUTOLOAD": "1"},
                  check_rc=0).stdout
    assert "acme" not in listing and "local" in listing
    explicit = cli("backends", env={"PYTHONPATH": str(site), "DILOCO_DISABLE_PLUGIN_AUTOLOAD": "1",
                                    "DILOCO_PLUGINS": "acme_plugin"}, check_rc=0).stdout
    assert "acme" in explicit


def test_import_loads_no_plugins_and_no_heavy_modules():
    code = ("import sys, diloco, diloco.cli, diloco.plugins.discovery as p\n"
            "assert p._registry is None, 'plugins loaded at import'\n"
            "p.backends()\n"
            "heavy = {'torch', 'numpy', 'boto3', 'botocore', 'kubernetes', 'modal', 'sagemaker', 'obstore'}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_hook_is_documented():
    from diloco import hookspecs

    hooks = [n for n in dir(hookspecs) if n.startswith("diloco_")]
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for name in hooks:
        assert getattr(hookspecs, name).__doc__, name
        assert name in readme, f"{name} is not documented in packages/core/README.md"


def test_backends_name_lists_options_from_the_executor(cli, tmp_path):
    out = cli("backends", "local", check_rc=0).stdout
    assert "grace_period" in out and "float" in out and "5.0" in out
    assert "seconds between SIGTERM and SIGKILL" in out
    assert "CUDA_VISIBLE_DEVICES=devices[r % len]" in out  # help text is not taken for markup
    data = json.loads(cli("backends", "local", "--json", check_rc=0).stdout)
    by_name = {o["name"]: o for o in data["options"]}
    assert by_name["grace_period"] == {"name": "grace_period", "type": "float", "default": 5.0, "required": False,
                                       "help": "seconds between SIGTERM and SIGKILL when a replica is cancelled",
                                       "choices": [], "min": 0, "max": 3600}
    assert by_name["devices"]["type"] == "list[int | str]" and by_name["devices"]["default"] == []
    # a third-party backend with no docstring still lists its options (without help)
    site = tmp_path / "site"
    make_plugin(site, "diloco-backend-acme", "acme_plugin", "acme")
    acme = json.loads(cli("backends", "acme", "--json", env={"PYTHONPATH": str(site)}, check_rc=0).stdout)
    assert acme["distribution"] == "diloco-backend-acme"
    bad = cli("backends", "nosuch")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not installed" in bad.stderr


@pytest.mark.parametrize("table, expected", [
    ({"devices": "0,1"}, "`backend.devices` must be list[int | str], got '0,1' (a string)"),
    ({"grace_period": float("inf")}, "`backend.grace_period` must be a finite number"),
    ({"grace_period": float("nan")}, "`backend.grace_period` must be a finite number"),
    ({"grace_period": -1}, "`backend.grace_period` must be at least 0"),
    ({"grace_period": "5"}, "`backend.grace_period` must be float, got '5' (a string)"),
    ({"state_dir": ["a"]}, "`backend.state_dir` must be str, got ['a'] (an array)"),
    ({"grace": 1}, "unknown key `backend.grace` for backend 'local' (allowed: devices, grace_period, state_dir"),
])
def test_backend_table_is_checked_against_the_declared_options(table, expected):
    from diloco.errors import SpecError
    from diloco.plugins.discovery import make_executor
    from diloco.local.executor import LocalProcessExecutor

    with pytest.raises(SpecError) as err:
        make_executor(LocalProcessExecutor, table, source="spec.toml")
    assert str(err.value).startswith("spec.toml: ") and expected in str(err.value) and "\n" not in str(err.value)


def test_backend_table_errors_reach_the_cli_as_one_line(cli, project):
    spec = project / "diloco.toml"
    spec.write_text('entrypoint = "job:main"\nreplicas = 2\n[backend]\nname = "local"\ndevices = "0"\n')
    for cmd in ("run", "dryrun"):
        proc = cli(cmd, str(spec))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "`backend.devices` must be list[int | str]" in proc.stderr


OLD_CONTRACT = '''
from diloco import hookimpl

class KeywordExecutor:
    """Options as `__init__` keywords, no `plan` / `submit`: diloco-core 0.1's unpublished draft."""
    backend_name = "kw"

    def __init__(self, *, workdir=None):
        self.workdir = workdir

@hookimpl
def diloco_register_executors():
    return [KeywordExecutor]
'''


def test_a_backend_without_the_contract_is_refused_in_one_line(cli, tmp_path, project):
    site = tmp_path / "site"
    make_plugin(site, "diloco-backend-kw", "kw_plugin", "kw", body=OLD_CONTRACT)
    spec = write_spec(project, 'backend = "kw"\nreplicas = 1\nentrypoint = "job:main"\n')
    for cmd in (("run", str(spec)), ("dryrun", str(spec)), ("backends", "kw")):
        proc = cli(*cmd, env={"PYTHONPATH": str(site)})
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "backend 'kw' from diloco-backend-kw failed to load: KeywordExecutor has no Options, " \
               "capabilities, plan, submit" in proc.stderr
    listing = cli("backends", env={"PYTHONPATH": str(site)}, check_rc=0).stdout  # the others stay usable
    assert "local" in listing and "KeywordExecutor has no Options" in listing
