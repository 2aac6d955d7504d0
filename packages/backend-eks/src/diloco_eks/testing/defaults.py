"""What the API server (1.29) fills in on create, before validating: server-owned metadata and
the defaults of each kind. Validation runs on the defaulted object, so these decide some
outcomes: a Job's `job-name` template label (which caps Job names at 63 characters), a pod
template's `restartPolicy: Always` (which a Job refuses), a Secret's `stringData` folded into
`data` (which the 1 MiB limit counts)."""

from __future__ import annotations

import base64
import copy
import re
from typing import Any

from . import services

MAX_INT32 = 2**31 - 1
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


def server_metadata(obj: dict[str, Any], *, uid: str, now: str, resource_version: str) -> None:
    """Fields only the server sets: a client's values for them are replaced."""
    meta = obj.setdefault("metadata", {})
    meta.update(uid=uid, creationTimestamp=now, resourceVersion=resource_version)
    if obj.get("kind") == "Job":
        meta["generation"] = 1


def job(obj: dict[str, Any]) -> None:
    """SetDefaults_Job, then the selector and template labels the Job strategy generates."""
    spec = obj.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = spec["parallelism"] = 1
    spec.setdefault("parallelism", 1)
    if spec.get("backoffLimit") is None:
        spec["backoffLimit"] = MAX_INT32 if spec.get("backoffLimitPerIndex") is not None else 6
    template = spec.setdefault("template", {})
    template_labels = (template.get("metadata") or {}).get("labels")
    meta = obj["metadata"]
    if template_labels and not meta.get("labels"):
        meta["labels"] = dict(template_labels)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    if spec.get("podFailurePolicy") is not None:
        for rule in spec["podFailurePolicy"].get("rules") or []:
            for pattern in rule.get("onPodConditions") or []:
                pattern.setdefault("status", "True")
    spec.setdefault("podReplacementPolicy", "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
    if not spec.get("manualSelector") and spec.get("selector") is None:
        spec["selector"] = {"matchLabels": {JOB_UID_LABEL: meta["uid"]}}
        generated = {JOB_UID_LABEL: meta["uid"], JOB_NAME_LABEL: meta.get("name") or "",
                     "controller-uid": meta["uid"], "job-name": meta.get("name") or ""}
        template.setdefault("metadata", {}).setdefault("labels", {}).update(generated)
    pod_spec(template.setdefault("spec", {}))


def pod(obj: dict[str, Any]) -> None:
    """SetDefaults_Pod: the spec's defaults, requests from limits; a new pod is Pending."""
    spec = obj.setdefault("spec", {})
    pod_spec(spec)
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        if resources.get("limits"):
            requests = resources.setdefault("requests", {})
            for name, amount in resources["limits"].items():
                requests.setdefault(name, amount)
    obj["status"] = {"phase": "Pending"}


def pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        if container.get("imagePullPolicy") is None:
            image = container.get("image") or ""
            tagged = re.search(r":[^/]+$", image.split("@")[0]) and not image.split("@")[0].endswith(":latest")
            container["imagePullPolicy"] = "IfNotPresent" if tagged or "@" in image else "Always"
        for var in container.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("fieldRef")
            if ref is not None:
                ref.setdefault("apiVersion", "v1")


def secret(obj: dict[str, Any]) -> None:
    """A Secret's type defaults to Opaque; `stringData` is write-only: folded into `data` (it wins)."""
    obj.setdefault("type", "Opaque")
    if obj.get("stringData"):
        data = obj.setdefault("data", {}) or {}
        for key, value in obj["stringData"].items():
            data[key] = base64.b64encode((value or "").encode()).decode()
        obj["data"] = data
    obj.pop("stringData", None)


def for_kind(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    {"Job": job, "Pod": pod, "Secret": secret, "Service": services.defaults}[kind](out)
    return out
