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
                                            #   (diloco.spec.groups; top-level keys are their defaults)

Unknown keys, wrong types and out-of-range values raise `SpecError` naming file and key.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SpecError
from .groups import ReplicaGroup, check_groups
from ..options import check_table, describe_value
from .schema import INHERITED, SpecTable
from ..inputs.replicaenv import check_entrypoint_args
from ..procgroup import check_layout, resolve_nodes, resolve_processes
from ..store.objectstore import SCHEMES, scheme_list
from .settings import DilocoSettings, RestartSettings
from ..plugins.sinks import check_metrics
from ..inputs.specvalues import MAX_ARGS_JSON, MAX_SPEC_BYTES, check_values, safe_uri, secret_key_path
from ..inputs.variables import check_variable


_URI = re.compile(rf"^({'|'.join(SCHEMES)})://")


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
    nodes: int = 1
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
                             timeout=self.timeout, processes_per_replica=self.processes_per_replica, nodes=self.nodes, gpu=self.gpu,
                             secrets=list(self.secrets), backend_options=dict(self.backend_options))]

    def secret_names(self) -> list[str]:
        """The launcher's variables some group's replicas get (each group: its own `secrets`, or
        the top-level list): what a launch reads from the shell. A top-level name that every group
        replaced with its own list is read by nobody."""
        return list(dict.fromkeys(n for g in self.replica_groups() for n in g.secrets))

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
    grouped = "group" in data
    if grouped:
        for key in ("replicas", "backend"):
            if key in data:
                raise SpecError(f"{where}: a spec with [[group]] tables has no top-level `{key}`; give each group "
                                f"its own (`replicas = N` and a [group.backend] table)")
    top = check_table(where, data, SpecTable, optional=("replicas", "backend") if grouped else ())
    groups = _groups(where, top) if grouped else []
    total = sum(g.replicas for g in groups) if grouped else top["replicas"]
    if total > 4096:
        raise SpecError(f"{where}: the groups hold {total} replicas together; a run has at most 4096")
    restart = check_table(where, top["restart"], RestartSettings, prefix="restart.")
    diloco = check_table(where, top["diloco"], DilocoSettings, prefix="diloco.")
    if restart["min_replicas"] is not None and restart["min_replicas"] > total:
        raise SpecError(f"{where}: `restart.min_replicas` ({restart['min_replicas']}) exceeds `replicas` "
                        f"({total})")
    if diloco["min_members"] > total:
        raise SpecError(f"{where}: `diloco.min_members` ({diloco['min_members']}) exceeds `replicas` "
                        f"({total})")
    DilocoSettings.from_table(top["diloco"], where=where)  # the cross-setting rules, in their one place
    _check_env(where, "env", top["env"])
    _check_secrets(where, "secrets", top["secrets"])
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
        processes, nodes = groups[0].processes_per_replica, groups[0].nodes
    else:
        backend = top["backend"] if isinstance(top["backend"], dict) else {"name": top["backend"]}
        backend_name, options = backend["name"], {k: v for k, v in backend.items() if k != "name"}
        processes = resolve_processes(top["processes_per_replica"], top["gpu"], source=where)
        nodes = resolve_nodes(top["nodes"], source=where)
        check_layout(processes, top["gpu"], source=where)
    return RunSpec(
        name=top["name"] or name_default, backend=backend_name, replicas=total,
        entrypoint=top["entrypoint"], workdir=str(workdir), timeout=top["timeout"], gpu=top["gpu"],
        processes_per_replica=processes, nodes=nodes, rendezvous=top["rendezvous"], secrets=list(top["secrets"]),
        args=dict(top["args"]), env={k: str(v) for k, v in top["env"].items()}, backend_options=options,
        restart=restart, diloco=diloco, metrics=check_metrics(where, top["metrics"]), region=top["region"],
        store_region=top["store_region"], groups=groups, source=source)


def _check_env(where: str, table: str, env: Mapping[str, Any]) -> dict[str, str]:
    for key, value in env.items():
        check_variable(where, table, key)
        if not isinstance(value, (str, int, float, bool)):
            raise SpecError(f"{where}: `{table}.{key}` must be a string, number or boolean, "
                            f"got {describe_value(value)}")
    return {k: str(v) for k, v in env.items()}


def _check_secrets(where: str, key: str, names: list[str]) -> list[str]:
    for name in names:
        check_variable(where, "secrets", name)
    if len(set(names)) != len(names):
        raise SpecError(f"{where}: `{key}` lists a variable twice; list each once")
    return list(names)


def _groups(where: str, top: Mapping[str, Any]) -> list[ReplicaGroup]:
    """The `[[group]]` tables as `ReplicaGroup`s, ranks numbered group by group. Groups may run
    different numbers of processes per replica (an 8-GPU node beside single GPUs): the exchange
    is cut from the model's flat vector, not per process (diloco_replica's `layout`)."""
    defaults = {k: top[k] for k in INHERITED if top[k] is not None}
    tables = check_groups(where, top["group"], defaults)
    groups, first = [], 0
    for t in tables:
        gw = f"{where}: group {t['name']!r}"
        processes = resolve_processes(t["processes_per_replica"], t["gpu"], source=gw)
        check_layout(processes, t["gpu"], source=gw)
        backend = t["backend"] if isinstance(t["backend"], dict) else {"name": t["backend"]}
        groups.append(ReplicaGroup(
            name=t["name"], backend=backend["name"], replicas=t["replicas"], first_rank=first,
            timeout=t["timeout"],
            processes_per_replica=processes,
            nodes=resolve_nodes(t["nodes"], source=gw),
            gpu=t["gpu"], region=t["region"], env=_check_env(gw, "group.env", t["env"] or {}),
            secrets=_check_secrets(gw, "group.secrets", t["secrets"] or []),
            backend_options={k: v for k, v in backend.items() if k != "name"}))
        first += t["replicas"]
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

