"""What core asks a backend for, and what the backend answers it will submit.

The contract is three steps (torchx's `schedule(submit_dryrun(...))` is the model):

    request = LaunchRequest(...)       # core: one typed description of a launch, validated here
    plan = executor.plan(request)      # backend: its own request (a Job manifest, CreateTrainingJob
                                       #   calls, sandboxes), plain data, no secret value in it
    handles = executor.submit(plan)    # backend: exactly that, with the secrets added at the last moment

`diloco dryrun` prints `plan.render()`; `diloco run` submits the same `plan` object, so what a
dry run shows is what is submitted by construction, not by two code paths agreeing.

Secrets travel apart (`Secrets`): they have no JSON form and print as REDACTED, so a plan, a
record or a log line cannot carry their values by accident; a backend reads them with
`reveal()` inside `submit` only. `LaunchPlan` refuses a body that contains a secret value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import BackendError, UserError
from .options import check_fields, option
from .inputs.replicaenv import REDACTED, Entrypoint, check_entrypoint_args, is_secret_name, parse_entrypoint, replica_env
from .inputs.variables import is_cloud
from .procgroup import MAX_NODES, MAX_PROCESSES

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MIN_SECRET_CHECK = 6  # shorter values ("1", "true") would match plain text by chance


class Secrets(Mapping[str, str]):
    """Secret environment variables: names are public, values never leave by accident.

    A Mapping of names to REDACTED; `reveal()` returns the real values, for `submit` alone.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, str] | None = None):
        values = dict(values or {})
        for name, value in values.items():
            if not isinstance(name, str) or not _ENV_NAME.match(name):
                raise UserError(f"secret name {name!r} is not an environment variable name")
            if not isinstance(value, str):
                raise UserError(f"secret {name} must be a string")
        self._values = values

    def __getitem__(self, name: str) -> str:
        if name not in self._values:
            raise KeyError(name)
        return REDACTED

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._values))

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Secrets({', '.join(f'{n}={REDACTED}' for n in self)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secrets) and other._values == self._values

    def __hash__(self) -> int:
        return hash(tuple(self))

    @property
    def names(self) -> list[str]:
        return sorted(self._values)

    def reveal(self) -> dict[str, str]:
        """The values, for the backend's `submit` to hand to its platform's secret store."""
        return dict(self._values)

    def redacted(self) -> dict[str, str]:
        return {n: REDACTED for n in self}


MAX_REPLICAS = 4096


def _run_id(value: str) -> str | None:
    return None if re.match(r"^[a-z0-9][a-z0-9-]{0,62}$", value) else "must be lowercase letters, digits and '-'"


def _versions(value: str | None) -> str | None:
    if value is None or re.fullmatch(r"([\w.-]+==[\w.+!-]+ ?)*", value):
        return None
    return "must read 'diloco-core==X diloco-replica==Y'"


@dataclass(frozen=True)
class LaunchRequest:
    """One launch of some ranks of a run, the same for every backend; checked when built.

    `env` never holds a secret: secret-looking names given in `env` are moved to `secrets`.
    `ranks` defaults to every rank; `attempt` counts relaunches of those ranks (0 first).
    `diloco_version` is the diloco the run was launched with ('diloco-core==X diloco-replica==Y',
    `diloco.shipping.wheelhouse.run_versions`), recorded with the run: a replica holding another stops.
    """

    # The plain values are declared with `option()` and checked by the one validator (`check_fields`).
    run_id: str = option(help="the run's id", check=_run_id)
    n_replicas: int = option(help="replicas in the run", min=1, max=MAX_REPLICAS)
    entrypoint: Entrypoint = field()  # given as "module:function" or a command; parsed below
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    secrets: Secrets = field(default_factory=Secrets)
    rendezvous: str | None = option(None, help="where the replicas meet (a store URI)")
    timeout: float = option(3600.0, help="seconds per replica attempt (a backend bounds it further)", min=0)
    processes_per_replica: int = option(1, help="processes on each node of a replica", min=1, max=MAX_PROCESSES)
    nodes: int = option(1, help="machines in each replica", min=1, max=MAX_NODES)
    gpu: str | None = option(None, help="the GPU per replica, as the spec names it")
    workdir: str | None = option(None, help="where the replicas' code lives")
    ranks: tuple[int, ...] = ()
    attempt: int = option(0, help="relaunches of these ranks before this one", min=0, max=10**6)
    diloco_version: str | None = option(None, help="the diloco the run was launched with", check=_versions)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen: normalise once, here
        if self.diloco_version is None:
            from .shipping.wheelhouse import run_versions

            set_("diloco_version", run_versions())
        check_fields(self, "launch request")
        if not isinstance(self.entrypoint, Entrypoint):
            set_("entrypoint", parse_entrypoint(self.entrypoint))
        args = dict(self.args or {})
        check_entrypoint_args(args)
        set_("args", args)
        secrets = self.secrets.reveal() if isinstance(self.secrets, Secrets) else dict(self.secrets or {})
        env = {}
        for k, v in dict(self.env or {}).items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise UserError(f"launch request: environment variable name {k!r} is not valid")
            if is_secret_name(k):
                secrets.setdefault(k, str(v))  # a secret-looking variable is a secret, whoever passed it
            else:
                env[k] = str(v)
        set_("env", env)
        set_("secrets", Secrets(secrets))
        ranks = tuple(self.ranks) or tuple(range(self.n_replicas))
        if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.n_replicas for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise UserError(f"launch request: ranks {list(ranks)} must be distinct and within 0..{self.n_replicas - 1}")
        set_("ranks", ranks)

    # -- what backends read --------------------------------------------------------------------

    @property
    def all_ranks(self) -> bool:
        """Whether this launch starts the whole world (a first launch or a gang restart)."""
        return self.ranks == tuple(range(self.n_replicas))

    @property
    def replica_processes(self) -> int:
        """The processes of one replica: `processes_per_replica` on each of its `nodes`."""
        return self.processes_per_replica * self.nodes

    def replica_env(self, rank: int) -> dict[str, str]:
        """The environment of one rank, without secrets (see `diloco.inputs.replicaenv.replica_env`)."""
        return replica_env(rank=rank, n_replicas=self.n_replicas, run_id=self.run_id, attempt=self.attempt,
                           entrypoint=self.entrypoint, entrypoint_args=self.args, rendezvous=self.rendezvous,
                           timeout=self.timeout, env=self.env, processes=self.replica_processes,
                           diloco_version=self.diloco_version)

    def for_ranks(self, ranks: Sequence[int], attempt: int) -> LaunchRequest:
        """The same launch for other ranks or another attempt (a relaunch)."""
        return replace(self, ranks=tuple(ranks), attempt=attempt)

    # -- records -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the run record: secret names, never values."""
        ep = self.entrypoint
        return {"run_id": self.run_id, "n_replicas": self.n_replicas,
                "entrypoint": ep.function if ep.function else list(ep.command or ()),
                "args": dict(self.args), "env": dict(self.env), "secret_names": self.secrets.names,
                "rendezvous": self.rendezvous, "timeout": self.timeout,
                "processes_per_replica": self.processes_per_replica, "nodes": self.nodes, "gpu": self.gpu,
                "workdir": self.workdir,
                "diloco_version": self.diloco_version}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> LaunchRequest:
        """Back from a record; `secrets` come from the shell that resumes, never from the record."""
        return cls(run_id=data["run_id"], n_replicas=data["n_replicas"], entrypoint=data["entrypoint"],
                   args=data.get("args") or {}, env=data.get("env") or {},
                   secrets=Secrets(secrets), rendezvous=data.get("rendezvous"), timeout=data.get("timeout", 3600.0),
                   processes_per_replica=data.get("processes_per_replica", 1), nodes=data.get("nodes", 1),
                   gpu=data.get("gpu"),
                   workdir=data.get("workdir"), diloco_version=data.get("diloco_version"))


@dataclass(frozen=True)
class LaunchPlan:
    """What a backend will submit for one `LaunchRequest`: its own request, as plain data.

    `body` is backend-shaped (processes with their environment, Kubernetes documents, training
    job requests) and must be JSON-serialisable; secrets appear in it only as REDACTED, which
    is checked here. `format` says how to render it ("json" or "yaml"). `request` is what it
    was planned from, secrets included (they never print), so `submit(plan)` needs nothing else.
    """

    backend_name: str
    request: LaunchRequest
    body: Any
    format: str = "json"
    # A run with replica groups (`diloco.launching.groupexec`): each group's own plan, what `submit` submits,
    # and a title for each ("group k8s: 2 × eks, ranks 0-1"); `body` then lists them as plain data.
    parts: tuple[LaunchPlan, ...] = field(default=(), compare=False, repr=False)
    part_titles: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.format not in ("json", "yaml"):
            raise BackendError(f"backend {self.backend_name!r} planned format {self.format!r}; use json or yaml")
        try:
            text = json.dumps(self.body, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise BackendError(f"backend {self.backend_name!r} planned a body that is not plain data: {exc}") from None
        # Cloud variables that address a store rather than prove who may use it (AWS_REGION,
        # AWS_ENDPOINT_URL, AZURE_STORAGE_ACCOUNT_NAME) travel as secrets so that replicas reach the
        # launcher's store (docs/security.md#variables); a plan may name the region it submits to.
        leaked = [n for n, v in self.request.secrets.reveal().items() if len(v) >= MIN_SECRET_CHECK and v in text
                  and not (is_cloud(n) and not is_secret_name(n))]
        if leaked:
            raise BackendError(f"backend {self.backend_name!r} put the value of secret {leaked[0]} into its plan; "
                               f"a plan holds REDACTED where a secret goes (report this to the backend's authors)")

    def render(self, fmt: str = "auto") -> str:
        """Exactly what `diloco dryrun` prints; a grouped plan prints each group's plan under its title."""
        if self.parts and fmt == "auto":  # one YAML stream ("---" between parts; JSON is YAML too)
            return "---\n".join(f"# {title}\n{part.render(fmt)}" for title, part in zip(self.part_titles, self.parts))
        fmt = self.format if fmt == "auto" else fmt
        if fmt == "yaml":
            import yaml  # backends that render YAML depend on PyYAML themselves

            docs = self.body if isinstance(self.body, list) else [self.body]
            return yaml.safe_dump_all(docs, sort_keys=False)
        return json.dumps(self.body, indent=2) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend_name, "format": self.format, "body": self.body}
