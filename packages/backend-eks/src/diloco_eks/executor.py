"""EksExecutor: replicas as pods of Kubernetes Indexed Jobs (EKS or any cluster ≥ 1.29).

`plan` builds the documents (`diloco_eks.manifest`): per Job, its env Secret with the values
REDACTED, then the Job; `submit` creates exactly those, filling the Secret's values in from the
request at that moment. The cluster is reached through `diloco_eks.api` (the SDK loads on first
API use, so `diloco backends` and `diloco dryrun` need no cluster).

Per-rank relaunch (the supervisor's default policy): Jobs carry `backoffLimitPerIndex: 0`, so a
failed index is marked in `failedIndexes` while the other pods keep running; the supervisor sees
that rank `failed` and relaunches it as a one-pod Job `<run>-r<rank>-a<attempt>` with the rank as
a literal. With `per_index = false` (clusters < 1.29) Jobs use `backoffLimit: 0` and the
supervisor restarts the whole gang instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from diloco.errors import EXIT_TIME_LIMIT, BackendError
from diloco.options import options_from
from diloco.protocol import Capabilities, ReplicaHandle, ReplicaResult, ReplicaStatus
from diloco.request import LaunchPlan, LaunchRequest
from diloco.submitting import start_each
from diloco.waiting import collect_results

from .api import KubeApi
from .manifest import job_ranks, launch_documents, secret_refs
from .options import EksOptions
from .results import deadline_cause, failure_text
from .status import index_status, terminated, waiting_problem


class EksExecutor:
    """One Kubernetes Indexed Job per attempt, one pod per rank (see the README for the manifest;
    `EksOptions` for the `[backend]` options)."""

    backend_name = "eks"
    Options = EksOptions
    # pods have their own disks: the rendezvous must be an object store. relaunches_one_rank
    # follows `per_index` (set per instance).
    capabilities = Capabilities(shares_launcher_filesystem=False, relaunches_one_rank=True, process_groups=True,
                                inter_replica_network=True, cloud="aws")

    def __init__(self, options: EksOptions | None = None, /, **overrides: Any):
        self.options = options_from(type(self), options, overrides)
        self.options.check()
        self.capabilities = replace(EksExecutor.capabilities, relaunches_one_rank=self.options.per_index)
        self.api = KubeApi(self.options)
        self._errors: dict[tuple[str, int], str] = {}

    # -- launching -----------------------------------------------------------------------------

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """The Kubernetes documents, in the order `submit` creates them (YAML `kubectl apply` takes)."""
        return LaunchPlan(self.backend_name, request, launch_documents(request, self.options), format="yaml")

    def submit(self, plan: LaunchPlan) -> list[ReplicaHandle]:
        request = plan.request
        jobs = {job_ranks(d)[0]: d for d in plan.body if d["kind"] == "Job"}
        secrets = {d["metadata"]["name"]: d for d in plan.body if d["kind"] == "Secret"}
        if sorted(r for d in jobs.values() for r in job_ranks(d)) != sorted(request.ranks):
            raise BackendError(f"the eks plan starts other ranks than its request ({list(request.ranks)})")
        self.api.client()  # no credentials: one clear error before anything is created
        values = request.secrets.reveal()
        started = start_each(list(jobs), lambda rank: self._start(request, jobs[rank], [
            secrets[name] for name in sorted(secret_refs(jobs[rank]))], values), self.cancel,
            platform="Kubernetes", unit="Job(s)")
        by_rank = {}
        for first in started:
            for index, rank in enumerate(job_ranks(jobs[first.rank])):
                by_rank[rank] = ReplicaHandle(rank, self.backend_name, {**first.metadata, "index": index})
        return [by_rank[rank] for rank in request.ranks]

    def _start(self, request: LaunchRequest, job: dict[str, Any], secret_docs: list[dict[str, Any]],
               values: dict[str, str]) -> ReplicaHandle:
        """Create one Job's Secret (with the real values, only here) and the Job; the handle of its first index."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        core, batch = self.api.core(), self.api.batch()
        for doc in secret_docs:
            filled = {**doc, "stringData": {k: values[k] for k in doc["stringData"]}}
            self._delete_secret(ns, doc["metadata"]["name"])  # a leftover of an earlier try of this Job
            self.api.call("create", "secrets", ns, core.create_namespaced_secret, ns, filled, _preload_content=False)
        try:
            resp = self.api.call("create", "jobs.batch", ns, batch.create_namespaced_job, ns, job,
                                 _preload_content=False)
        except BackendError:
            for doc in secret_docs:  # no Job owns it yet: do not leave the values behind
                try:
                    self._delete_secret(ns, doc["metadata"]["name"])
                except BackendError:
                    pass  # the Job's error is the one to report
            raise
        uid = (json.loads(resp.data).get("metadata") or {}).get("uid")
        for doc in secret_docs if uid else []:  # garbage-collected with its Job
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "blockOwnerDeletion": False}
            self.api.call("patch", "secrets", ns, core.patch_namespaced_secret, doc["metadata"]["name"], ns,
                          {"metadata": {"ownerReferences": [owner]}}, missing_ok=True, _preload_content=False)
        return ReplicaHandle.of(request, job_ranks(job)[0], self.backend_name, job=name, namespace=ns, index=0,
                                context=self.options.context,
                                secret=secret_docs[0]["metadata"]["name"] if secret_docs else None)

    def _delete_secret(self, ns: str, name: str) -> None:
        self.api.call("delete", "secrets", ns, self.api.core().delete_namespaced_secret, name, ns, missing_ok=True,
                      _preload_content=False)

    # -- observing -----------------------------------------------------------------------------

    def _pod_for(self, handle: ReplicaHandle) -> dict[str, Any] | None:
        md = handle.metadata
        return self.api.pod_for(md["namespace"], md["job"], md["index"])

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        md = handle.metadata
        status = index_status(self.api.job(md["namespace"], md["job"]), md["index"])
        if status in (ReplicaStatus.RUNNING, ReplicaStatus.PENDING):
            pod = self._pod_for(handle)
            problem = waiting_problem(pod) if pod else None
            if problem:
                self._errors[(md["job"], md["index"])] = f"pod {pod['metadata']['name']} cannot start: {problem}"
                return ReplicaStatus.FAILED
            if pod is None or (pod.get("status") or {}).get("phase") == "Pending":
                return ReplicaStatus.PENDING
        return status

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        md = handle.metadata
        pod = self._pod_for(handle)
        if pod is None:
            return f"(no pod yet for rank {handle.rank} of job {md['job']})\n"
        name = pod["metadata"]["name"]
        problem = waiting_problem(pod)
        if problem:
            return f"(pod {name} cannot start: {problem})\n"
        if (pod.get("status") or {}).get("phase") == "Pending":
            return f"(pod {name} is pending: not scheduled or still starting)\n"
        text = self.api.pod_log(md["namespace"], name, n_lines)
        return f"(pod {name} is gone; its logs went with it)\n" if text is None else text

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        return collect_results(self, handles, timeout=timeout, interval=max(self.options.cache_seconds, 0.2),
                               failure=self._failure)

    def _failure(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        md = handle.metadata
        pod = self._pod_for(handle)
        term = terminated(pod) if pod else None
        code = term.get("exitCode") if term else None
        error = self._errors.get((md["job"], md["index"]))
        if error is None:
            tail = self.stream_logs(handle, n_lines=20).strip() if pod else ""
            job = self.api.job(md["namespace"], md["job"])
            error = failure_text(job, term, tail)
            deadline = deadline_cause(job)
            if deadline:  # Kubernetes' time limit ended it (the pod's own exit code is its SIGTERM's)
                code, error = EXIT_TIME_LIMIT, f"{deadline}\n{error}"
        return ReplicaResult.failed(handle, status, error, code)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """Delete the handle's Job (the whole cohort it launched) and its env Secret.

        Background propagation: the default orphans pods that would keep burning GPUs. Already
        gone (404) or being deleted (409) is fine; any other API error is raised.
        """
        md = handle.metadata
        ns = md["namespace"]
        if index_status(self.api.job(ns, md["job"]), md["index"]) in (ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED):
            return  # ended on its own: keep its status (the Job's TTL cleans it up)
        self.api.call("delete", "jobs.batch", ns, self.api.batch().delete_namespaced_job, md["job"], ns,
                      propagation_policy="Background", missing_ok=True, _preload_content=False)
        if md.get("secret"):
            self._delete_secret(ns, md["secret"])
        self.api.forget_job(ns, md["job"])
