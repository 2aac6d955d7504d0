"""The API server's rules for names, labels and annotations (apimachinery's validation), worded
as its `field.Error`s: DNS-1123 labels and subdomains, qualified names (label and annotation
keys), label values, environment variable names and config keys, and annotation size."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .model import FieldError

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(f"^{_LABEL}$")
DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")

MSG_LABEL = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
             "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
             "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
MSG_DNS1035 = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
               "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
               "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
MSG_SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                 "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                 "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
MSG_QUALIFIED = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                 "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                 "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
MSG_LABEL_VALUE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                   "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
                   "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
MSG_ENV_NAME = ("a valid environment variable name must consist of alphabetic characters, digits, '_', '-', or '.', "
                "and must not start with a digit (e.g. 'my.env-name',  or 'MY_ENV.NAME',  or 'MyEnvName1', regex "
                "used for validation is '[-._a-zA-Z][-._a-zA-Z0-9]*')")
MSG_CONFIG_KEY = ("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or "
                  "'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')")

ANNOTATIONS_MAX_BYTES = 256 * 1024


def dns_label(value: str, path: str) -> list[FieldError]:
    errs = [FieldError.invalid(path, value, "must be no more than 63 characters")] if len(value) > 63 else []
    return errs + ([] if DNS1123_LABEL.match(value) else [FieldError.invalid(path, value, MSG_LABEL)])


def dns1035_label(value: str, path: str) -> list[FieldError]:
    """A Service's name: a DNS label that starts with a letter (it becomes a DNS name of its own)."""
    errs = [FieldError.invalid(path, value, "must be no more than 63 characters")] if len(value) > 63 else []
    return errs + ([] if DNS1035_LABEL.match(value) else [FieldError.invalid(path, value, MSG_DNS1035)])


def dns_subdomain(value: str, path: str) -> list[FieldError]:
    errs = [FieldError.invalid(path, value, "must be no more than 253 characters")] if len(value) > 253 else []
    return errs + ([] if DNS1123_SUBDOMAIN.match(value) else [FieldError.invalid(path, value, MSG_SUBDOMAIN)])


def qualified_name(key: str, path: str) -> list[FieldError]:
    """A label or annotation key: an optional DNS-subdomain prefix and '/', then a name of ≤ 63."""
    prefix, slash, name = key.rpartition("/")
    errs: list[FieldError] = []
    if slash and not prefix:
        errs.append(FieldError.invalid(path, key, "prefix part must be non-empty"))
    elif prefix:
        errs += [FieldError.invalid(path, key, f"prefix part {e.detail}") for e in dns_subdomain(prefix, path)]
    if not name:
        errs.append(FieldError.invalid(path, key, "name part must be non-empty"))
    elif len(name) > 63:
        errs.append(FieldError.invalid(path, key, "name part must be no more than 63 characters"))
    elif not _QUALIFIED_NAME.match(name):
        errs.append(FieldError.invalid(path, key, MSG_QUALIFIED))
    return errs


def labels(values: Mapping[str, Any] | None, path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    for key, value in (values or {}).items():
        errs += qualified_name(key, path)
        value = value or ""  # JSON null decodes as ""
        if len(value) > 63:
            errs.append(FieldError.invalid(path, value, "must be no more than 63 characters"))
        elif not _LABEL_VALUE.match(value):
            errs.append(FieldError.invalid(path, value, MSG_LABEL_VALUE))
    return errs


def annotations(values: Mapping[str, Any] | None, path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    for key in values or {}:
        errs += qualified_name(key.lower(), path)
    if sum(len(k) + len(v or "") for k, v in (values or {}).items()) > ANNOTATIONS_MAX_BYTES:
        errs.append(FieldError.too_long(path, ANNOTATIONS_MAX_BYTES))
    return errs
