"""A SageMaker request checked against botocore's own service model, with SageMaker's words.

botocore validates only types, required members and minimum lengths before sending; the
service checks everything its model declares — maximum lengths, patterns, enums, numeric
ranges — and answers `ValidationException: 1 validation error detected: Value 'x' at
'trainingJobName' failed to satisfy constraint: Member must satisfy regular expression pattern:
…`. This module walks an operation's input shape the same way and returns those messages, so
that `plan` can refuse such a request before anything is uploaded. The model is the installed
botocore's (`botocore.session`), never a copy. The test control plane does not use this module:
it reads the model on its own (`diloco_sagemaker.testing.validation`), so that a mistake here is
refused there, as SageMaker would refuse it.

Two kinds of problem, as the JSON protocol reports them: `serialization` (a value of the wrong
JSON type, a member the shape does not have: the request cannot be read) and `validation` (a
readable request breaking a constraint).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from . import javaregex

SERVICE = "sagemaker"


@functools.cache
def service_model() -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model(SERVICE)


def botocore_version() -> str:
    import botocore

    return botocore.__version__


@dataclass
class Problems:
    serialization: list[str] = field(default_factory=list)
    validation: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.serialization or self.validation)

    def message(self) -> str:
        """SageMaker's text for the validation errors ("1 validation error detected: …")."""
        n = len(self.validation)
        return f"{n} validation error{'s' if n != 1 else ''} detected: " + "; ".join(self.validation)


def check(operation: str, params: dict[str, Any], *, enums: bool = True) -> Problems:
    """Every problem SageMaker's model finds in `params` for `operation`.

    `enums=False` skips enum membership: a service learns new values (instance types) before an
    older client's model does, so a client-side check must not refuse them.
    """
    shape = service_model().operation_model(operation).input_shape
    problems = Problems()
    if shape is not None:
        _walk(shape, params, "", problems, enums)
    return problems


def _member_path(path: str, name: str) -> str:
    name = name[:1].lower() + name[1:]
    return f"{path}.{name}" if path else name


def render(value: Any) -> str:
    """A value as the service's messages print it (Java's toString of the parsed request)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(render(v) for v in value) + "]"
    return str(value)


def _fail(problems: Problems, value: Any, path: str, constraint: str) -> None:
    problems.validation.append(f"Value '{render(value)}' at '{path}' failed to satisfy constraint: {constraint}")


_JSON_TYPES = {"string": (str,), "integer": (int,), "long": (int,), "boolean": (bool,), "double": (int, float),
               "float": (int, float), "timestamp": (int, float, str), "blob": (str,)}
_TYPE_WORDS = {"string": "STRING_VALUE", "integer": "Integer", "long": "Long", "boolean": "Boolean",
               "double": "Double", "float": "Float", "timestamp": "Timestamp", "blob": "Blob"}


def _type_ok(shape: Any, value: Any) -> bool:
    kind = shape.type_name
    if kind == "structure" or kind == "map":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def scalar_constraints(shape: Any, value: Any, enums: bool = True) -> list[str]:
    """The constraints a string or number breaks, in SageMaker's words (without the value)."""
    meta, out = shape.metadata, []
    if shape.type_name == "string" and isinstance(value, str):
        if "max" in meta and len(value) > meta["max"]:
            out.append(f"Member must have length less than or equal to {meta['max']}")
        if "min" in meta and len(value) < meta["min"]:
            out.append(f"Member must have length greater than or equal to {meta['min']}")
        if enums and shape.enum and value not in shape.enum:
            out.append(f"Member must satisfy enum value set: [{', '.join(shape.enum)}]")
        pattern = meta.get("pattern")
        if pattern and not _pattern_ok(pattern, value):
            out.append(f"Member must satisfy regular expression pattern: {pattern}")
    elif shape.type_name in ("integer", "long", "double", "float") and not isinstance(value, bool):
        if "max" in meta and value > meta["max"]:
            out.append(f"Member must have value less than or equal to {meta['max']}")
        if "min" in meta and value < meta["min"]:
            out.append(f"Member must have value greater than or equal to {meta['min']}")
    return out


def _pattern_ok(pattern: str, value: str) -> bool:
    try:
        return javaregex.full_match(pattern, value)
    except javaregex.UnsupportedPattern:  # never guessed: an untranslatable pattern is not checked
        return True


def _length(shape: Any, value: Any, path: str, problems: Problems) -> None:
    meta = shape.metadata
    if "max" in meta and len(value) > meta["max"]:
        _fail(problems, value, path, f"Member must have length less than or equal to {meta['max']}")
    if "min" in meta and len(value) < meta["min"]:
        _fail(problems, value, path, f"Member must have length greater than or equal to {meta['min']}")


def _walk(shape: Any, value: Any, path: str, problems: Problems, enums: bool) -> None:
    if value is None:
        return
    if not _type_ok(shape, value):
        word = _TYPE_WORDS.get(shape.type_name, shape.type_name)
        problems.serialization.append(f"{type(value).__name__} value at '{path}' can not be converted to a {word}"
                                      if shape.type_name not in ("structure", "map", "list") else
                                      f"Expected a {shape.type_name} at '{path}', got {type(value).__name__}")
        return
    kind = shape.type_name
    if kind == "structure":
        for name in shape.required_members:
            if value.get(name) is None:
                _fail(problems, None, _member_path(path, name), "Member must not be null")
        for name, item in value.items():
            member = shape.members.get(name)
            if member is None:
                problems.serialization.append(f"Unknown member '{name}' at '{path or shape.name}'")
                continue
            _walk(member, item, _member_path(path, name), problems, enums)
    elif kind == "list":
        _length(shape, value, path, problems)
        member = shape.member
        if member.type_name in ("structure", "list", "map"):
            for i, item in enumerate(value, 1):
                _walk(member, item, f"{path}.{i}.member", problems, enums)
            return
        broken: list[str] = []
        for item in value:
            if not _type_ok(member, item):
                problems.serialization.append(f"{type(item).__name__} value in '{path}' can not be converted to a "
                                              f"{_TYPE_WORDS.get(member.type_name, member.type_name)}")
                continue
            broken += [c for c in scalar_constraints(member, item, enums) if c not in broken]
        if broken:
            _fail(problems, value, path, f"Member must satisfy constraint: [{', '.join(broken)}]")
    elif kind == "map":
        _length(shape, value, path, problems)
        for side, sub in (("key", shape.key), ("value", shape.value)):
            broken = []
            for k, v in value.items():
                item = k if side == "key" else v
                if sub.type_name in ("structure", "list", "map"):
                    _walk(sub, item, f"{path}.{k}", problems, enums)
                elif not _type_ok(sub, item):
                    problems.serialization.append(f"{type(item).__name__} map {side} at '{path}' can not be "
                                                  f"converted to a {_TYPE_WORDS.get(sub.type_name, sub.type_name)}")
                else:
                    broken += [c for c in scalar_constraints(sub, item, enums) if c not in broken]
            if broken:
                _fail(problems, value, path, f"Map {side} must satisfy constraint: [{', '.join(broken)}]")
    else:
        for constraint in scalar_constraints(shape, value, enums):
            _fail(problems, value, path, constraint)
