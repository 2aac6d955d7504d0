"""The restart policy as a pure function: what to do about one failed replica attempt.

No processes, no clock, no I/O: the supervisor observes a failure, asks `decide`, and carries
out the answer (events, cancels, launches). So every rule below is tested as a table of cases
(`packages/core/tests/test_policy.py`), and the supervisor's own tests only check the wiring.

The rules (the `[restart]` table, `RestartSettings`):

- a replica that stopped on a spec or store mistake (exit 78) fails the run: a relaunch repeats it;
- the same exception at the same global step on every rank, each within `fail_fast_seconds` of
  its launch, fails the run: it is a bug in the code, and each relaunch costs minutes and money;
- a preemption (exit 75) is relaunched after `backoff` without spending `max_restarts` or
  `max_restarts_per_rank`, up to `max_preemptions` for the whole run;
- otherwise `per-rank` relaunches the rank after `backoff * 2^restarts` (at most `backoff_max`)
  while its budgets last, `gang` restarts every rank (one restart of the run), `never` gives up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .failures import code_failure_signature, is_config_error, is_preemption


@dataclass(frozen=True)
class RestartSettings:
    """The `[restart]` table, typed; defaults come from the spec's schema (`diloco.schema.RESTART`)."""

    policy: str
    max_restarts: int
    max_restarts_per_rank: int
    backoff: float
    backoff_max: float
    min_replicas: int
    monitor_interval: float
    max_preemptions: int
    fail_fast_seconds: float

    @classmethod
    def from_table(cls, table: Mapping[str, Any], n_replicas: int, *, relaunches_one_rank: bool = True) -> RestartSettings:
        from .schema import RESTART, check_table

        values = check_table("[restart]", {k: v for k, v in table.items() if v is not None}, RESTART, "restart.")
        values["min_replicas"] = values["min_replicas"] or n_replicas
        if values["policy"] == "per-rank" and not relaunches_one_rank:
            values["policy"] = "gang"  # the backend cannot start one rank alone
        return cls(**{f.name: values[f.name] for f in fields(cls)})

    def backoff_after(self, restarts: int) -> float:
        return min(self.backoff * (2 ** restarts), self.backoff_max)


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as observed: its exit code, its error text, when it was launched."""

    exit_code: int | None
    error: str | None
    launched_at: float | None
    now: float

    @property
    def signature(self) -> str | None:
        """The cause, if training code raised it at a known step (`diloco.failures`)."""
        return code_failure_signature(self.error)


@dataclass(frozen=True)
class Peer:
    """Another rank's latest failure, for the same-bug-everywhere rule."""

    signature: str | None
    failed_soon: bool


@dataclass(frozen=True)
class Decision:
    """What to do. `action`: relaunch | gang_restart | give_up | give_up_all | fail_run."""

    action: str
    delay: float = 0.0
    preempted: bool = False
    reason: str = ""
    signature: str | None = None  # the rank's failure signature and whether it came soon, to keep
    failed_soon: bool = False


def decide(s: RestartSettings, failure: Failure, *, rank: int, restarts: int, restarts_used: int,
           preemptions_used: int, peers: Sequence[Peer]) -> Decision:
    """The answer to one failed attempt of `rank` (which has been relaunched `restarts` times)."""
    if is_preemption(failure.exit_code):
        if s.policy == "never":
            return Decision("give_up", preempted=True, reason="restart policy is never")
        if preemptions_used >= s.max_preemptions:
            return Decision("give_up", preempted=True, reason=f"max_preemptions ({s.max_preemptions}) reached")
        if s.policy == "gang":
            return Decision("gang_restart", delay=s.backoff_after(restarts_used), preempted=True)
        return Decision("relaunch", delay=min(s.backoff, s.backoff_max), preempted=True)
    signature = failure.signature
    soon = failure.launched_at is None or failure.now - failure.launched_at <= s.fail_fast_seconds
    keep = {"signature": signature, "failed_soon": soon}
    if is_config_error(failure.exit_code):
        return Decision("fail_run", reason=f"rank {rank} stopped on a configuration error, which a relaunch would "
                                           f"repeat: {failure.error}", **keep)
    everyone = [Peer(signature, soon), *peers]
    sigs = {p.signature if p.failed_soon else None for p in everyone}
    if len(sigs) == 1 and None not in sigs:
        return Decision("fail_run", reason=f"every rank failed with the same error at the same step: {sigs.pop()}; "
                                           f"not relaunching (it would fail again): fix the code and start a new run",
                        **keep)
    if s.policy == "gang":
        if restarts_used >= s.max_restarts:
            return Decision("give_up_all", reason="gang restart budget spent", **keep)
        return Decision("gang_restart", delay=s.backoff_after(restarts_used), **keep)
    if s.policy == "never":
        return Decision("give_up", reason="restart policy is never", **keep)
    if restarts >= s.max_restarts_per_rank or restarts_used >= s.max_restarts:
        return Decision("give_up", reason="restart budget spent", **keep)
    return Decision("relaunch", delay=s.backoff_after(restarts), **keep)
