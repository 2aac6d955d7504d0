"""The one adapter for executors written against the first contract, and where core reads a
backend's declarations.

The first contract (diloco-core 0.1's README) had executors implement `launch_replicas(n,
entrypoint, args, *, gpu, timeout, run_id, rendezvous, ranks, attempt, env, secret_env[,
processes_per_replica])` and `dryrun(...)` with the same arguments, take their `[backend]` options
as `__init__` keyword parameters (help in the `Args:` docstring), and state what they can do as
loose attributes (`supports_rank_relaunch`, `shares_launcher_filesystem`, an optional
`status_detail` method). Such a plugin keeps working: `make_executor` wraps it in
`FirstContractExecutor`, which presents `plan` / `submit` / `capabilities`, and
`describe_backend_options` reads its signature. This module is the only place that looks at
signatures and attributes; everything else reads `executor.capabilities` and `cls.Options`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

from .errors import SpecError
from .options import BackendOption, describe_options, parse_options
from .protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from .request import LaunchPlan, LaunchRequest


class LegacyPlan(NamedTuple):
    """What a first-contract `dryrun` returns (`diloco.protocol.LaunchPlan` in 0.1)."""

    backend_name: str
    request: Any
    format: str = "json"


def is_first_contract(cls: type) -> bool:
    return not (hasattr(cls, "plan") and hasattr(cls, "submit"))


def _takes(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def first_contract_capabilities(executor: Any) -> Capabilities:
    return Capabilities(
        shares_launcher_filesystem=getattr(executor, "shares_launcher_filesystem", False) is True,
        relaunches_one_rank=getattr(executor, "supports_rank_relaunch", False) is True,
        process_groups=_takes(getattr(executor, "launch_replicas", None), "processes_per_replica"),
        inter_replica_network=getattr(executor, "supports_inter_replica_network", False) is True,
        status_detail=callable(getattr(executor, "status_detail", None)),
        log_files=callable(getattr(executor, "log_path", None)))


class FirstContractExecutor:
    """A first-contract executor presented as the current one (`diloco.protocol.Executor`)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.backend_name = inner.backend_name
        self.capabilities = first_contract_capabilities(inner)

    def _arguments(self, request: LaunchRequest) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ep = request.entrypoint
        kwargs: dict[str, Any] = dict(gpu=request.gpu, timeout=request.timeout, run_id=request.run_id,
                                      rendezvous=request.rendezvous, ranks=list(request.ranks),
                                      attempt=request.attempt, env=dict(request.env),
                                      secret_env=request.secrets.reveal())
        if request.processes_per_replica > 1:  # passed only when > 1, as the first contract said
            kwargs["processes_per_replica"] = request.processes_per_replica
        entrypoint = ep.function if ep.function else list(ep.command or ())
        return (request.n_replicas, entrypoint, dict(request.args)), kwargs

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        args, kwargs = self._arguments(request)
        shown = self.inner.dryrun(*args, **kwargs)
        return LaunchPlan(self.backend_name, request, shown.request, getattr(shown, "format", "json"))

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        args, kwargs = self._arguments(plan.request)
        return list(self.inner.launch_replicas(*args, **kwargs))

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        return self.inner.poll(handle)

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        return self.inner.stream_logs(handle, n_lines=n_lines)

    def cancel(self, handle: ReplicaHandle) -> None:
        self.inner.cancel(handle)

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        return self.inner.collect(handles, timeout=timeout)

    def status_detail(self, handle: ReplicaHandle) -> str | None:
        return self.inner.status_detail(handle)

    def __getattr__(self, name: str) -> Any:  # anything else the plugin offers (log_path, …)
        return getattr(self.inner, name)


def as_executor(executor: Any) -> Any:
    """The executor as the current contract sees it (first-contract ones wrapped)."""
    return FirstContractExecutor(executor) if is_first_contract(type(executor)) else executor


def capabilities_of(executor: Any) -> Capabilities:
    """What core asks about a backend, in one place."""
    caps = getattr(executor, "capabilities", None)
    return caps if isinstance(caps, Capabilities) else first_contract_capabilities(executor)


# -- options -----------------------------------------------------------------------------------


def _first_contract_options(cls: type) -> list[BackendOption]:
    """Options of a first-contract executor: `__init__`'s keyword parameters, help from `Args:`."""
    import docstring_parser

    helps: dict[str, str] = {}
    for doc in (inspect.getdoc(cls.__init__), inspect.getdoc(cls)):
        for p in docstring_parser.parse(doc).params if doc else []:
            helps.setdefault(p.arg_name, " ".join((p.description or "").split()))
    out = []
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or name.startswith("_") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        required = p.default is inspect.Parameter.empty
        default = None if required else p.default
        ann = p.annotation
        text = ("any" if ann is inspect.Parameter.empty and default is None else
                type(default).__name__ if ann is inspect.Parameter.empty else
                ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann)))
        if default is None:
            text = " | ".join(x for x in (y.strip() for y in text.split("|")) if x != "None") or "any"
        out.append(BackendOption(name, text.replace("typing.", ""), default, required, helps.get(name, "")))
    return out


def describe_backend_options(cls: type) -> list[BackendOption]:
    """What `diloco backends NAME` lists, for either kind of executor."""
    options_type = getattr(cls, "Options", None)
    return describe_options(options_type) if options_type else _first_contract_options(cls)


def make_executor(cls: type, table: dict[str, Any], *, workdir: str | None = None, source: str = "<spec>") -> Any:
    """An executor built from the spec's `[backend]` table (without `name`), checked first."""
    name = getattr(cls, "backend_name", "?")
    options_type = getattr(cls, "Options", None)
    if options_type is not None:
        options = parse_options(options_type, table, source=source, backend=name)
        try:
            return cls(options)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{source}: [backend] options for {name!r}: {exc}") from None
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(table) - set(params))
    if unknown and not takes_any:
        raise SpecError(f"{source}: unknown key `backend.{unknown[0]}` for backend {name!r} "
                        f"(allowed: {', '.join(sorted(params)) or 'none'})")
    kwargs = dict(table)
    if workdir and ("workdir" in params or takes_any):
        kwargs.setdefault("workdir", workdir)
    try:
        executor = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{source}: [backend] options for {name!r}: {exc}") from None
    return as_executor(executor)
