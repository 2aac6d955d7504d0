"""Reading a Job's status for one index, or for a replica of several nodes (its whole Job): pure
functions over the Job and pod dicts."""

from __future__ import annotations

from typing import Any

from diloco.protocol import ReplicaStatus

IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}


def parse_indexes(text: str | None) -> set[int]:
    """Kubernetes' run-length index lists: "1,3-5,7" → {1, 3, 4, 5, 7}."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(part))
    return out


def format_indexes(indexes: set[int]) -> str:
    """The inverse of `parse_indexes` (used by the test-side Job controller)."""
    runs, out = sorted(indexes), []
    i = 0
    while i < len(runs):
        j = i
        while j + 1 < len(runs) and runs[j + 1] == runs[j] + 1:
            j += 1
        out.append(str(runs[i]) if i == j else f"{runs[i]}-{runs[j]}")
        i = j + 1
    return ",".join(out)


def has_condition(job: dict[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or [])


def index_status(job: dict[str, Any] | None, index: int) -> ReplicaStatus:
    """One index of an Indexed Job: completed → succeeded, failed → failed, a Failed Job →
    failed, active pods → running, else pending; no Job (404) → cancelled."""
    if job is None:
        return ReplicaStatus.CANCELLED
    status = job.get("status") or {}
    if index in parse_indexes(status.get("completedIndexes")):
        return ReplicaStatus.SUCCEEDED
    if index in parse_indexes(status.get("failedIndexes")):
        return ReplicaStatus.FAILED
    if has_condition(job, "Failed"):
        return ReplicaStatus.FAILED
    if has_condition(job, "Complete"):
        return ReplicaStatus.SUCCEEDED
    if (status.get("active") or 0) > 0:
        return ReplicaStatus.RUNNING
    return ReplicaStatus.PENDING


def island_status(job: dict[str, Any] | None, pods: list[dict[str, Any] | None]) -> ReplicaStatus:
    """A replica of several nodes is its whole Job (one pod per node, `pods` by node rank, None
    where a node has none yet): Complete → succeeded, Failed (one pod failed or was lost: the
    Job stops the others) → failed, every node's pod started → running, else pending; no Job → cancelled."""
    if job is None:
        return ReplicaStatus.CANCELLED
    if has_condition(job, "Failed"):
        return ReplicaStatus.FAILED
    if has_condition(job, "Complete"):
        return ReplicaStatus.SUCCEEDED
    if pods and all(p and (p.get("status") or {}).get("phase") in ("Running", "Succeeded") for p in pods):
        return ReplicaStatus.RUNNING
    return ReplicaStatus.PENDING


def first_failure(pods: list[dict[str, Any] | None]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """The node whose container failed first (node rank, pod, its terminated state), if any did:
    the others failed after it, or were stopped because of it."""
    failed = [(term.get("finishedAt") or "", node, pod, term) for node, pod in enumerate(pods)
              if pod and (term := terminated(pod)) and term.get("exitCode") not in (None, 0)]
    return min(failed, key=lambda f: (f[0], f[1]))[1:] if failed else None


def pod_index(pod: dict[str, Any], job: str) -> int | None:
    """A pod's completion index: the annotation, else the label, else the name "<job>-<i>-xxxxx"."""
    meta = pod.get("metadata") or {}
    for source in (meta.get("annotations") or {}, meta.get("labels") or {}):
        value = source.get("batch.kubernetes.io/job-completion-index")
        if value is not None and str(value).isdigit():
            return int(value)
    name = meta.get("name") or ""
    prefix = f"{job}-"
    if name.startswith(prefix):
        head = name[len(prefix):].split("-", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def waiting_problem(pod: dict[str, Any]) -> str | None:
    """Why a pod cannot start, if it never will on its own (an image that cannot be pulled)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_REASONS:
            return f"{waiting['reason']}: {waiting.get('message') or cs.get('image') or 'image cannot be pulled'}"
    return None


def terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return term
    return None
