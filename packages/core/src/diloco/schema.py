"""The spec's tables as data: each key's type, bounds, choices, default and help, and the one
check that reads them (`check_table`).

Its own module so that `diloco.spec` (which parses a file), `diloco.groups` and
`diloco.settings` (which read their tables) all depend on it and not on each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import SpecError, UserError
from .replicaenv import parse_entrypoint
from .wiresize import CODECS


def type_name(value: Any) -> str:
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
        fail = lambda want: SpecError(f"{where}: `{key}` must be {want}, got {value!r} ({type_name(value)})")  # noqa: E731
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
