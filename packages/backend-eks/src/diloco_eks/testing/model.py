"""Decoding a request body as the API server does: against the Kubernetes 1.29 object model.

The model is the official client's (`kubernetes==29.0.0`, kept as `kubernetes_1_29.json`; see
`model_snapshot` for why a snapshot and not the installed client). Decoding walks the body
through the model classes the way the client's `ApiClient.deserialize` walks `openapi_types`
and `attribute_map`, but strictly, as the server's decoder with `fieldValidation=Strict`:

- a JSON value of the wrong type is a decode error (the server's `json: cannot unmarshal ...`),
- a field the model does not declare is a decode error (`strict decoding error: unknown field`),
- a field the model requires (its setter refuses None) that is absent or null is a
  `Required value` validation error.

Two kinds of field decode to more than the client's `str` says, as on the server: resource
quantities (a string or a number, in the Quantity grammar) and a Secret's `data` (base64).

Only the shape is checked here; what the values must look like is `rules`' job.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .quantities import parse_quantity

SNAPSHOT = Path(__file__).with_name("kubernetes_1_29.json")
KUBERNETES_VERSION = "1.29"

# (model, field) holding resource quantities; (model, field) holding base64 bytes
QUANTITY_FIELDS = {("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests"),
                   ("V1VolumeResourceRequirements", "limits"), ("V1VolumeResourceRequirements", "requests"),
                   ("V1EmptyDirVolumeSource", "sizeLimit"), ("V1PodSpec", "overhead"),
                   ("V1ContainerStatus", "allocatedResources")}
BYTES_FIELDS = {("V1Secret", "data")}

_LIST = re.compile(r"^list\[(.+)\]$")
_DICT = re.compile(r"^dict\(str, (.+)\)$")


@dataclass
class FieldError:
    """One field's problem, worded as the API server's `field.Error` (`path: Type: value: detail`)."""

    path: str
    kind: str  # "Invalid value", "Required value", "Unsupported value", "Forbidden", "Too long", ...
    value: Any = None
    detail: str = ""
    has_value: bool = field(default=False)

    @classmethod
    def invalid(cls, path: str, value: Any, detail: str) -> FieldError:
        return cls(path, "Invalid value", value, detail, True)

    @classmethod
    def required(cls, path: str, detail: str = "") -> FieldError:
        return cls(path, "Required value", None, detail)

    @classmethod
    def unsupported(cls, path: str, value: Any, supported: list[str]) -> FieldError:
        return cls(path, "Unsupported value", value, "supported values: " + ", ".join(f'"{s}"' for s in supported),
                   True)

    @classmethod
    def forbidden(cls, path: str, detail: str) -> FieldError:
        return cls(path, "Forbidden", None, detail)

    @classmethod
    def too_long(cls, path: str, limit: int, unit: str = "bytes") -> FieldError:
        return cls(path, "Too long", None, f"must have at most {limit} {unit}")

    @classmethod
    def duplicate(cls, path: str, value: Any) -> FieldError:
        return cls(path, "Duplicate value", value, "", True)

    @classmethod
    def not_found(cls, path: str, value: Any) -> FieldError:
        return cls(path, "Not found", value, "", True)

    @property
    def reason(self) -> str:
        """The `causes[].reason` the server gives this kind of error."""
        return "Field" + self.kind.replace(" value", "Value").replace(" ", "").replace("Toolong", "ValueTooLong")

    def body(self) -> str:
        text = self.kind
        if self.has_value:
            text += ": " + (json.dumps(self.value) if isinstance(self.value, str) else _go_value(self.value))
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.path}: {self.body()}"


class DecodeError(Exception):
    """The body cannot be decoded into the kind's model (the server answers 400 BadRequest)."""


@dataclass
class Decoded:
    unknown: list[str] = field(default_factory=list)  # paths of undeclared fields
    required: list[FieldError] = field(default_factory=list)


class ApiModel:
    """The model classes of one Kubernetes version, by client class name (V1Job, V1PodSpec, ...)."""

    def __init__(self, data: dict[str, Any]):
        self.client = data["client"]
        self.models: dict[str, dict[str, Any]] = data["models"]

    @classmethod
    @functools.cache
    def load(cls) -> ApiModel:
        return cls(json.loads(SNAPSHOT.read_text()))

    def decode(self, doc: Any, model: str) -> Decoded:
        """Walk `doc` as a `model`; raise DecodeError on the first wrong type, collect the rest."""
        out = Decoded()
        self._value(doc, model, "", out, model)
        return out

    def _value(self, value: Any, type_name: str, path: str, out: Decoded, owner: str) -> None:
        if value is None:
            return  # JSON null: the field is unset (required fields are checked by the caller)
        if m := _LIST.match(type_name):
            if not isinstance(value, list):
                raise DecodeError(_type_error(value, f"[]{_go_type(m[1])}", path, owner))
            for i, item in enumerate(value):
                self._value(item, m[1], f"{path}[{i}]", out, owner)
        elif m := _DICT.match(type_name):
            if not isinstance(value, dict):
                raise DecodeError(_type_error(value, f"map[string]{_go_type(m[1])}", path, owner))
            for key, item in value.items():
                self._value(item, m[1], f"{path}[{key}]", out, owner)
        elif type_name in self.models:
            if not isinstance(value, dict):
                raise DecodeError(_type_error(value, _go_type(type_name), path, owner))
            self._object(value, type_name, path, out)
        else:
            _primitive(value, type_name, path, owner)

    def _object(self, value: dict[str, Any], model: str, path: str, out: Decoded) -> None:
        spec = self.models[model]
        fields = spec["fields"]
        prefix = f"{path}." if path else ""
        for key, item in value.items():
            if key not in fields:
                out.unknown.append(prefix + key)
            elif item is not None and (model, key) in QUANTITY_FIELDS:
                _quantities(item, prefix + key)
            elif item is not None and (model, key) in BYTES_FIELDS:
                self._value(item, fields[key], prefix + key, out, model)
                for text in item.values():
                    _check_base64(text or "")
            else:
                self._value(item, fields[key], prefix + key, out, model)
        for key in spec["required"]:
            if value.get(key) is None:
                out.required.append(FieldError.required(prefix + key))


def _quantities(value: Any, path: str) -> None:
    items = value.items() if isinstance(value, dict) else [(None, value)]
    for name, amount in items:
        if isinstance(amount, (dict, list)) or amount is None:
            raise DecodeError(_type_error(amount, "resource.Quantity", path, "Quantity"))
        try:
            parse_quantity(amount)
        except ValueError as exc:
            raise DecodeError(f"{path}{f'[{name}]' if name is not None else ''}: {exc}") from None


def _check_base64(text: str) -> None:
    """DecodeError unless `text` is standard base64, worded as Go's `illegal base64 data at input byte N`."""
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        bad = next((i for i, c in enumerate(text) if not (c.isascii() and (c.isalnum() or c in "+/="))),
                   len(text) - len(text) % 4 if len(text) % 4 else max(text.find("="), 0))
        raise DecodeError(f"illegal base64 data at input byte {bad}") from None


def _primitive(value: Any, type_name: str, path: str, owner: str) -> None:
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "object": True,  # IntOrString, RawExtension: any JSON value
        "datetime": isinstance(value, str) and _is_rfc3339(value),
        "date": isinstance(value, str),
    }.get(type_name)
    if ok is None:
        raise NotImplementedError(f"the model type {type_name!r} (at {path}) is not known to the stand-in")
    if not ok:
        raise DecodeError(_type_error(value, _go_type(type_name), path, owner))


def _is_rfc3339(text: str) -> bool:
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
        return "T" in text
    except ValueError:
        return False


def _type_error(value: Any, go_type: str, path: str, owner: str) -> str:
    """Worded as Go's encoding/json: `cannot unmarshal string into Go struct field JobSpec.spec.completions of type int32`."""
    kind = ("bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else
            "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object")
    return f"json: cannot unmarshal {kind} into Go struct field {_go_struct(owner)}.{path} of type {go_type}"


def _go_struct(model: str) -> str:
    return re.sub(r"^(Core)?V\d+(beta\d+|alpha\d+)?", "", model)


def _go_type(type_name: str) -> str:
    if m := _LIST.match(type_name):
        return f"[]{_go_type(m[1])}"
    if m := _DICT.match(type_name):
        return f"map[string]{_go_type(m[1])}"
    return {"str": "string", "int": "int32", "float": "float64", "bool": "bool", "datetime": "v1.Time",
            "object": "interface {}"}.get(type_name, f"v1.{_go_struct(type_name)}")


def _go_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
