"""EksExecutor: replicas as pods of Kubernetes Indexed Jobs (EKS or any cluster ≥ 1.29).

`plan` builds the documents (`diloco_eks.manifest`): per Job, its env Secret with the values
REDACTED, its headless Service for a replica of several nodes, then the Job; `submit` creates
exactly those, filling the Secret's values in from the request at that moment. The cluster is
reached through `diloco_eks.api` (the SDK loads on first API use, so `diloco backends` and
`diloco dryrun` need no cluster).

Per-rank relaunch (the supervisor's default policy): Jobs carry `backoffLimitPerIndex: 0`, so a
failed index is marked in `failedIndexes` while the other pods keep running; the supervisor sees
that rank `failed` and relaunches it as a one-pod Job `<run>-r<rank>-a<attempt>` with the rank as
a literal. With `per_index = false` (clusters < 1.29) Jobs use `backoffLimit: 0` and the
supervisor restarts the whole gang instead.

A replica of several nodes (`nodes = K`) is a Job of its own with one pod per node
(`diloco_eks.island`): its status is the Job's, one pod lost fails the Job (Kubernetes stops the
others), and the supervisor relaunches the replica as one attempt.
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
from .manifest import job_ranks, job_service, launch_documents, secret_refs
from .options import EksOptions
from .results import deadline_cause, failure_text, lost_node_text
from .status import first_failure, index_status, island_status, terminated, waiting_problem


class EksExecutor:
    """One Kubernetes Indexed Job per attempt, one pod per rank (see the README for the manifest;
    `EksOptions` for the `[backend]` options)."""

    backend_name = "eks"
    Options = EksOptions
    # pods have their own disks: the rendezvous must be an object store. relaunches_one_rank
    # follows `per_index` (set per instance).
    capabilities = Capabilities(shares_launcher_filesystem=False, relaunches_one_rank=True, process_groups=True,
                                multi_node=True, inter_replica_network=True, cloud="aws")

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
        services = {d["metadata"]["name"]: d for d in plan.body if d["kind"] == "Service"}
        if sorted(r for d in jobs.values() for r in job_ranks(d)) != sorted(request.ranks):
            raise BackendError(f"the eks plan starts other ranks than its request ({list(request.ranks)})")
        self.api.client()  # no credentials: one clear error before anything is created
        values = request.secrets.reveal()

        def start(rank: int) -> ReplicaHandle:
            job = jobs[rank]
            return self._start(request, job, [secrets[name] for name in sorted(secret_refs(job))],
                               [services[name] for name in [job_service(job)] if name], values)

        started = start_each(list(jobs), start, self.cancel, platform="Kubernetes", unit="Job(s)")
        by_rank = {}
        for first in started:
            for index, rank in enumerate(job_ranks(jobs[first.rank])):
                by_rank[rank] = ReplicaHandle(rank, self.backend_name, {**first.metadata, "index": index})
        return [by_rank[rank] for rank in request.ranks]

    def _start(self, request: LaunchRequest, job: dict[str, Any], secret_docs: list[dict[str, Any]],
               service_docs: list[dict[str, Any]], values: dict[str, str]) -> ReplicaHandle:
        """Create one Job's Secret (with the real values, only here), its Service and the Job; the
        handle of its first index. The Job then owns them: they go when it goes."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        core, batch = self.api.core(), self.api.batch()
        for doc in secret_docs:
            filled = {**doc, "stringData": {k: values[k] for k in doc["stringData"]}}
            self._delete_secret(ns, doc["metadata"]["name"])  # a leftover of an earlier try of this Job
            self.api.call("create", "secrets", ns, core.create_namespaced_secret, ns, filled, _preload_content=False)
        try:
            for doc in service_docs:
                self._delete_service(ns, doc["metadata"]["name"])  # a leftover of an earlier try of this Job
                self.api.call("create", "services", ns, core.create_namespaced_service, ns, doc,
                              _preload_content=False)
            resp = self.api.call("create", "jobs.batch", ns, batch.create_namespaced_job, ns, job,
                                 _preload_content=False)
        except BackendError:
            for delete, doc in [*((self._delete_secret, d) for d in secret_docs),
                                *((self._delete_service, d) for d in service_docs)]:
                try:  # no Job owns them yet: do not leave the values (or the names) behind
                    delete(ns, doc["metadata"]["name"])
                except BackendError:
                    pass  # the Job's error is the one to report
            raise
        uid = (json.loads(resp.data).get("metadata") or {}).get("uid")
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "blockOwnerDeletion": False}
        for resource, patch, doc in [*(("secrets", core.patch_namespaced_secret, d) for d in secret_docs),
                                     *(("services", core.patch_namespaced_service, d) for d in service_docs)]:
            if uid:  # garbage-collected with its Job
                self.api.call("patch", resource, ns, patch, doc["metadata"]["name"], ns,
                              {"metadata": {"ownerReferences": [owner]}}, missing_ok=True, _preload_content=False)
        island = {"nodes": request.nodes, "service": service_docs[0]["metadata"]["name"]} if service_docs else {}
        return ReplicaHandle.of(request, job_ranks(job)[0], self.backend_name, job=name, namespace=ns, index=0,
                                context=self.options.context,
                                secret=secret_docs[0]["metadata"]["name"] if secret_docs else None, **island)

    def _delete_secret(self, ns: str, name: str) -> None:
        self.api.call("delete", "secrets", ns, self.api.core().delete_namespaced_secret, name, ns, missing_ok=True,
                      _preload_content=False)

    def _delete_service(self, ns: str, name: str) -> None:
        self.api.call("delete", "services", ns, self.api.core().delete_namespaced_service, name, ns,
                      missing_ok=True, _preload_content=False)

    # -- observing -----------------------------------------------------------------------------

    def _pod_for(self, handle: ReplicaHandle, index: int | None = None) -> dict[str, Any] | None:
        md = handle.metadata
        return self.api.pod_for(md["namespace"], md["job"], md["index"] if index is None else index)

    def _nodes(self, handle: ReplicaHandle) -> list[dict[str, Any] | None]:
        """A replica of several nodes: the newest pod of each node, by node rank (None: none yet)."""
        return [self._pod_for(handle, node) for node in range(handle.metadata["nodes"])]

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        md = handle.metadata
        job = self.api.job(md["namespace"], md["job"])
        if md.get("nodes", 1) > 1:
            pods = self._nodes(handle)
            status = island_status(job, pods)
        else:
            pods = [self._pod_for(handle)]
            status = index_status(job, md["index"])
        if status in (ReplicaStatus.RUNNING, ReplicaStatus.PENDING):
            for pod in filter(None, pods):
                problem = waiting_problem(pod)
                if problem:
                    self._errors[(md["job"], md["index"])] = f"pod {pod['metadata']['name']} cannot start: {problem}"
                    return ReplicaStatus.FAILED
            if any(pod is None or (pod.get("status") or {}).get("phase") == "Pending" for pod in pods):
                return ReplicaStatus.PENDING
        return status

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The rank's pod's log tail; a replica of several nodes: each node's, node 0 last (its
        process 0 prints the replica's result as the log's last line, where `collect` reads it)."""
        md = handle.metadata
        nodes = md.get("nodes", 1)
        if nodes <= 1:
            return self._pod_text(handle, self._pod_for(handle), n_lines, f"rank {handle.rank}")
        order = [*range(1, nodes), 0]
        return "".join(f"==> node {node} of {nodes} <==\n" + self._pod_text(
            handle, self._pod_for(handle, node), n_lines, f"node {node} of rank {handle.rank}") for node in order)

    def _pod_text(self, handle: ReplicaHandle, pod: dict[str, Any] | None, n_lines: int, what: str) -> str:
        if pod is None:
            return f"(no pod yet for {what} of job {handle.metadata['job']})\n"
        name = pod["metadata"]["name"]
        problem = waiting_problem(pod)
        if problem:
            return f"(pod {name} cannot start: {problem})\n"
        if (pod.get("status") or {}).get("phase") == "Pending":
            return f"(pod {name} is pending: not scheduled or still starting)\n"
        text = self.api.pod_log(handle.metadata["namespace"], name, n_lines)
        return f"(pod {name} is gone; its logs went with it)\n" if text is None else text

    def collect(self, handles: Sequence[ReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        return collect_results(self, handles, timeout=timeout, interval=max(self.options.cache_seconds, 0.2),
                               failure=self._failure)

    def _failure(self, handle: ReplicaHandle, status: ReplicaStatus) -> ReplicaResult:
        """Why the rank failed, in Kubernetes' words: its pod's exit and log tail (a replica of
        several nodes: the node that failed first), the Job's Failed conditions, a time limit."""
        md = handle.metadata
        nodes = md.get("nodes", 1)
        pod, where = self._pod_for(handle), ""
        if nodes > 1:
            first = first_failure(self._nodes(handle))
            pod = first[1] if first else None
            where = f"\n(node {first[0]} of {nodes}, pod {pod['metadata']['name']})" if first else ""
        term = terminated(pod) if pod else None
        code = term.get("exitCode") if term else None
        error = self._errors.get((md["job"], md["index"]))
        if error is None:
            tail = self._pod_text(handle, pod, 20, "").strip() if pod else ""
            job = self.api.job(md["namespace"], md["job"])
            error = failure_text(job, term, tail) + where if pod or nodes <= 1 else lost_node_text(job, nodes)
            deadline = deadline_cause(job)
            if deadline:  # Kubernetes' time limit ended it (the pod's own exit code is its SIGTERM's)
                code, error = EXIT_TIME_LIMIT, f"{deadline}\n{error}"
        return ReplicaResult.failed(handle, status, error, code)

    # -- stopping ------------------------------------------------------------------------------

    def cancel(self, handle: ReplicaHandle) -> None:
        """Delete the handle's Job (the whole cohort it launched, or all nodes of its replica),
        its env Secret and its Service.

        Background propagation: the default orphans pods that would keep burning GPUs. Already
        gone (404) or being deleted (409) is fine; any other API error is raised.
        """
        md = handle.metadata
        ns = md["namespace"]
        job = self.api.job(ns, md["job"])
        status = island_status(job, []) if md.get("nodes", 1) > 1 else index_status(job, md["index"])
        if status in (ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED):
            return  # ended on its own: keep its status (the Job's TTL cleans it up)
        self.api.call("delete", "jobs.batch", ns, self.api.batch().delete_namespaced_job, md["job"], ns,
                      propagation_policy="Background", missing_ok=True, _preload_content=False)
        if md.get("secret"):
            self._delete_secret(ns, md["secret"])
        if md.get("service"):
            self._delete_service(ns, md["service"])
        self.api.forget_job(ns, md["job"])
