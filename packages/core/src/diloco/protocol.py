"""The executor contract: what every backend implements, and the types it passes around.

A backend starts replicas of one entrypoint somewhere (local processes, pods, SageMaker
training jobs) and reports on them. Core talks to it in three steps and four verbs:

    plan(LaunchRequest) -> LaunchPlan        what would be submitted (what `diloco dryrun` prints)
    submit(LaunchPlan) -> [ReplicaHandle]    submit exactly that; handles in the request's rank order
    poll / stream_logs / cancel / collect    one replica, by its durable handle, from any process

The rules:

- every replica sees its rank in `REPLICA_RANK` (renamed by the entrypoint arg `rank_env`), the
  number of replicas in `DILOCO_REPLICAS` (and `WORLD_SIZE` when a replica is one process) and
  the rendezvous URI in `DILOCO_RENDEZVOUS`: `LaunchRequest.replica_env(rank)` builds it;
- `poll` returns a `ReplicaStatus` and never blocks; `collect` returns one `ReplicaResult` per handle;
- `cancel` is best effort and idempotent: it never raises for a replica that already ended;
- handles are durable (`to_json` / `from_json`) and hold no secret: any fresh executor instance
  can poll, stream, cancel a handle made by another process;
- what a backend can do is declared once, in `capabilities` (`Capabilities`), never sniffed; a
  capability that promises a method (`status_detail`, `numbered_reruns`, `log_files`) comes with
  the method its Protocol below declares (`DescribesPending`, `NumbersReruns`, `HasLogFiles`);
- the supervisor submits a relaunch on a worker thread while it polls, cancels and collects the
  other ranks on its own (`diloco.supervise.launches`): `plan`/`submit` may run beside those
  calls, never beside each other, so an executor's shared state must allow that (SDK clients
  that are thread-safe, or a lock).

The request and plan types live in `diloco.request`; the variables' names in `diloco.inputs.envvars`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .records import from_record, to_record

if TYPE_CHECKING:
    from .request import LaunchPlan, LaunchRequest


class ReplicaStatus(str, Enum):
    """Lifecycle of one replica attempt. Compares equal to its plain string value."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED, ReplicaStatus.CANCELLED)

    def __str__(self) -> str:  # print as "running", not "ReplicaStatus.RUNNING"
        return self.value


@dataclass(frozen=True)
class ReplicaHandle:
    """Names one replica attempt durably.

    `metadata` holds whatever the backend needs to find the replica again from another
    process (a pid and log path, a Job name and namespace) and must be JSON-serializable.
    It never holds secrets: handles are written to the run's records. Two keys are core's: the
    request's `attempt` (relaunches are numbered `attempt + 1` from it) and its `run_id`.
    """

    rank: int
    backend_name: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def attempt(self) -> int:
        return int(self.metadata.get("attempt", 0))

    @property
    def run_id(self) -> str | None:
        return self.metadata.get("run_id")

    @classmethod
    def of(cls, request: LaunchRequest, rank: int, backend_name: str, **platform: Any) -> ReplicaHandle:
        """Rank `rank`'s handle for `request`: core's two keys (the request's run and attempt) and
        what the platform needs to find the replica again (`platform`, JSON-serializable)."""
        return cls(rank, backend_name, {"run_id": request.run_id, "attempt": request.attempt, **platform})

    def to_dict(self) -> dict[str, Any]:
        return to_record(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaHandle:
        return from_record(cls, data, where="a replica handle")

    @classmethod
    def from_json(cls, text: str) -> ReplicaHandle:
        return cls.from_dict(json.loads(text))


@dataclass
class ReplicaResult:
    """What `collect` returns for one rank."""

    rank: int
    status: ReplicaStatus
    exit_code: int | None = None
    error: str | None = None
    result: Any = None
    attempt: int = 0

    def to_dict(self) -> dict[str, Any]:
        return to_record(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaResult:
        return from_record(cls, data, where="a replica result")

    @classmethod
    def failed(cls, handle: ReplicaHandle, status: ReplicaStatus, error: str,
               exit_code: int | None = None) -> ReplicaResult:
        """A replica that ended badly (failed, preempted, timed out): the platform's account of
        it, and its exit code, 1 where the platform gives none (every failure has a non-zero one)."""
        return cls(handle.rank, status, exit_code if isinstance(exit_code, int) else 1, error, None, handle.attempt)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once as its executor's `capabilities`; core reads it in one
    place (`executor.capabilities`) to choose policies and refuse what cannot work.

    shares_launcher_filesystem: every replica sees the launcher's files (the local backend, and Slurm
        submitting from a login node of the cluster: not over ssh).
        False: `diloco run` refuses a file:// rendezvous, which each replica would see on its own disk.
    relaunches_one_rank: one rank can be started alone while the others run (`LaunchRequest.ranks`);
        False: the supervisor restarts the whole gang.
    process_groups: a replica can be several processes (`processes_per_replica` > 1, torchrun).
    multi_node: a replica can be several machines (`nodes` > 1): the platform places them together,
        starts `replica_command(P, K)` on each with `diloco.procgroup.node_env` (its node rank and
        the first node's address), and ends them all, as one attempt, when one of them ends.
    inter_replica_network: replicas can open connections to each other (DiLoCo never needs it).
    preemption_signal: the signal the platform announces a preemption with, if it sends one; the
        backend exports it to replicas as DILOCO_PREEMPTION_SIGNAL and the runner turns it into exit 75.
    status_detail: the executor has `status_detail(handle) -> str | None`, the platform's words
        for why a replica is pending again (recorded in `pending` events).
    numbered_reruns: the platform runs an attempt again in place and numbers the runs (Slurm's
        requeue: the same job, Restarts + 1): the executor has `reruns(handle) -> int | None`, how
        many re-runs of the attempt the platform has started or scheduled (None: cannot tell now),
        and each run's replica gets its number as DILOCO_RERUN. The launcher then marks the run
        that ended away at once (`diloco.store.presence`), so no round waits for it.
    log_files: the executor has `log_path(handle) -> Path`, an absolute path on this machine of a
        file the replica's output grows in; `diloco logs --follow` tails it instead of re-reading `stream_logs`.
    cloud: the cloud whose network the replicas run in ("aws", "gcp", "azure"), so the estimate
        prices their reads of a store there by region; None (Modal, your own machines): the internet.
    """

    shares_launcher_filesystem: bool = False
    relaunches_one_rank: bool = False
    process_groups: bool = False
    multi_node: bool = False
    inter_replica_network: bool = False
    preemption_signal: str | None = None
    status_detail: bool = False
    numbered_reruns: bool = False
    log_files: bool = False
    cloud: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Executor(Protocol):
    """The contract every backend implements; see the module docstring for the rules.

    Class attributes:
      backend_name: the name a spec's `backend =` selects it by.
      Options: a dataclass of the `[backend]` options (`diloco.options.option` gives each its help,
        bounds and choices).
      capabilities: a `Capabilities` (an instance attribute when it depends on the options).

    The constructor is `cls(options=None, /, **overrides)`: the launcher passes the spec's
    `[backend]` options as an `Options`; Python callers may pass keywords instead
    (`diloco.options.options_from` does both, with the same checks).
    """

    backend_name: str
    capabilities: Capabilities
    Options: type

    def __init__(self, options: Any = None, /, **overrides: Any) -> None:
        ...

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """What `submit` would send for this request, with no secret value in it. Checks
        everything that can be checked without submitting (raising `UserError`)."""
        ...

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        """Start exactly `plan`; handles in `plan.request.ranks` order. If rank k cannot be
        started, the ranks already started are cancelled before the error is raised."""
        ...

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        """The replica's current status; one cheap read, never blocks."""
        ...

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The last `n_lines` lines of the replica's output (a placeholder if none yet)."""
        ...

    def cancel(self, handle: ReplicaHandle) -> None:
        """Stop the replica. Idempotent; never raises for one that already ended."""
        ...

    def collect(self, handles: Sequence[ReplicaHandle], *,
                timeout: float | None = None) -> list[ReplicaResult]:
        """Wait for every handle to end (up to `timeout`) and return their results."""
        ...


# The optional methods: an executor whose `capabilities` flag promises one has it (the conformance
# kit checks), and core calls it only then.


@runtime_checkable
class DescribesPending(Protocol):
    """`Capabilities.status_detail`: the platform's words for why a replica is pending again."""

    def status_detail(self, handle: ReplicaHandle) -> str | None:
        """Why the replica is pending again ("Interrupted: spot capacity was reclaimed"), or None."""
        ...


@runtime_checkable
class NumbersReruns(Protocol):
    """`Capabilities.numbered_reruns`: the platform runs an attempt again in place and numbers the runs."""

    def reruns(self, handle: ReplicaHandle) -> int | None:
        """How many re-runs of the attempt the platform has started or scheduled (0 for one that ran
        once); None when it cannot tell now."""
        ...


@runtime_checkable
class HasLogFiles(Protocol):
    """`Capabilities.log_files`: each replica's output grows in a file on the launcher's machine."""

    def log_path(self, handle: ReplicaHandle) -> Path:
        """The absolute path of the file the replica's output grows in (`diloco logs --follow` tails it)."""
        ...


OPTIONAL_METHODS: dict[str, tuple[type, str]] = {
    "status_detail": (DescribesPending, "status_detail"),
    "numbered_reruns": (NumbersReruns, "reruns"),
    "log_files": (HasLogFiles, "log_path"),
}
"""Each capability flag that promises a method: the Protocol declaring it, and the method's name."""
