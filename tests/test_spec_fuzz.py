"""Every field of the spec and of each built-in backend's options, fed hostile values.

For each field: wrong types (a string where a list goes, a float where an integer goes, a
table, a boolean), NaN and ±inf, a number far past any sane bound, a NUL byte, a 40,000-character
string, nesting 20 deep, the empty string and right-to-left unicode. On every backend:

- `diloco dryrun` either accepts the value (only the empty string and unicode may be accepted)
  or refuses it in one line on stderr starting "error: ", exit 2, no traceback;
- `diloco run` with a value the dry run refused refuses it with the same line, exit 2, and
  records nothing: what passes one passes the other.

In process (click's runner) so the ~2,000 cases take seconds; a refused `run` never reaches a
backend, and each backend's endpoints point at closed ports in case one ever did.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from diloco.options import BackendOption

ROLE = "arn:aws:iam::123456789012:role/diloco-sagemaker"
BASES = {
    "local": "",
    "eks": 'image = "example.com/img:1"\napi_url = "http://127.0.0.1:9"\n',
    "modal": "",
    "sagemaker": f'role = "{ROLE}"\nimage = "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:test"\n'
                 'region = "us-east-1"\n',
}
TOP = 'replicas = 2\nentrypoint = "job:main"\n'
RDV = {"local": "", "eks": 's3://bucket/runs', "modal": "s3://bucket/runs", "sagemaker": "s3://bucket/runs"}


@dataclass(frozen=True)
class Bad:
    """A hostile value, as TOML, and whether every field must refuse it."""

    label: str
    toml: str
    must_fail: bool = True


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings take JSON's escapes, \u0000 included
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


HOSTILE = [Bad("nan", "nan"), Bad("inf", "inf"), Bad("-inf", "-inf"), Bad("nul", toml_value("a\x00b")),
           Bad("huge-string", toml_value("x" * 40_000)), Bad("deep", "[" * 20 + "1" + "]" * 20),
           Bad("deep-table", "{ a = " * 20 + "1" + " }" * 20)]
MAYBE = [Bad("empty", '""', must_fail=False), Bad("unicode", toml_value("\u202etxt.exe\u65e5\u672c"), must_fail=False)]


def wrong_types(kind: str) -> list[Bad]:
    """Values of every TOML type that `kind` (a field's declared type) does not take."""
    samples = {"str": Bad("a-string", '"torch"'), "int": Bad("an-int", "5"), "float": Bad("a-float", "1.5"),
               "bool": Bad("a-bool", "true"), "list": Bad("an-array", '["x"]'), "dict": Bad("a-table", '{ k = "v" }'),
               "big": Bad("huge-int", str(10**23))}
    takes = {part.split("[")[0].strip() for part in kind.replace("strlist", "list").split("|")}
    if "any" in takes:
        return []
    out = []
    for name, bad in samples.items():
        if name == "big":
            if takes & {"int", "float"} and "str" not in takes:
                out.append(bad)  # every number has an upper bound
            continue
        if name in takes or (name == "int" and "float" in takes):
            continue
        out.append(bad)
    return out


def spec_fields() -> list[tuple[str, str, str]]:
    """(table, key, kind) for every field of the spec, as its tables declare them."""
    from diloco.options import describe_options
    from diloco.spec.schema import SpecTable
    from diloco.spec.settings import DilocoSettings, RestartSettings

    tables = ("", SpecTable), ("restart", RestartSettings), ("diloco", DilocoSettings)
    out = [(table, o.name, o.type) for table, declared in tables for o in describe_options(declared)
           if o.name not in ("backend", "restart", "diloco", "metrics", "args", "env")]
    return out + [("args", "lr", "any"), ("env", "NCCL_DEBUG", "str | int | float | bool"),
                  ("metrics", "sinks", "list[str]"), ("metrics.tensorboard", "flush_secs", "any")]


def backend_fields(backend: str) -> list[BackendOption]:
    from diloco.plugins.discovery import backend_options, get_backend

    return backend_options(get_backend(backend).cls)


def write(project: Path, backend: str, table: str, key: str, value: str) -> Path:
    top, extra, options = TOP, "", BASES[backend]
    if RDV[backend]:
        top += f'rendezvous = "{RDV[backend]}"\n'
    if table == "":
        top = "\n".join(line for line in top.splitlines() if not line.startswith(f"{key} =")) + "\n"
        top += f"{key} = {value}\n"
    elif table == "backend":
        options = "\n".join(line for line in options.splitlines() if not line.startswith(f"{key} =")) + "\n"
        options += f"{key} = {value}\n"
    else:
        extra = f"[{table}]\n{key} = {value}\n"
    path = project / "diloco.toml"
    path.write_text(f"{top}{extra}[backend]\nname = \"{backend}\"\n{options}")
    return path


@pytest.fixture
def runner(tmp_path, monkeypatch):
    from click.testing import CliRunner

    state = tmp_path / "state"
    monkeypatch.setenv("DILOCO_STATE_DIR", str(state))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "job.py").write_text("def main():\n    return 0\n")
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    return CliRunner(), project, state


def check_case(runner, backend: str, table: str, key: str, bad: Bad) -> str | None:
    """Run dryrun (and, if refused, run) on one case; return a failure description or None."""
    import diloco.cli as cli_module

    cli, project, state = runner
    path = write(project, backend, table, key, bad.toml)
    return _check_path(cli, cli_module, path, state, f"{backend} {table + '.' if table else ''}{key} = <{bad.label}>",
                       key, bad)


def assert_base_accepted(runner, backend: str) -> None:
    """Every case below changes one field of this spec: it must pass, or every refusal proves nothing."""
    from diloco.cli import main

    cli, project, _ = runner
    path = project / "diloco.toml"
    top = TOP + (f'rendezvous = "{RDV[backend]}"\n' if RDV[backend] else "")
    path.write_text(f"{top}[backend]\nname = \"{backend}\"\n{BASES[backend]}")
    dry = cli.invoke(main, ["dryrun", str(path)])
    assert dry.exit_code == 0, f"the {backend} base spec is refused: {dry.stderr or dry.output}"


@pytest.mark.parametrize("backend", ["local", "eks", "modal", "sagemaker"])
def test_every_spec_field_refuses_hostile_values_in_one_line(runner, backend):
    assert_base_accepted(runner, backend)
    failures, cases = [], 0
    for table, key, kind in spec_fields():
        for bad in [*wrong_types(kind), *HOSTILE, *(MAYBE if "str" in kind else [])]:
            if kind == "any" and bad.label in ("nan", "inf", "-inf", "nul", "huge-string", "deep", "deep-table"):
                pass  # [args] and sink options take any TOML value, but none of these
            elif kind == "any":
                continue
            cases += 1
            failure = check_case(runner, backend, table, key, bad)
            if failure:
                failures.append(failure)
    assert not failures, "\n".join(failures[:40])
    assert cases > 300


@pytest.mark.parametrize("backend", ["local", "eks", "modal", "sagemaker"])
def test_every_backend_option_refuses_hostile_values_in_one_line(runner, backend):
    assert_base_accepted(runner, backend)
    failures, cases = [], 0
    for option in backend_fields(backend):
        for bad in [*wrong_types(option.type), *HOSTILE, *(MAYBE if "str" in option.type else [])]:
            cases += 1
            failure = check_case(runner, backend, "backend", option.name, bad)
            if failure:
                failures.append(failure)
    assert not failures, "\n".join(failures[:40])
    assert cases >= 9 * len(backend_fields(backend))


# Findings of "Trust nothing that arrives" that every backend must refuse before its plan is made:
# a reserved name in `secrets` (on EKS it replaced the rank the pod reads) and credentials in the
# rendezvous (printed by every backend's dry run, put in the EKS Job's env and SageMaker's
# Environment). The value after "=" must never be echoed: not by dryrun, not by run.
RESERVED_AND_CREDENTIALS = [
    ("secrets", '["REPLICA_RANK"]', "REPLICA_RANK", None),
    ("secrets", '["DILOCO_REPLICAS", "WORLD_SIZE"]', "DILOCO_REPLICAS", None),
    ("rendezvous", '"s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@bucket/runs"', "rendezvous",
     "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"),
    ("rendezvous", '"s3://bucket/runs?X-Amz-Signature=f00dfacecafe0123456789"', "rendezvous", "f00dfacecafe0123456789"),
    ("rendezvous", '"az://account/container/runs?sv=2024&sig=c2VjcmV0LXNhcy1zaWduYXR1cmU%3D"', "rendezvous",
     "c2VjcmV0LXNhcy1zaWduYXR1cmU"),
]


@pytest.mark.parametrize("backend", ["local", "eks", "modal", "sagemaker"])
@pytest.mark.parametrize("key, value, named, secret", RESERVED_AND_CREDENTIALS)
def test_reserved_secrets_and_credentials_in_the_rendezvous_are_refused_on_every_backend(runner, backend, key, value,
                                                                                          named, secret):
    from diloco.cli import main

    cli, project, state = runner
    path = write(project, backend, "", key, value)
    for command in ("dryrun", "run"):
        out = cli.invoke(main, [command, str(path)])
        assert out.exit_code == 2 and "Traceback" not in out.output, (command, out.output)
        [line] = out.stderr.strip().splitlines()
        assert line.startswith("error: ") and named in line, line
        if secret is not None:
            assert secret not in out.output and "secrets" in line, line
    assert not (state / "runs").exists() or not any((state / "runs").iterdir())


def write_group(project: Path, backend: str, key: str, value: str) -> Path:
    """A spec of one [[group]] on `backend` with `key = value` in the group's table."""
    rdv = f'rendezvous = "{RDV[backend]}"\n' if RDV[backend] else ""
    table = {"name": '"g"', "replicas": "2"}
    if key.startswith("env."):
        extra = f"[group.env]\n{key[4:]} = {value}\n"
    else:
        table[key] = value
        extra = ""
    lines = "".join(f"{k} = {v}\n" for k, v in table.items())
    path = project / "diloco.toml"
    path.write_text(f'entrypoint = "job:main"\n{rdv}[[group]]\n{lines}{extra}[group.backend]\nname = "{backend}"\n'
                    f"{BASES[backend]}")
    return path


@pytest.mark.parametrize("backend", ["local", "eks", "modal", "sagemaker"])
def test_every_group_field_refuses_hostile_values_in_one_line(runner, backend):
    """The same cases inside a [[group]] table: each field a group may set, and its [group.env]."""
    from diloco.options import describe_options
    from diloco.spec.schema import GroupTable

    cli, project, state = runner
    fields = [(o.name, o.type) for o in describe_options(GroupTable) if o.name not in ("backend", "env")]
    fields.append(("env.NCCL_DEBUG", "str | int | float | bool"))
    import diloco.cli as cli_module

    base = cli.invoke(cli_module.main, ["dryrun", str(write_group(project, backend, "timeout", "60"))])
    assert base.exit_code == 0, f"the {backend} group base spec is refused: {base.stderr or base.output}"

    failures, cases = [], 0
    for key, kind in fields:
        for bad in [*wrong_types(kind), *HOSTILE, *(MAYBE if "str" in kind else [])]:
            if key == "name" and bad.label == "unicode":
                bad = Bad("unicode", bad.toml, must_fail=True)  # a group's name is a DNS-like label
            cases += 1
            path = write_group(project, backend, key, bad.toml)
            failure = _check_path(cli, cli_module, path, state, f"{backend} group.{key} = <{bad.label}>",
                                  key.removeprefix("env."), bad)
            if failure:
                failures.append(failure)
    assert cases > 50
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} of {cases} cases)"


def _check_path(cli, cli_module, path: Path, state: Path, where: str, key: str, bad: Bad) -> str | None:
    """dryrun on `path` (and, if refused, run): a failure description, or None."""
    dry = cli.invoke(cli_module.main, ["dryrun", str(path)])
    if dry.exception is not None and not isinstance(dry.exception, SystemExit):
        return f"{where}: dryrun raised {type(dry.exception).__name__}: {dry.exception}"
    if dry.exit_code == 0:
        return f"{where}: dryrun accepted it" if bad.must_fail else None
    lines = dry.stderr.strip().splitlines()
    if dry.exit_code != 2 or len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in dry.output:
        return f"{where}: dryrun exit {dry.exit_code}, stderr {dry.stderr[-300:]!r}"
    if len(lines[0]) > 1000:
        return f"{where}: the error line is {len(lines[0])} characters (echoes the value?)"
    if key.lower() not in lines[0].lower():
        return f"{where}: the error does not name the field: {lines[0]!r}"
    run = cli.invoke(cli_module.main, ["run", str(path)])
    if run.exit_code != 2 or run.stderr.strip() != lines[0]:
        return f"{where}: run exit {run.exit_code} with {run.stderr[-300:]!r}, dryrun said {lines[0]!r}"
    if (state / "runs").exists() and any((state / "runs").iterdir()):
        return f"{where}: run recorded something"
    return None
