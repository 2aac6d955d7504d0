"""An executor written against the first contract, as a third-party plugin of diloco-core 0.1 was.

It runs replicas as local processes (through `LocalProcessExecutor`), but talks the way that
README told backend authors to: `launch_replicas` / `dryrun` with the eleven keyword arguments,
options as `__init__` keywords documented in `Args:`, and capabilities as loose attributes. Core's
tests run it through the conformance kit and `diloco run` to prove `diloco.legacy` keeps such
plugins working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diloco.legacy import LegacyPlan
from diloco.local import LocalProcessExecutor
from diloco.protocol import ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchRequest, Secrets


class FirstContractExecutor:
    """Local processes behind the first contract.

    Args:
        workdir: directory replicas start in (the spec's directory, passed because __init__ names it).
        grace_period: seconds between SIGTERM and SIGKILL when a replica is cancelled.
    """

    backend_name = "first-contract"
    supports_inter_replica_network = True
    supports_rank_relaunch = True
    shares_launcher_filesystem = True

    def __init__(self, *, workdir: str | None = None, grace_period: float = 2.0):
        self.workdir = workdir
        self._local = LocalProcessExecutor(grace_period=grace_period)

    def _request(self, n_replicas, entrypoint, entrypoint_args, *, gpu, timeout, run_id, rendezvous, ranks,
                 attempt, env, secret_env, processes=1) -> LaunchRequest:
        return LaunchRequest(run_id=run_id or "first-contract-run", n_replicas=n_replicas, entrypoint=entrypoint,
                             args=dict(entrypoint_args or {}), env=dict(env or {}), secrets=Secrets(secret_env),
                             rendezvous=rendezvous, timeout=timeout, processes_per_replica=processes, gpu=gpu,
                             workdir=self.workdir, ranks=tuple(ranks or ()), attempt=attempt)

    def dryrun(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600, run_id=None,
               rendezvous=None, ranks=None, attempt=0, env=None, secret_env=None):
        request = self._request(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout, run_id=run_id,
                                rendezvous=rendezvous, ranks=ranks, attempt=attempt, env=env, secret_env=secret_env)
        return LegacyPlan(self.backend_name, self._local.plan(request).body)

    def launch_replicas(self, n_replicas, entrypoint, entrypoint_args=None, *, gpu=None, timeout=3600,
                        run_id=None, rendezvous=None, ranks=None, attempt=0, env=None,
                        secret_env=None) -> list[ReplicaHandle]:
        request = self._request(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout, run_id=run_id,
                                rendezvous=rendezvous, ranks=ranks, attempt=attempt, env=env, secret_env=secret_env)
        handles = self._local.submit(self._local.plan(request))
        return [ReplicaHandle(h.rank, self.backend_name, h.metadata) for h in handles]

    def _as_local(self, handle: ReplicaHandle) -> ReplicaHandle:
        return ReplicaHandle(handle.rank, "local", handle.metadata)

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        return self._local.poll(self._as_local(handle))

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        return self._local.stream_logs(self._as_local(handle), n_lines=n_lines)

    def cancel(self, handle: ReplicaHandle) -> None:
        self._local.cancel(self._as_local(handle))

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        return self._local.collect([self._as_local(h) for h in handles], timeout=timeout)

    def log_path(self, handle: ReplicaHandle) -> Any:
        return self._local.log_path(self._as_local(handle))
