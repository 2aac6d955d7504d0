"""The simulated Job controller (Kubernetes 1.29), for Indexed Jobs, working through the API.

Per Job, from its pods (those it owns, by uid) and their reported phases:

- creates a pod for each index that has neither succeeded nor failed for good, at most
  `parallelism` at a time, named by `generateName` `<job>-<index>-` (shortened as the real
  controller does) with the completion index as annotation, label and `JOB_COMPLETION_INDEX`,
  and `<job>-<index>` as its hostname (with a headless Service as its `subdomain`, a stable DNS
  name: `dns`);
- counts a pod deleted before it ended (`kubectl delete pod`, a lost node) as failed, as the
  1.29 controller does through its job-tracking finalizer (the stand-in's pods carry none: the
  controller remembers each pod it has seen instead);
- `backoffLimitPerIndex`: an index whose pods failed more times than that is failed (listed in
  `failedIndexes`), the others go on; when every index is done the Job is Complete, or Failed
  with reason FailedIndexes;
- `backoffLimit` (default 6): more failed pods than that fail the Job (BackoffLimitExceeded);
- `activeDeadlineSeconds`: a Job active longer fails (DeadlineExceeded);
- a failed Job's active pods are deleted; a finished Job is deleted (background) once
  `ttlSecondsAfterFinished` has passed.

What a 1.29 controller would do differently is refused at admission (`unsupported_job`):
NonIndexed Jobs, `suspend`, `manualSelector`, `maxFailedIndexes`, podFailurePolicy rules on exit
codes. Rules on pod conditions are accepted and never match: no simulated pod is disrupted.
"""

from __future__ import annotations

import calendar
import copy
import json
import time
from typing import Any

from ..status import format_indexes

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
MAX_GENERATED_NAME_PREFIX = 58  # 63 minus the 5 random characters the API server appends


def unsupported_job(job: dict[str, Any]) -> str | None:
    spec = job["spec"]
    if spec.get("completionMode") != "Indexed":
        return "the simulated Job controller runs Indexed Jobs only (completionMode: Indexed)"
    for key in ("suspend", "manualSelector", "maxFailedIndexes"):
        if spec.get(key):
            return f"the simulated Job controller does not implement spec.{key}"
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        if rule.get("onExitCodes") is not None:
            return "the simulated Job controller does not implement podFailurePolicy rules on exit codes"
    return None


class JobController:
    def __init__(self, core: Any, batch: Any):
        self.core, self.batch = core, batch
        self._reported: dict[str, dict[str, Any]] = {}  # by Job uid: the status last written
        self._seen: dict[str, dict[str, tuple[int, str]]] = {}  # by Job uid: pod uid -> (index, last phase)

    def sync(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec = job["metadata"], job["spec"]
        status = job.get("status") or {}
        if _finished(status):
            self._expire(job, status)
            return
        mine = [p for p in pods if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences") or [])]
        phases: dict[int, list[str]] = {}
        for index, phase in self._track(meta["uid"], mine):
            phases.setdefault(index, []).append(phase)
        completions, per_index = spec["completions"], spec.get("backoffLimitPerIndex")
        succeeded = {i for i, p in phases.items() if "Succeeded" in p}
        failures = {i: p.count("Failed") for i, p in phases.items()}
        failed = {i for i in range(completions) if per_index is not None and i not in succeeded
                  and failures.get(i, 0) > per_index}
        active = [p for p in mine if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        now = time.time()
        started = status.get("startTime") or _time(now)
        conditions, completion_time = [], None
        deadline = spec.get("activeDeadlineSeconds")
        if sum(failures.values()) > spec["backoffLimit"]:
            conditions.append(_condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"))
        elif deadline is not None and now - _epoch(started) > deadline:
            conditions.append(_condition("Failed", "DeadlineExceeded", "Job was active longer than specified deadline"))
        elif len(succeeded) + len(failed) == completions:
            if failed:
                conditions.append(_condition("Failed", "FailedIndexes", "Job has failed indexes"))
            else:
                conditions.append(_condition("Complete", None, None))
                completion_time = _time(now)
        if conditions and conditions[0]["type"] == "Failed":
            for pod in active:
                self._delete_pod(pod)
            active = []
        elif not conditions:
            running = {int(p["metadata"]["annotations"][COMPLETION_INDEX]) for p in active}
            for index in range(completions):
                if len(active) >= spec["parallelism"]:
                    break
                if index not in succeeded | failed | running:
                    active.append(self._create_pod(job, index))
        new = {"startTime": started, "active": len(active),
               "succeeded": sum(p.count("Succeeded") for p in phases.values()), "failed": sum(failures.values()),
               "completedIndexes": format_indexes(succeeded) or None,
               "failedIndexes": (format_indexes(failed) or None) if per_index is not None else None,
               "conditions": conditions or None, "completionTime": completion_time}
        if new != self._reported.get(meta["uid"]):
            self._reported[meta["uid"]] = new
            self._patch_status(job, new)

    def _track(self, uid: str, pods: list[dict[str, Any]]) -> list[tuple[int, str]]:
        """(index, phase) of every pod the Job has had: those listed now, those that ended and
        went, and those deleted before they ended, as Failed."""
        seen = self._seen.setdefault(uid, {})
        listed = {p["metadata"]["uid"]: (int(p["metadata"]["annotations"][COMPLETION_INDEX]),
                                         (p.get("status") or {}).get("phase") or "Pending") for p in pods}
        for pod_uid, (index, phase) in seen.items():
            if pod_uid not in listed and phase not in ("Succeeded", "Failed"):
                seen[pod_uid] = (index, "Failed")
        seen.update(listed)
        return list(seen.values())

    def _create_pod(self, job: dict[str, Any], index: int) -> dict[str, Any]:
        meta, template = job["metadata"], job["spec"]["template"]
        spec = copy.deepcopy(template["spec"])
        spec["hostname"] = f"{meta['name']}-{index}"  # what the 1.29 controller sets for an Indexed Job's pod
        for container in spec["containers"]:
            container.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}})
        pod_meta = copy.deepcopy(template.get("metadata") or {})
        pod_meta.update(generateName=_generate_name(meta["name"], index), namespace=meta["namespace"])
        pod_meta.setdefault("labels", {})[COMPLETION_INDEX] = str(index)
        pod_meta.setdefault("annotations", {})[COMPLETION_INDEX] = str(index)
        pod_meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                        "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]
        manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": spec}
        return json_of(self.core.create_namespaced_pod(meta["namespace"], manifest, _preload_content=False))

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                            _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _patch_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.batch.patch_namespaced_job_status(job["metadata"]["name"], job["metadata"]["namespace"],
                                                   {"status": status}, _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:  # deleted since it was listed: its pods are garbage now
                raise

    def _expire(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        """The TTL-after-finished controller: delete the Job (and, in the background, its pods)."""
        ttl = job["spec"].get("ttlSecondsAfterFinished")
        finished = next(c.get("lastTransitionTime") for c in status["conditions"] if c["type"] in ("Complete", "Failed"))
        if ttl is not None and time.time() - _epoch(finished) >= ttl:
            from kubernetes.client.exceptions import ApiException

            try:
                self.batch.delete_namespaced_job(job["metadata"]["name"], job["metadata"]["namespace"],
                                                 propagation_policy="Background", _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:
                    raise


def _generate_name(job: str, index: int) -> str:
    """podGenerateNameWithIndex: `<job>-<index>-`, the job name cut so the prefix stays ≤ 58."""
    suffix = f"-{index}-"
    prefix = job + suffix
    return prefix if len(prefix) <= MAX_GENERATED_NAME_PREFIX else job[:MAX_GENERATED_NAME_PREFIX - len(suffix)] + suffix


def _finished(status: dict[str, Any]) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in status.get("conditions") or [])


def _condition(kind: str, reason: str | None, message: str | None) -> dict[str, Any]:
    now = _time(time.time())
    out = {"type": kind, "status": "True", "lastProbeTime": now, "lastTransitionTime": now}
    return {**out, **({"reason": reason, "message": message} if reason else {})}


def _time(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _epoch(text: str) -> float:
    return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))


def json_of(resp: Any) -> Any:
    return json.loads(resp.data)
