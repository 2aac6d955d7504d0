"""The API server's rules (Kubernetes 1.29) for a pod spec, a Pod's or a Job template's:
containers, env vars and their sources, volumes and mounts, resources, tolerations, names of
referenced objects. Worded as its `field.Error`s, at the path the spec sits at."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .model import FieldError
from .names import (CONFIG_KEY, ENV_NAME, MSG_CONFIG_KEY, MSG_ENV_NAME, dns_label, dns_subdomain, labels,
                    qualified_name)
from .quantities import parse_quantity

ENV_FIELD_PATHS = ("metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName", "spec.serviceAccountName",
                   "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs")
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def pod_spec(spec: Mapping[str, Any], path: str) -> list[FieldError]:
    """ValidatePodSpec, for what a pod of these kinds can carry."""
    errs: list[FieldError] = []
    volumes: set[str] = set()
    for i, volume in enumerate(spec.get("volumes") or []):
        here = f"{path}.volumes[{i}]"
        errs += dns_label(volume.get("name") or "", f"{here}.name")
        if volume.get("name") in volumes:
            errs.append(FieldError.duplicate(f"{here}.name", volume["name"]))
        volumes.add(volume.get("name"))
        sources = [k for k, v in volume.items() if k != "name" and v is not None]
        if not sources:
            errs.append(FieldError.required(here, "must specify a volume type"))
        elif len(sources) > 1:
            errs.append(FieldError.forbidden(f"{here}.{sources[1]}", "may not specify more than 1 volume type"))
        medium = (volume.get("emptyDir") or {}).get("medium") or ""
        if medium not in ("", "Memory") and not medium.startswith("HugePages"):
            errs.append(FieldError.unsupported(f"{here}.emptyDir.medium", medium, ["", "Memory", "HugePages"]))
    if not spec.get("containers"):
        errs.append(FieldError.required(f"{path}.containers"))
    names: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(group) or []):
            here = f"{path}.{group}[{i}]"
            name = container.get("name") or ""
            errs += dns_label(name, f"{here}.name")
            if name in names:
                errs.append(FieldError.duplicate(f"{here}.name", name))
            names.add(name)
            errs += _container(container, here, volumes)
    for key, allowed in (("restartPolicy", ["Always", "OnFailure", "Never"]),
                         ("dnsPolicy", ["ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"])):
        if spec.get(key) is not None and spec[key] not in allowed:
            errs.append(FieldError.unsupported(f"{path}.{key}", spec[key], allowed))
    for key in ("serviceAccountName", "runtimeClassName", "priorityClassName"):
        if spec.get(key):
            errs += dns_subdomain(spec[key], f"{path}.{key}")
    for key in ("hostname", "subdomain"):
        if spec.get(key):
            errs += dns_label(spec[key], f"{path}.{key}")
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        errs.append(FieldError.invalid(f"{path}.activeDeadlineSeconds", spec["activeDeadlineSeconds"],
                                       "must be between 1 and 2147483647, inclusive"))
    errs += labels(spec.get("nodeSelector"), f"{path}.nodeSelector")
    for i, toleration in enumerate(spec.get("tolerations") or []):
        errs += _toleration(toleration, f"{path}.tolerations[{i}]")
    return errs


def _container(container: Mapping[str, Any], path: str, volumes: set[str]) -> list[FieldError]:
    errs: list[FieldError] = []
    if not container.get("image"):
        errs.append(FieldError.required(f"{path}.image"))
    for key, allowed in (("imagePullPolicy", ["Always", "IfNotPresent", "Never"]),
                         ("terminationMessagePolicy", ["File", "FallbackToLogsOnError"])):
        if container.get(key) is not None and container[key] not in allowed:
            errs.append(FieldError.unsupported(f"{path}.{key}", container[key], allowed))
    for i, var in enumerate(container.get("env") or []):
        errs += _env_var(var, f"{path}.env[{i}]")
    mounts: set[str] = set()
    for i, mount in enumerate(container.get("volumeMounts") or []):
        here = f"{path}.volumeMounts[{i}]"
        if mount.get("name") not in volumes:
            errs.append(FieldError.not_found(f"{here}.name", mount.get("name")))
        if not mount.get("mountPath"):
            errs.append(FieldError.required(f"{here}.mountPath"))
        elif mount["mountPath"] in mounts:
            errs.append(FieldError.invalid(f"{here}.mountPath", mount["mountPath"], "must be unique"))
        mounts.add(mount.get("mountPath"))
    errs += _resources(container.get("resources") or {}, f"{path}.resources")
    return errs


def _env_var(var: Mapping[str, Any], path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    name = var.get("name") or ""
    if name and not ENV_NAME.match(name):
        errs.append(FieldError.invalid(f"{path}.name", name, MSG_ENV_NAME))
    source = var.get("valueFrom")
    if source is None:
        return errs
    if var.get("value"):
        errs.append(FieldError.invalid(f"{path}.valueFrom", "", "may not be specified when `value` is not empty"))
    given = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef") if source.get(k)]
    if not given:
        errs.append(FieldError.invalid(f"{path}.valueFrom", "", "must specify one of: `fieldRef`, "
                                       "`resourceFieldRef`, `configMapKeyRef` or `secretKeyRef`"))
    elif len(given) > 1:
        errs.append(FieldError.invalid(f"{path}.valueFrom", "", "may not have more than one field specified at a time"))
    if source.get("fieldRef"):
        errs += _field_path(source["fieldRef"].get("fieldPath") or "", f"{path}.valueFrom.fieldRef.fieldPath")
    for kind in ("secretKeyRef", "configMapKeyRef"):
        ref = source.get(kind)
        if ref:
            if not ref.get("name"):
                errs.append(FieldError.required(f"{path}.valueFrom.{kind}.name"))
            else:
                errs += dns_subdomain(ref["name"], f"{path}.valueFrom.{kind}.name")
            if ref.get("key") and not CONFIG_KEY.match(ref["key"]):
                errs.append(FieldError.invalid(f"{path}.valueFrom.{kind}.key", ref["key"], MSG_CONFIG_KEY))
    return errs


def _field_path(text: str, path: str) -> list[FieldError]:
    """The downward-API paths an env var may read: a fixed list, or one label or annotation by key."""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", text)
    if m:
        key = m[2].lower() if m[1] == "annotations" else m[2]
        return [FieldError.invalid(path, m[2], e.detail) for e in qualified_name(key, path)]
    if text in ENV_FIELD_PATHS:
        return []
    return [FieldError.unsupported(path, text, [*ENV_FIELD_PATHS[:3], "metadata.labels['<KEY>']",
                                                "metadata.annotations['<KEY>']", *ENV_FIELD_PATHS[3:]])]


def _resources(resources: Mapping[str, Any], path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    for group, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            here = f"{path}.{group}[{name}]"
            standard = name in STANDARD_RESOURCES or name.startswith("hugepages-")
            if not standard and ("/" not in name or qualified_name(name, here)):
                errs.append(FieldError.invalid(here, name, "must be a standard resource type or fully qualified"))
                continue
            amount = parse_quantity(value)
            if amount < 0:
                errs.append(FieldError.invalid(here, str(value), "must be greater than or equal to 0"))
            if not standard and amount != int(amount):
                errs.append(FieldError.invalid(here, str(value), "must be an integer"))
    for name, value in requests.items():
        extended = name not in STANDARD_RESOURCES and not name.startswith("hugepages-")
        if name in limits:
            if extended and parse_quantity(value) != parse_quantity(limits[name]):
                errs.append(FieldError.invalid(f"{path}.requests", str(value),
                                               f"must be equal to {name} limit of {limits[name]}"))
            elif parse_quantity(value) > parse_quantity(limits[name]):
                errs.append(FieldError.invalid(f"{path}.requests", str(value),
                                               f"must be less than or equal to {name} limit of {limits[name]}"))
        elif extended:
            errs.append(FieldError.required(f"{path}.limits", "Limit must be set for non overcommitable resources"))
    return errs


def _toleration(tol: Mapping[str, Any], path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    key, operator, value = tol.get("key") or "", tol.get("operator") or "Equal", tol.get("value") or ""
    if key:
        errs += qualified_name(key, f"{path}.key")
    elif operator != "Exists":
        errs.append(FieldError.invalid(f"{path}.operator", operator, 'operator must be Exists when `key` is empty, '
                                       'which means "match all values and all keys"'))
    if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
        errs.append(FieldError.invalid(f"{path}.effect", tol.get("effect") or "",
                                       "effect must be 'NoExecute' when `tolerationSeconds` is set"))
    if operator == "Equal":
        errs += labels({"k": value}, f"{path}.value") if value else []
    elif operator == "Exists":
        if value:
            errs.append(FieldError.invalid(f"{path}.operator", tol, "value must be empty when `operator` is 'Exists'"))
    else:
        errs.append(FieldError.unsupported(f"{path}.operator", operator, ["Equal", "Exists"]))
    effect = tol.get("effect") or ""
    if effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        errs.append(FieldError.unsupported(f"{path}.effect", effect, ["NoSchedule", "PreferNoSchedule", "NoExecute"]))
    return errs
