"""Records: dataclasses as JSON documents and back, one mechanism for every record diloco keeps
or passes on (a rank in run.json, a replica's handle and result, the launcher's heartbeat, a
replica group, a round's metrics row and summary).

`to_record(obj)` is the plain data: dataclasses as objects, enums as their values, tuples as
lists. `from_record(cls, data)` builds `cls` back from a document that was read from a disk or
a store another process writes, so nothing in it is taken on trust: every field is decoded by
its annotation (a nested record, an enum, a list or a mapping of them) and every plain value
must fit its type as the one validator of TOML values decides (`diloco.options.fits`: numbers
finite, an int no bool). A missing field takes its default; keys the class does not declare are
not read. `RecordError` (a ValueError) names the first field that does not fit.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from .options import fits, type_name

T = TypeVar("T")


class RecordError(ValueError):
    """A document that is not a valid record of its type; the message names the field."""


def to_record(obj: Any) -> Any:
    """`obj` as plain JSON data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_record(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {k: to_record(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_record(v) for v in obj]
    return obj


def from_record(cls: type[T], data: Any, *, where: str | None = None) -> T:
    """An instance of the dataclass `cls` from `data`, every field decoded and checked."""
    where = where or cls.__name__
    if not isinstance(data, Mapping):
        raise RecordError(f"{where} must be a JSON object")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{where}.{f.name} is missing")
            continue
        values[f.name] = _decode(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**values)


def _decode(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own error names the field inside it
            return _decode(options[0], value, where)
        for arg in options:
            try:
                return _decode(arg, value, where)
            except RecordError:
                continue
        raise RecordError(f"{where} is not a valid {type_name(tp)}: {_shown(value)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_record(tp, value, where=where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise RecordError(f"{where} is not one of {', '.join(str(m.value) for m in tp)}: "
                              f"{_shown(value)}") from None
    if origin is list and args:
        if not isinstance(value, list):
            raise RecordError(f"{where} is not a list: {_shown(value)}")
        return [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping) and args:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RecordError(f"{where} is not an object: {_shown(value)}")
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if not fits(tp, value):
        raise RecordError(f"{where} is not a valid {type_name(tp)}: {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
