"""The run spec: a small TOML file, validated to one clear line per mistake.

    name = "tiny-lm"                        # optional; default: the file's name
    backend = "local"                       # or a [backend] table with name = "..." + options
    replicas = 4
    entrypoint = "train:main"               # or ["python", "train.py"]
    workdir = "."                           # where the code lives (relative to this file)
    gpu = "H100:8"                          # optional logical GPU name and count per replica
    processes_per_replica = 8               # optional; torchrun starts them (default: the GPU count, else 1)
    timeout = 3600                          # seconds, per replica attempt
    rendezvous = "s3://bucket/prefix"       # optional; default: DILOCO_RENDEZVOUS / config, or (local) the records
    secrets = ["HF_TOKEN"]                  # launcher env vars forwarded, never recorded
    [args]    ...                           # entrypoint arguments
    [env]     ...                           # extra environment variables (not secret)
    [backend] name = "eks", ...             # instead of backend = "...": the backend and its options
    [restart] policy / max_restarts / max_restarts_per_rank / backoff / min_replicas / fail_fast_seconds
    [diloco]  sync_every / outer_lr / ...   # DiLoCo settings read by diloco-replica
    [metrics] sinks = ["tensorboard"]       # where the launcher writes round metrics (plugins add more)
    region = "us-east-1"                    # optional: where the replicas run, for pricing their reads
    store_region = "us-east-1"              # optional: where the store is (same region reads are free)
    [[group]] name / replicas / gpu / ...   # instead of replicas + backend: groups on several backends
                                            #   (diloco.groups; top-level keys are their defaults)

Unknown keys, wrong types and out-of-range values raise `SpecError` naming file and key.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import SpecError, UserError
from .groups import ReplicaGroup, check_groups
from .replicaenv import check_entrypoint_args, parse_entrypoint
from .procgroup import resolve_processes
from .store import SCHEMES, scheme_list
from .settings import DilocoSettings
from .sinks import check_metrics
from .specvalues import MAX_ARGS_JSON, MAX_SPEC_BYTES, check_values, safe_uri, secret_key_path
from .variables import check_variable
from .wiresize import CODECS


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Field:
    """One key of a table: its type, bounds or choices, and default."""

    kind: str                     # "int" | "float" | "str" | "bool" | "table" | "strlist" | "entrypoint"
    default: Any = None
    required: bool = False
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    help: str = ""

    def check(self, where: str, key: str, value: Any) -> Any:
        fail = lambda want: SpecError(f"{where}: `{key}` must be {want}, got {value!r} ({_type_name(value)})")  # noqa: E731
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail("an integer")
        elif self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise fail("a finite number")
            value = float(value)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise fail("true or false")
        elif self.kind == "str":
            if not isinstance(value, str) or not value:
                raise fail("a non-empty string")
            if self.choices and value not in self.choices:
                raise SpecError(f"{where}: `{key}` must be one of {', '.join(self.choices)}; got {value!r}")
        elif self.kind == "table":
            if not isinstance(value, dict):
                raise fail("a table")
        elif self.kind == "backend":
            if isinstance(value, dict):
                name = value.get("name")
                if not isinstance(name, str) or not name:
                    raise SpecError(f"{where}: the [backend] table needs `name`, e.g. name = \"local\"")
            elif not isinstance(value, str) or not value:
                raise fail('a backend name or a [backend] table with name = "..."')
        elif self.kind == "strlist":
            if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
                raise fail("an array of strings")
        elif self.kind == "entrypoint":
            if not isinstance(value, (str, list)):
                raise fail("'module:function' or an array of strings")
            try:
                parse_entrypoint(value)
            except UserError as exc:
                raise SpecError(f"{where}: `{key}`: {exc}") from None
        if self.min is not None and value < self.min:
            raise SpecError(f"{where}: `{key}` must be at least {self.min:g}, got {value!r}")
        if self.max is not None and value > self.max:
            raise SpecError(f"{where}: `{key}` must be at most {self.max:g}, got {value!r}")
        return value


def check_table(where: str, table: Mapping[str, Any], schema: Mapping[str, Field],
                prefix: str = "") -> dict[str, Any]:
    """Validate `table` against `schema`; return it with defaults filled in."""
    unknown = sorted(set(table) - set(schema))
    if unknown:
        allowed = ", ".join(sorted(schema))
        raise SpecError(f"{where}: unknown key `{prefix}{unknown[0]}` (allowed: {allowed})")
    out = {}
    for key, f in schema.items():
        if key in table:
            out[key] = f.check(where, prefix + key, table[key])
        elif f.required:
            raise SpecError(f"{where}: missing required key `{prefix}{key}`" + (f" ({f.help})" if f.help else ""))
        else:
            out[key] = f.default
    return out


TOP_LEVEL = {
    "name": Field("str", help="a name for the run"),
    "backend": Field("backend", required=True, help='e.g. backend = "local"'),
    "replicas": Field("int", required=True, min=1, max=4096, help="e.g. replicas = 4"),
    "entrypoint": Field("entrypoint", required=True, help='e.g. entrypoint = "train:main"'),
    "workdir": Field("str"),
    "gpu": Field("str"),
    "processes_per_replica": Field("int", min=1, max=64,
                                   help="processes inside each replica, started by torchrun (default: the GPU count)"),
    "timeout": Field("float", default=3600.0, min=1, max=30 * 86400, help="seconds per replica attempt"),
    "rendezvous": Field("str"),
    "secrets": Field("strlist", default=[]),
    "args": Field("table", default={}),
    "env": Field("table", default={}),
    "restart": Field("table", default={}),
    "diloco": Field("table", default={}),
    "metrics": Field("table", default={}),
    "region": Field("str", help="where the replicas run (e.g. us-east-1), for pricing their reads of the store"),
    "store_region": Field("str", help="the store's region (e.g. us-east-1): reads from the same region are free"),
    "group": Field("groups", help="[[group]] tables: replicas on several backends (docs/groups.md)"),
}

# A [[group]] table: its own replicas and backend; what it leaves out, it inherits from the top level.
GROUP = {
    "name": Field("str"),
    "replicas": Field("int", required=True, min=1, max=4096, help="e.g. replicas = 2"),
    "backend": Field("backend", required=True, help='a [group.backend] table with name = "..." and its options'),
    "gpu": Field("str"),
    "processes_per_replica": Field("int", min=1, max=64),
    "timeout": Field("float", min=1, max=30 * 86400),
    "region": Field("str"),
    "env": Field("table"),
}
INHERITED = ("gpu", "processes_per_replica", "timeout")  # `region`: see diloco.estimate.placement

RESTART = {
    "policy": Field("str", default="per-rank", choices=("per-rank", "gang", "never")),
    "max_restarts": Field("int", default=10, min=0, max=100_000, help="relaunches allowed across the whole run"),
    "max_restarts_per_rank": Field("int", default=3, min=0, max=10_000),
    "backoff": Field("float", default=1.0, min=0, max=3600),
    "backoff_max": Field("float", default=60.0, min=0, max=86_400),
    "min_replicas": Field("int", min=1, max=4096, help="ranks that must stay alive and succeed (default: all)"),
    "monitor_interval": Field("float", default=1.0, min=0.01, max=3600),
    "max_preemptions": Field("int", default=50, min=0, max=100_000,
                             help="relaunches after the platform took a replica's machine away (exit 75)"),
    "fail_fast_seconds": Field("float", default=900.0, min=0, max=7 * 86_400,
                               help="the same error at the same step on every rank this soon after start: stop"),
}

DILOCO = {
    "sync_every": Field("int", default=50, min=1, max=1_000_000, help="H: inner steps between syncs"),
    "outer_lr": Field("float", default=0.7, min=0, max=100),
    "outer_momentum": Field("float", default=0.9, min=0, max=1),
    "nesterov": Field("bool", default=True),
    "transport": Field("str", default="fp32", choices=CODECS,
                       help="the codec on the wire; accumulation is always fp32 (docs/sync-modes.md)"),
    "topk_density": Field("float", default=0.01, min=0.0001, max=1,
                          help="transport topk: the fraction of each 4,096-element block sent"),
    "fragments": Field("int", default=1, min=1, max=1024,
                       help="K: the model syncs in K staggered fragments, one every sync_every/K steps"),
    "overlap": Field("bool", default=False,
                     help="exchange a round in the background while inner steps go on; merged one round late"),
    "round_seconds": Field("float", min=0.01, max=86_400,
                           help="time-based rounds: each replica runs inner steps for this long a round (at most "
                                "sync_every of them), and the mean normalises each update by its steps (docs/sync-modes.md)"),
    "total_steps": Field("int", min=1, max=10**12, help="inner steps per replica for the whole run: DiLoCo.steps() runs this "
                         "many, and the estimate and the ETA count on it"),
    "parameters": Field("int", min=1, max=10**14, help="the model's parameter count, for the estimate before launch "
                        "(without it the replica measures it at round 1)"),
    "round_timeout": Field("float", default=300.0, min=0.1, max=86_400),
    "min_members": Field("int", default=1, min=1, max=4096, help="fewest replicas a sync round may average over"),
    "checkpoint_every": Field("int", default=10, min=1, max=1_000_000, help="rounds between checkpoints of the global state"),
    "poll_interval": Field("float", min=0.001, max=60, help="first wait when polling the store (default: by store)"),
    "poll_max": Field("float", min=0.001, max=3600, help="longest wait between polls (default: by store)"),
}

_URI = re.compile(rf"^({'|'.join(SCHEMES)})://")
# Keys that were renamed: the old name gets a one-line pointer instead of "unknown key".
RENAMED = {"diloco.min_replicas": "diloco.min_members"}


def check_sink_options(where: str, metrics: Mapping[str, Any]) -> None:
    """Sink options are recorded with the run: a secret-looking key at any depth, inside tables
    and arrays alike (`headers = [{api_key = ...}]`), is refused (sinks read their credentials
    from the environment: WANDB_API_KEY, MLFLOW_TRACKING_TOKEN)."""
    sinks = {f"metrics.{k}": v for k, v in metrics.items() if isinstance(v, dict)}
    for path, table in sinks.items():
        found = secret_key_path(path, table)
        if found:
            raise SpecError(f"{where}: `{found}` looks like a secret; sinks read credentials from their own "
                            f"environment variables (export them in the launcher's shell), so values never land "
                            f"in records")


@dataclass
class RunSpec:
    name: str
    backend: str
    replicas: int
    entrypoint: str | list[str]
    workdir: str
    timeout: float
    gpu: str | None = None
    processes_per_replica: int = 1
    rendezvous: str | None = None
    secrets: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    backend_options: dict[str, Any] = field(default_factory=dict)
    restart: dict[str, Any] = field(default_factory=dict)
    diloco: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    region: str | None = None
    store_region: str | None = None
    groups: list[ReplicaGroup] = field(default_factory=list)  # empty: one group, the top-level backend
    source: str = "<spec>"

    def replica_groups(self) -> list[ReplicaGroup]:
        """The run's groups: its `[[group]]` tables, or the one group of a spec without them."""
        if self.groups:
            return list(self.groups)
        return [ReplicaGroup(name="g0", backend=self.backend, replicas=self.replicas, first_rank=0,
                             timeout=self.timeout, processes_per_replica=self.processes_per_replica, gpu=self.gpu,
                             backend_options=dict(self.backend_options))]

    def to_dict(self) -> dict[str, Any]:
        """The spec as recorded with the run: plain data, secrets named but never valued."""
        out = {k: v for k, v in self.__dict__.items()}
        out["groups"] = [g.to_dict() for g in self.groups]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        data = dict(data)
        data["groups"] = [g if isinstance(g, ReplicaGroup) else ReplicaGroup.from_dict(g)
                          for g in data.get("groups") or []]
        return cls(**data)

    def to_table(self) -> dict[str, Any]:
        """The spec shaped like its TOML, so a `RunSpec` built in Python (not parsed) is checked
        by `parse_spec` like any other: `parse_spec(s.to_table()) == s` for a parsed spec."""
        def present(d: Mapping[str, Any]) -> dict[str, Any]:  # TOML has no null: unset is absent
            return {k: present(v) if k in ("restart", "diloco") else v for k, v in d.items() if v is not None}

        table = {k: v for k, v in self.__dict__.items() if k not in ("backend", "backend_options", "source", "groups")}
        if self.groups:
            table.pop("replicas")
            return {**present(table), "group": [g.to_table() for g in self.groups]}
        return {**present(table), "backend": {"name": self.backend, **self.backend_options}}


def parse_spec(data: Mapping[str, Any], *, source: str = "<spec>", base_dir: Path | None = None,
               name_default: str = "run") -> RunSpec:
    where = source
    check_values(where, data)  # sizes, depth, NUL, non-finite, credentials in URIs: before anything else
    data = dict(data)
    for old, new in RENAMED.items():
        table, _, key = old.partition(".")
        if isinstance(data.get(table), dict) and key in data[table]:
            raise SpecError(f"{where}: `{old}` was renamed to `{new}` (the replicas a sync round needs; "
                            f"[restart] min_replicas is how many must stay alive)")
    grouped = "group" in data
    schema = TOP_LEVEL
    if grouped:
        for key in ("replicas", "backend"):
            if key in data:
                raise SpecError(f"{where}: a spec with [[group]] tables has no top-level `{key}`; give each group "
                                f"its own (`replicas = N` and a [group.backend] table)")
        schema = {**TOP_LEVEL, **{k: replace(TOP_LEVEL[k], required=False) for k in ("replicas", "backend")}}
    top = check_table(where, data, schema)
    groups = _groups(where, top) if grouped else []
    total = sum(g.replicas for g in groups) if grouped else top["replicas"]
    if total > 4096:
        raise SpecError(f"{where}: the groups hold {total} replicas together; a run has at most 4096")
    restart = check_table(where, top["restart"], RESTART, "restart.")
    diloco = check_table(where, top["diloco"], DILOCO, "diloco.")
    if restart["min_replicas"] is not None and restart["min_replicas"] > total:
        raise SpecError(f"{where}: `restart.min_replicas` ({restart['min_replicas']}) exceeds `replicas` "
                        f"({total})")
    if diloco["min_members"] > total:
        raise SpecError(f"{where}: `diloco.min_members` ({diloco['min_members']}) exceeds `replicas` "
                        f"({total})")
    DilocoSettings.from_table(top["diloco"], where=where)  # the cross-setting rules, in their one place
    _check_env(where, "env", top["env"])
    for name in top["secrets"]:
        check_variable(where, "secrets", name)
    if len(set(top["secrets"])) != len(top["secrets"]):
        raise SpecError(f"{where}: `secrets` lists a variable twice; list each once")
    if top["rendezvous"] and not _URI.match(top["rendezvous"]):
        raise SpecError(f"{where}: `rendezvous` must be a {scheme_list()} URI, got {safe_uri(top['rendezvous'])!r}")
    check_entrypoint_args(top["args"], where)
    if len(json.dumps(top["args"])) > MAX_ARGS_JSON:
        raise SpecError(f"{where}: `[args]` is over {MAX_ARGS_JSON // 1024} KiB as JSON (it travels in one environment "
                        f"variable); put large data in a file in the workdir and pass its path")
    check_sink_options(where, top["metrics"])
    base = base_dir or Path.cwd()
    workdir = (base / (top["workdir"] or ".")).resolve()
    if not workdir.is_dir():
        raise SpecError(f"{where}: `workdir` {str(workdir)!r} is not a directory")
    if grouped:
        backend_name = "+".join(dict.fromkeys(g.backend for g in groups))
        options: dict[str, Any] = {}
        processes = groups[0].processes_per_replica
    else:
        backend = top["backend"] if isinstance(top["backend"], dict) else {"name": top["backend"]}
        backend_name, options = backend["name"], {k: v for k, v in backend.items() if k != "name"}
        processes = resolve_processes(top["processes_per_replica"], top["gpu"], source=where)
    return RunSpec(
        name=top["name"] or name_default, backend=backend_name, replicas=total,
        entrypoint=top["entrypoint"], workdir=str(workdir), timeout=top["timeout"], gpu=top["gpu"],
        processes_per_replica=processes, rendezvous=top["rendezvous"], secrets=list(top["secrets"]),
        args=dict(top["args"]), env={k: str(v) for k, v in top["env"].items()}, backend_options=options,
        restart=restart, diloco=diloco, metrics=check_metrics(where, top["metrics"]), region=top["region"],
        store_region=top["store_region"], groups=groups, source=source)


def _check_env(where: str, table: str, env: Mapping[str, Any]) -> dict[str, str]:
    for key, value in env.items():
        check_variable(where, table, key)
        if not isinstance(value, (str, int, float, bool)):
            raise SpecError(f"{where}: `{table}.{key}` must be a string, number or boolean, got {_type_name(value)}")
    return {k: str(v) for k, v in env.items()}


def _groups(where: str, top: Mapping[str, Any]) -> list[ReplicaGroup]:
    """The `[[group]]` tables as `ReplicaGroup`s, ranks numbered group by group. Every replica
    syncs as the same number of lanes (its processes: the lane layout is part of the wire), so
    the groups' `processes_per_replica` must agree."""
    defaults = {k: top[k] for k in INHERITED if top[k] is not None}
    tables = check_groups(where, top["group"], defaults)
    groups, first = [], 0
    for t in tables:
        gw = f"{where}: group {t['name']!r}"
        backend = t["backend"] if isinstance(t["backend"], dict) else {"name": t["backend"]}
        groups.append(ReplicaGroup(
            name=t["name"], backend=backend["name"], replicas=t["replicas"], first_rank=first,
            timeout=t["timeout"],
            processes_per_replica=resolve_processes(t["processes_per_replica"], t["gpu"], source=gw),
            gpu=t["gpu"], region=t["region"], env=_check_env(gw, "group.env", t["env"] or {}),
            backend_options={k: v for k, v in backend.items() if k != "name"}))
        first += t["replicas"]
    lanes = {g.processes_per_replica for g in groups}
    if len(lanes) > 1:
        a, b = groups[0], next(g for g in groups if g.processes_per_replica != groups[0].processes_per_replica)
        raise SpecError(f"{where}: group {a.name!r} runs {a.processes_per_replica} process(es) per replica and group "
                        f"{b.name!r} {b.processes_per_replica}; every replica syncs as the same number of lanes, so "
                        f"set `processes_per_replica` the same in every group (a GPU count does not have to match it)")
    return groups


def load_spec(path: str | Path) -> RunSpec:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} not found")
    if p.stat().st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{p}: {p.stat().st_size:,} bytes; a spec is at most {MAX_SPEC_BYTES:,} (put data in files "
                        f"in the workdir)")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a text file") from None
    except RecursionError:
        raise SpecError(f"{p}: tables or arrays nest too deep to read; flatten them") from None
    return parse_spec(data, source=str(p), base_dir=p.parent, name_default=p.stem if p.stem != "diloco"
                      else p.resolve().parent.name)

