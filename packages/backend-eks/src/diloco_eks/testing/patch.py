"""PATCH bodies applied as the API server applies them: JSON merge patch and strategic merge patch.

The kubernetes client sends a dict body as `application/strategic-merge-patch+json`. A strategic
merge differs from a JSON merge patch (RFC 7386: objects merge, null deletes, lists are replaced)
for the lists the API marks `patchStrategy: merge`: their items merge by a key (owner references
by uid, conditions by type, containers and env vars by name, ...). `MERGE_KEYS` holds those keys
for the fields of the kinds the stand-in serves. Of the patch directives only `$patch: delete` on
an item of such a list is implemented (it removes the item); the others (`$patch` elsewhere,
`$retainKeys`, `$setElementOrder/...`, `$deleteFromPrimitiveList/...`) raise.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

# field name -> the key its items merge by (None: a list of primitives merged as a set)
MERGE_KEYS: dict[str, str | None] = {
    "ownerReferences": "uid", "finalizers": None, "conditions": "type",
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
    "imagePullSecrets": "name", "resourceClaims": "name", "schedulingGates": "name", "hostAliases": "ip",
    "env": "name", "ports": "containerPort", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "podIPs": "ip", "hostIPs": "ip", "resourceClaimStatuses": "name",
}


class UnsupportedPatch(Exception):
    """A patch the stand-in cannot apply faithfully (the server answers 501 Not Implemented)."""


def apply_patch(current: dict[str, Any], patch: Any, content_type: str) -> dict[str, Any]:
    """`current` with `patch` applied (a new dict; `current` is untouched)."""
    if not isinstance(patch, dict):
        raise UnsupportedPatch(f"a {content_type} body must be a JSON object")
    return _merge(copy.deepcopy(current), patch, strategic=content_type == STRATEGIC_MERGE_PATCH)


def _merge(target: Any, patch: dict[str, Any], *, strategic: bool) -> dict[str, Any]:
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if strategic and key.startswith("$"):
            raise UnsupportedPatch(f"the strategic merge patch directive {key!r} is not implemented by the stand-in")
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = _merge(out.get(key), value, strategic=strategic)
        elif strategic and isinstance(value, list) and key in MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[key], key)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(current: list[Any], patch: list[Any], merge_key: str | None, field: str) -> list[Any]:
    if merge_key is None:
        return current + [v for v in patch if v not in current]
    out = list(current)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise UnsupportedPatch(f"{field}: every item of a strategic merge must carry its merge key {merge_key!r}")
        at = next((i for i, old in enumerate(out) if isinstance(old, dict) and old.get(merge_key) == item[merge_key]),
                  None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(_merge({}, item, strategic=True))
        else:
            out[at] = _merge(out[at], item, strategic=True)
    return out


def merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns `old` into `new` (what the emulator's store applies)."""
    out: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        out[key] = None
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            sub = merge_diff(old[key], value)
            if sub:
                out[key] = sub
        elif key not in old or old[key] != value:
            out[key] = copy.deepcopy(value)
    return out
