"""What Kubernetes accepts for the values a user's `[backend]` options put into a Job verbatim.

Labels, node selectors, quantities, object names and tolerations from the options go into every
Job as written. A value the API server refuses there would pass `diloco dryrun` and fail only at
submit, as a 422 for the whole launch; `EksOptions.check` refuses it first, naming the option.
These are the API server's rules for those fields (apimachinery's validation), not a copy of the
test stand-in's: the stand-in is the independent check that both agree with a cluster.
`dns_label` makes a valid name from any text (a run id in a Job's name or a label).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def subdomain_problem(name: str) -> str | None:
    if len(name) > 253 or not _SUBDOMAIN.match(name):
        return (f"{name!r} is not a valid Kubernetes name (lowercase letters, digits, '-' and '.', starting and "
                "ending with a letter or digit, at most 253)")
    return None


def label_key_problem(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if (slash and subdomain_problem(prefix)) or len(name) > 63 or not _NAME.match(name):
        return (f"label key {key!r} is not valid: an optional DNS prefix and '/', then at most 63 letters, digits, "
                "'-', '_' or '.', starting and ending with a letter or digit")
    return None


def label_value_problem(value: Any) -> str | None:
    if not isinstance(value, str) or len(value) > 63 or not _VALUE.match(value):
        return (f"label value {value!r} is not valid: at most 63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit (or empty)")
    return None


def labels_problem(labels: Mapping[str, Any]) -> str | None:
    for key, value in labels.items():
        problem = label_key_problem(key) or label_value_problem(value)
        if problem:
            return problem
    return None


def quantity_problem(text: str) -> str | None:
    """The API server's grammar for a quantity. Not the client's `kubernetes.utils.parse_quantity`:
    that parser is laxer than the server (it takes " 1", "1_0", "-1" and non-ASCII digits, which a
    Job then carries to a 422 at submit), and a refusal belongs in the dry run."""
    if not _QUANTITY.match(text):
        return (f"{text!r} is not a Kubernetes quantity (a number with an optional suffix such as m, k, M, G, Ki, "
                "Mi, Gi: \"500m\", \"8\", \"64Gi\")")
    return None


def toleration_problem(toleration: Any) -> str | None:
    if not isinstance(toleration, Mapping) or set(toleration) - _TOLERATION_KEYS:
        return f"{toleration!r} is not a toleration (keys: {', '.join(sorted(_TOLERATION_KEYS))})"
    operator = toleration.get("operator") or "Equal"
    if operator not in ("Equal", "Exists"):
        return f"toleration operator {operator!r} must be Equal or Exists"
    if operator == "Exists" and toleration.get("value"):
        return "a toleration with operator Exists takes no value"
    if not toleration.get("key") and operator != "Exists":
        return "a toleration without a key must use operator Exists"
    if toleration.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        return f"toleration effect {toleration['effect']!r} must be NoSchedule, PreferNoSchedule or NoExecute"
    if toleration.get("tolerationSeconds") is not None and toleration.get("effect") != "NoExecute":
        return "tolerationSeconds needs effect NoExecute"
    if toleration.get("key") and label_key_problem(toleration["key"]):
        return label_key_problem(toleration["key"])
    return label_value_problem(toleration.get("value") or "") if operator == "Equal" else None


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dns_label(text: str, max_len: int) -> str:
    """A valid DNS-1123 label from any text: lowercase, [a-z0-9-], starts with a letter.

    Over-long names keep 64 bits of a hash of the whole, so two long run ids that differ only in
    their random tail (what gets cut) never collide.
    """
    slug = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "run"
    if not slug[0].isalpha():
        slug = "r-" + slug
    if len(slug) > max_len:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        slug = slug[: max_len - 17].rstrip("-") + "-" + digest
    assert _DNS_LABEL.match(slug), slug
    return slug
