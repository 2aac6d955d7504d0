"""A request to the stand-in held to botocore's SageMaker model, as the service holds it.

botocore checks only types, required members and minimums before sending; SageMaker checks
everything its model declares (maximum lengths, patterns, enums, numeric ranges) and answers
`ValidationException: 2 validation errors detected: Value 'x_y' at 'trainingJobName' failed to
satisfy constraint: …`. This is the stand-in's own reading of the model: it shares nothing with
the launcher's (`diloco_sagemaker.servicemodel`, which `plan` uses), so a wrong check there is
caught here rather than agreed with. The model is the installed botocore's, never a copy.

Members are visited in the model's order; a value of the wrong JSON type, or a member the shape
does not have, makes the request unreadable (SerializationException) before any constraint.
"""

from __future__ import annotations

import functools
from typing import Any

from .patterns import matches

_CONTAINERS = {"structure": dict, "map": dict, "list": list}
_SCALARS = {"string": (str,), "blob": (str,), "boolean": (bool,), "integer": (int,), "long": (int,),
            "float": (int, float), "double": (int, float), "timestamp": (int, float, str)}
_NUMBERS = ("integer", "long", "float", "double")


class Unreadable(Exception):
    """The request cannot be read as the operation's input (SageMaker's SerializationException)."""


@functools.cache
def model() -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker")


def botocore_version() -> str:
    import botocore

    return botocore.__version__


def violations(operation: str, request: dict[str, Any]) -> list[str]:
    """SageMaker's sentence for every constraint of the model `request` breaks (empty: none);
    raises `Unreadable` for a request the service could not parse."""
    shape = model().operation_model(operation).input_shape
    found: list[str] = []
    if shape is not None:
        _visit(shape, request, "", found)
    return found


def summary(found: list[str]) -> str:
    """The ValidationException message: "N validation error(s) detected: " and each sentence."""
    return f"{len(found)} validation error{'' if len(found) == 1 else 's'} detected: {'; '.join(found)}"


def shown(value: Any) -> str:
    """`value` as the service's Java prints it in a message (`{k=v}`, `[a, b]`, `null`, `true`)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(shown, value)) + "]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _readable(shape: Any, value: Any, where: str) -> None:
    kind = shape.type_name
    want = (_CONTAINERS[kind],) if kind in _CONTAINERS else _SCALARS.get(kind, (object,))
    if not isinstance(value, want) or (isinstance(value, bool) and kind != "boolean"):
        raise Unreadable(f"{type(value).__name__} value at '{where}' can not be converted to a {kind}")


def _visit(shape: Any, value: Any, where: str, found: list[str]) -> None:
    _readable(shape, value, where)
    kind = shape.type_name
    if kind == "structure":
        unknown = set(value) - set(shape.members)
        if unknown:
            raise Unreadable(f"Unknown member '{sorted(unknown)[0]}' at '{where or shape.name}'")
        required = set(shape.required_members)
        for name, member in shape.members.items():
            camel = name[:1].lower() + name[1:]  # the service's messages name members in lowerCamelCase
            path = f"{where}.{camel}" if where else camel
            if value.get(name) is not None:
                _visit(member, value[name], path, found)
            elif name in required:
                found.append(f"Value 'null' at '{path}' failed to satisfy constraint: Member must not be null")
        return
    broken = _own_constraints(shape, value)
    if kind == "list":
        broken += _items(shape.member, list(enumerate(value, 1)), where, found, "Member")
    elif kind == "map":
        broken += _items(shape.key, [(k, k) for k in value], where, found, "Map key")
        broken += _items(shape.value, list(value.items()), where, found, "Map value")
    found.extend(f"Value '{shown(value)}' at '{where}' failed to satisfy constraint: {b}" for b in broken)


def _items(shape: Any, items: list[tuple[Any, Any]], where: str, found: list[str], who: str) -> list[str]:
    """A list's members or a map's keys or values: containers each at their own path
    (`tags.1.member`), scalars as one constraint on the whole (`Member must satisfy constraint: […]`)."""
    if shape.type_name in ("structure", "list", "map"):
        for at, item in items:
            _visit(shape, item, f"{where}.{at}.member" if isinstance(at, int) else f"{where}.{at}", found)
        return []
    broken: list[str] = []
    for _, item in items:
        _readable(shape, item, where)
        broken += [b for b in _own_constraints(shape, item) if b not in broken]
    return [f"{who} must satisfy constraint: [{', '.join(broken)}]"] if broken else []


def _own_constraints(shape: Any, value: Any) -> list[str]:
    """What `value` breaks of the constraints declared on `shape` itself."""
    meta, kind, out = shape.metadata, shape.type_name, []
    measure, noun = (len(value), "length") if kind in ("string", "list", "map") else (value, "value")
    if kind in ("string", "list", "map") or kind in _NUMBERS:
        if "max" in meta and measure > meta["max"]:
            out.append(f"Member must have {noun} less than or equal to {meta['max']}")
        if "min" in meta and measure < meta["min"]:
            out.append(f"Member must have {noun} greater than or equal to {meta['min']}")
    if kind == "string":
        if shape.enum and value not in shape.enum:
            out.append(f"Member must satisfy enum value set: [{', '.join(shape.enum)}]")
        if "pattern" in meta and not matches(meta["pattern"], value):
            out.append(f"Member must satisfy regular expression pattern: {meta['pattern']}")
    return out
