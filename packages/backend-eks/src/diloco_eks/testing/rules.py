"""The API server's validation rules (Kubernetes 1.29) for the kinds the stand-in serves.

`model` checks a body's shape; these are the documented rules on values that a real API server
enforces after defaulting, worded as its `field.Error`s (`spec.completions: Required value: when
completion mode is Indexed`): object names, labels, annotations, owner references; Job specs
(Indexed rules, backoffLimitPerIndex, podFailurePolicy, restartPolicy); pod specs (`podspec`);
Secret keys and size. Names, labels and annotations are `names`. Each rule is the one in
k8s.io/kubernetes pkg/apis/{core,batch}/validation for that version, reduced to what these
kinds can carry. Quantities and base64 are checked while decoding (`quantities`, `model`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from .model import FieldError
from .names import CONFIG_KEY, MSG_CONFIG_KEY, annotations, dns_label, dns_subdomain, labels, qualified_name
from .podspec import pod_spec

SECRET_MAX_BYTES = 1024 * 1024
INDEXED_JOB_MAX = 100_000  # completions and parallelism of an Indexed Job (and maxFailedIndexes)
POD_FAILURE_POLICY_MAX_RULES = 20


def object_meta(meta: Mapping[str, Any], *, name_rule=dns_subdomain) -> list[FieldError]:
    """What every namespaced object's metadata must satisfy (ValidateObjectMeta)."""
    errs: list[FieldError] = []
    if not meta.get("name"):
        errs.append(FieldError.required("metadata.name", "name or generateName is required"))
    else:
        errs += name_rule(meta["name"], "metadata.name")
    if not meta.get("namespace"):
        errs.append(FieldError.required("metadata.namespace"))
    else:
        errs += dns_label(meta["namespace"], "metadata.namespace")
    errs += labels(meta.get("labels"), "metadata.labels")
    errs += annotations(meta.get("annotations"), "metadata.annotations")
    errs += owner_references(meta.get("ownerReferences") or [])
    return errs


def owner_references(refs: list[Mapping[str, Any]]) -> list[FieldError]:
    errs: list[FieldError] = []
    path = "metadata.ownerReferences"
    for ref in refs:
        for key, what in (("apiVersion", "version"), ("kind", "kind"), ("name", "name"), ("uid", "uid")):
            if not ref.get(key):
                errs.append(FieldError.invalid(f"{path}.{key}", ref.get(key) or "", f"{what} must not be empty"))
    controllers = [r for r in refs if r.get("controller")]
    if len(controllers) > 1:
        errs.append(FieldError.invalid(path, refs, "Only one reference can have Controller set to true"))
    return errs


# -- Jobs ----------------------------------------------------------------------------------------


def job(obj: Mapping[str, Any]) -> list[FieldError]:
    """ValidateJob after defaulting: the metadata, the spec rules, then the pod template."""
    spec = obj.get("spec") or {}
    errs = object_meta(obj.get("metadata") or {})
    for key in ("parallelism", "completions", "activeDeadlineSeconds", "backoffLimit", "ttlSecondsAfterFinished",
                "backoffLimitPerIndex", "maxFailedIndexes"):
        if (spec.get(key) or 0) < 0:
            errs.append(FieldError.invalid(f"spec.{key}", spec[key], "must be greater than or equal to 0"))
    mode = spec.get("completionMode") or "NonIndexed"
    if mode not in ("NonIndexed", "Indexed"):
        errs.append(FieldError.unsupported("spec.completionMode", mode, ["NonIndexed", "Indexed"]))
    if mode == "Indexed":
        if spec.get("completions") is None:
            errs.append(FieldError.required("spec.completions", "when completion mode is Indexed"))
        for key in ("completions", "parallelism"):
            if (spec.get(key) or 0) > INDEXED_JOB_MAX:
                errs.append(FieldError.invalid(f"spec.{key}", spec[key],
                                               f"must be less than or equal to {INDEXED_JOB_MAX}"))
    if spec.get("backoffLimitPerIndex") is not None and mode != "Indexed":
        errs.append(FieldError.forbidden("spec.backoffLimitPerIndex", "requires indexed completion mode"))
    if spec.get("maxFailedIndexes") is not None:
        if spec.get("backoffLimitPerIndex") is None:
            errs.append(FieldError.required("spec.backoffLimitPerIndex", "when maxFailedIndexes is specified"))
        if spec["maxFailedIndexes"] > min(spec.get("completions") or 0, INDEXED_JOB_MAX):
            errs.append(FieldError.invalid("spec.maxFailedIndexes", spec["maxFailedIndexes"],
                                           "must be less than or equal to completions"))
    template = spec.get("template") or {}
    restart = (template.get("spec") or {}).get("restartPolicy")
    if restart not in ("OnFailure", "Never"):
        errs.append(FieldError.unsupported("spec.template.spec.restartPolicy", restart, ["OnFailure", "Never"]))
    if spec.get("podFailurePolicy") is not None:
        if restart != "Never":
            errs.append(FieldError.invalid("spec.template.spec.restartPolicy", restart,
                                           'only "Never" is supported when podFailurePolicy is specified'))
        errs += pod_failure_policy(spec)
    selector = spec.get("selector") or {}
    uid = (obj.get("metadata") or {}).get("uid")
    if not spec.get("manualSelector") and selector != {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}:
        errs.append(FieldError.invalid("spec.selector", selector, "`selector` not auto-generated"))
    errs += labels((template.get("metadata") or {}).get("labels"), "spec.template.labels")
    errs += annotations((template.get("metadata") or {}).get("annotations"), "spec.template.annotations")
    errs += pod_spec(template.get("spec") or {}, "spec.template.spec")
    return errs


def pod_failure_policy(spec: Mapping[str, Any]) -> list[FieldError]:
    errs: list[FieldError] = []
    path = "spec.podFailurePolicy.rules"
    rules = spec["podFailurePolicy"].get("rules") or []
    if len(rules) > POD_FAILURE_POLICY_MAX_RULES:
        errs.append(FieldError("spec.podFailurePolicy.rules", "Too many", len(rules),
                               f"must have at most {POD_FAILURE_POLICY_MAX_RULES} items", True))
    containers = {c.get("name") for c in spec["template"]["spec"].get("containers") or []}
    for i, rule in enumerate(rules):
        here = f"{path}[{i}]"
        action = rule.get("action")
        if action not in ("FailJob", "FailIndex", "Ignore", "Count"):
            errs.append(FieldError.unsupported(f"{here}.action", action, ["Count", "FailIndex", "FailJob", "Ignore"]))
        if action == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
            errs.append(FieldError.invalid(f"{here}.action", action, "requires the backoffLimitPerIndex to be set"))
        codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
        if codes is not None and conditions is not None:
            errs.append(FieldError.invalid(here, "", "specifying both OnExitCodes and OnPodConditions is not supported"))
        elif codes is None and conditions is None:
            errs.append(FieldError.invalid(here, "", "specifying one of OnExitCodes and OnPodConditions is required"))
        for j, pattern in enumerate(conditions or []):
            errs += qualified_name(pattern.get("type") or "", f"{here}.onPodConditions[{j}].type")
            status = pattern.get("status") or "True"
            if status not in ("True", "False", "Unknown"):
                errs.append(FieldError.unsupported(f"{here}.onPodConditions[{j}].status", status,
                                                   ["False", "True", "Unknown"]))
        if codes is not None:
            errs += _exit_codes(codes, f"{here}.onExitCodes", containers)
    return errs


def _exit_codes(req: Mapping[str, Any], path: str, containers: set[Any]) -> list[FieldError]:
    errs: list[FieldError] = []
    if req.get("operator") not in ("In", "NotIn"):
        errs.append(FieldError.unsupported(f"{path}.operator", req.get("operator"), ["In", "NotIn"]))
    values = req.get("values") or []
    if not values:
        errs.append(FieldError.required(f"{path}.values", "at least one value is required"))
    if len(values) > 255:
        errs.append(FieldError(f"{path}.values", "Too many", len(values), "must have at most 255 items", True))
    if values != sorted(set(values)):
        errs.append(FieldError.invalid(f"{path}.values", values, "must be ordered and unique"))
    if req.get("operator") == "In" and 0 in values:
        errs.append(FieldError.invalid(f"{path}.values", 0, "must not be 0 for the In operator"))
    if req.get("containerName") is not None and req["containerName"] not in containers:
        errs.append(FieldError.invalid(f"{path}.containerName", req["containerName"],
                                       "must be one of the container or initContainer names in the pod template"))
    return errs


# -- pods ----------------------------------------------------------------------------------------


def pod(obj: Mapping[str, Any]) -> list[FieldError]:
    return object_meta(obj.get("metadata") or {}) + pod_spec(obj.get("spec") or {}, "spec")


# -- Secrets -------------------------------------------------------------------------------------


def secret(obj: Mapping[str, Any]) -> list[FieldError]:
    """ValidateSecret (after `stringData` is folded into `data`): keys are config keys, the
    decoded values total at most 1 MiB."""
    errs = object_meta(obj.get("metadata") or {})
    for key in obj.get("data") or {}:
        if len(key) > 253:
            errs.append(FieldError.invalid(f"data[{key}]", key, "must be no more than 253 characters"))
        elif not CONFIG_KEY.match(key):
            errs.append(FieldError.invalid(f"data[{key}]", key, MSG_CONFIG_KEY))
    if sum(len(base64.b64decode(v or "")) for v in (obj.get("data") or {}).values()) > SECRET_MAX_BYTES:
        errs.append(FieldError.too_long("data", SECRET_MAX_BYTES))
    return errs


def secret_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[FieldError]:
    errs: list[FieldError] = []
    if (old.get("type") or "Opaque") != (new.get("type") or "Opaque"):
        errs.append(FieldError.invalid("type", new.get("type"), "field is immutable"))
    if old.get("immutable"):
        if old.get("data") != new.get("data"):
            errs.append(FieldError.forbidden("data", "field is immutable when `immutable` is set"))
        if not new.get("immutable"):
            errs.append(FieldError.forbidden("immutable", "field is immutable when `immutable` is set"))
    return errs
