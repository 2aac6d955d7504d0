"""The backend API (`diloco.backendapi`): its names exist, and a backend written against an older
version is told in one line what to change, from Python and through the CLI, never a traceback."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest

from diloco.backendapi import BACKEND_API, NAMES, BackendAPIMismatch
from diloco.errors import UserError
from diloco.options import option, options_from
from diloco.protocol import ReplicaHandle, ReplicaStatus
from diloco.waiting import unless_failed

OLD_PLUGIN = '''
from dataclasses import dataclass
from diloco import hookimpl
from diloco.local.executor import LocalProcessExecutor
from diloco.options import option, options_from
from diloco.protocol import ReplicaHandle, ReplicaStatus
from diloco.waiting import unless_failed

@dataclass(frozen=True)
class OldOptions:
    root: str = option("/tmp", help="where")

class OldExecutor(LocalProcessExecutor):
    """Written against backend API 1: options_from took the Options class and the backend's name."""
    backend_name, Options = "old", OldOptions
    def __init__(self, options=None, /, **overrides):
        self.options = options_from(OldOptions, options, overrides, backend="old")

@hookimpl
def diloco_register_executors():
    return [OldExecutor]
'''


def test_every_name_of_the_backend_api_exists():
    for module, names in NAMES.items():
        m = importlib.import_module(module)
        missing = [n for n in names if not hasattr(m, n)]
        assert not missing, f"{module} lacks {missing}"
    assert importlib.import_module("diloco").BACKEND_API == BACKEND_API


@dataclass(frozen=True)
class BoxOptions:
    root: str = option("/tmp", help="where")


class BoxExecutor:
    backend_name, Options = "box", BoxOptions


@pytest.mark.parametrize("call", [
    lambda: options_from(BoxOptions, None, {}, backend="box"),   # API 1 exactly
    lambda: options_from(BoxOptions, None, {}),                  # API 1 without the name
])
def test_an_api_1_call_is_one_line_saying_what_to_write(call):
    with pytest.raises(BackendAPIMismatch) as err:
        call()
    text = str(err.value)
    assert "\n" not in text and "backend API 1" in text and f"backend API {BACKEND_API}" in text
    assert "options_from(type(self), options, overrides)" in text
    assert isinstance(err.value, UserError) and isinstance(err.value, TypeError)


def test_an_api_1_unless_failed_is_one_line_saying_what_to_write():
    handle = ReplicaHandle(0, "box", {"attempt": 1})
    with pytest.raises(BackendAPIMismatch) as err:
        unless_failed(handle, ReplicaStatus.SUCCEEDED, lambda n: "diloco-result {}")  # API 1: read_log(n)
    text = str(err.value)
    assert "\n" not in text and "backend API 1" in text and "lambda: result_from_log(read_log(20))" in text


@pytest.mark.parametrize("status, expected", [
    (ReplicaStatus.SUCCEEDED, (ReplicaStatus.SUCCEEDED, 0, None, {"loss": 1.5})),
    (ReplicaStatus.CANCELLED, (ReplicaStatus.CANCELLED, None, "cancelled by scancel", None)),
    (ReplicaStatus.RUNNING, (ReplicaStatus.RUNNING, None, None, None)),
    (ReplicaStatus.FAILED, None),
])
def test_unless_failed_builds_every_result_but_a_failure(status, expected):
    handle = ReplicaHandle(3, "box", {"attempt": 2})
    got = unless_failed(handle, status, lambda: {"loss": 1.5}, cancelled="cancelled by scancel")
    if expected is None:
        assert got is None
    else:
        assert (got.status, got.exit_code, got.error, got.result) == expected and (got.rank, got.attempt) == (3, 2)


def test_the_current_call_builds_the_options():
    assert options_from(BoxExecutor, None, {"root": "/x"}) == BoxOptions(root="/x")


def test_an_old_backend_through_the_cli_is_one_line_and_no_traceback(cli, project):
    (project / "old_plugin.py").write_text(OLD_PLUGIN)
    spec = project / "old.toml"
    spec.write_text('entrypoint = "job:main"\nreplicas = 1\nbackend = "old"\n')
    proc = cli("dryrun", str(spec), env={"DILOCO_PLUGINS": "old_plugin", "PYTHONPATH": str(project)})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend API 1" in lines[0], proc.stderr
