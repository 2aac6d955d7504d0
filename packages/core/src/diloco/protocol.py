"""The executor protocol: what every backend implements, and the types it passes around.

A backend starts N replicas of one entrypoint somewhere (local processes, pods, SageMaker
training jobs) and reports on them. The contract, kept from the original design:

- `launch_replicas` returns handles in rank order (`handles[i].rank == i`), or, when `ranks`
  is given, one handle per requested rank in that order;
- every replica sees its rank in `REPLICA_RANK` (renamed by the entrypoint arg `rank_env`),
  the number of replicas in `DILOCO_REPLICAS` (and in `WORLD_SIZE` when a replica is one
  process), and the rendezvous URI in `DILOCO_RENDEZVOUS` (see `diloco.launchenv.replica_env`);
- `poll` returns a `ReplicaStatus`; `collect` returns one `ReplicaResult` per handle;
- `cancel` is best effort and idempotent: it never raises for a replica that already ended.

What the original lacked and this adds: `dryrun` (the exact request launch would submit,
secrets redacted), durable handles (`ReplicaHandle.to_json` / `from_json`, and any fresh
executor instance can poll, stream, cancel a handle made by another process), and relaunching
a subset of ranks as a new attempt (`ranks=`, `attempt=`), which the supervisor needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable


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
    It never holds secrets: handles are written to the run's records.
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

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "backend_name": self.backend_name, "metadata": dict(self.metadata)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaHandle:
        return cls(rank=int(data["rank"]), backend_name=str(data["backend_name"]),
                   metadata=dict(data.get("metadata") or {}))

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
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaResult:
        return cls(rank=int(data["rank"]), status=ReplicaStatus(data["status"]),
                   exit_code=data.get("exit_code"), error=data.get("error"),
                   result=data.get("result"), attempt=int(data.get("attempt", 0)))


@dataclass(frozen=True)
class LaunchPlan:
    """What `dryrun` returns: the exact request `launch_replicas` would submit.

    `request` is backend-shaped (a command line and environment for local processes, a Job
    manifest for Kubernetes, a CreateTrainingJob request for SageMaker) with secret values
    already replaced by `REDACTED`. `format` says how to render it ("json" or "yaml").
    """

    backend_name: str
    request: Any
    format: str = "json"


@runtime_checkable
class ServerlessExecutor(Protocol):
    """The contract every backend implements. See the module docstring for the rules.

    Class attributes:
      backend_name: the name a spec's `backend =` selects it by.
      supports_inter_replica_network: whether replicas can open connections to each other
        (DiLoCo never needs it; it talks through the object store).
      supports_rank_relaunch: whether `launch_replicas(..., ranks=[r])` can start one rank
        alone while the others run. If False, the supervisor restarts the whole gang.

    Optional class attribute (not part of the structural check, so older executors still match):
      shares_launcher_filesystem: True only if every replica sees the launcher's files (the
        local backend). Executors that leave it out are treated as remote, and `diloco run`
        refuses a file:// rendezvous for them (see `diloco.rendezvous`).

    Optional method (not part of the structural check):
      status_detail(handle) -> str | None: why a replica is pending right now, in words. When a
        running replica goes back to pending (a spot interruption the platform retries on its
        own), the supervisor records a `pending` event carrying it; such a replica never failed,
        so nothing is relaunched and no restart budget is spent.

    Keyword arguments beyond the original contract:
      run_id: the run these replicas belong to (the launcher makes one if None).
      rendezvous: the object-store URI replicas meet at, exported as DILOCO_RENDEZVOUS.
      ranks: launch only these ranks of a world of `n_replicas` (default: all).
      attempt: which attempt of these ranks this is (0 for the first launch).
      env: extra environment variables for every replica.
      secret_env: environment variables whose values must never be written anywhere
        (dry-run output, handles, logs of the launcher).
      processes_per_replica: optional; an executor that accepts it starts each replica as
        `diloco.procgroup.replica_command(L)` (torchrun over L processes). It is passed only
        when L > 1, and `diloco run/dryrun` refuse L > 1 for an executor that does not take it.
    """

    backend_name: str
    supports_inter_replica_network: bool
    supports_rank_relaunch: bool

    def launch_replicas(self, n_replicas: int, entrypoint: str | Sequence[str],
                        entrypoint_args: Mapping[str, Any] | None = None, *,
                        gpu: str | None = None, timeout: float = 3600,
                        run_id: str | None = None, rendezvous: str | None = None,
                        ranks: Sequence[int] | None = None, attempt: int = 0,
                        env: Mapping[str, str] | None = None,
                        secret_env: Mapping[str, str] | None = None) -> list[ReplicaHandle]:
        """Start the replicas and return their handles in rank order."""
        ...

    def dryrun(self, n_replicas: int, entrypoint: str | Sequence[str],
               entrypoint_args: Mapping[str, Any] | None = None, *,
               gpu: str | None = None, timeout: float = 3600,
               run_id: str | None = None, rendezvous: str | None = None,
               ranks: Sequence[int] | None = None, attempt: int = 0,
               env: Mapping[str, str] | None = None,
               secret_env: Mapping[str, str] | None = None) -> LaunchPlan:
        """Return what `launch_replicas` would submit, without submitting it."""
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


from .envvars import (  # noqa: E402,F401  (re-exported: part of the protocol)
    ENV_ATTEMPT, ENV_ENTRYPOINT, ENV_ENTRYPOINT_ARGS, ENV_RANK, ENV_RENDEZVOUS, ENV_RESULT_PATH, ENV_RUN_ID,
    ENV_REPLICAS, ENV_SETTINGS, ENV_STARTED_PATH, ENV_TIMEOUT, ENV_WORLD_SIZE,
)
