"""Tables declared once as dataclasses, validated here: a backend's `[backend]` options, the
spec's own tables (`diloco.spec.schema`), `[restart]` (`RestartSettings`) and `[diloco]` (`DilocoSettings`).

Each key is a field made with `option(...)`: its type, default, help, bounds and choices in one
place, read by the one check (`check_table`, `check_option`) and by the listings (`describe_options`).
A backend declares its options as a frozen dataclass, each field made with `option(...)`:

    @dataclass(frozen=True)
    class FooOptions:
        region: str | None = option(None, help="where jobs run (default: the profile's)")
        retries: int = option(2, help="retries per call", min=0, max=10)
        tier: str = option("standard", help="machine tier", choices=("standard", "spot"))

and sets `Options = FooOptions` on its executor. Core checks a spec's table against it before
anything else runs (`parse_options`): unknown keys, wrong types (a string where a list goes, a
float where an integer goes), numbers that are not finite or out of bounds, and values outside
`choices` each fail with one line naming `backend.KEY`, the expected type and the value; so does
a secret-looking key inside an option's tables (options are recorded with the run).
`diloco backends NAME` and the conformance kit read the same declaration (`describe_options`).
A spec table's keys are declared the same way and checked by the same function, named
`restart.KEY`, `diloco.KEY`, `group.KEY` or `KEY` in its errors.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import SpecError

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, *, help: str, min: float | None = None, max: float | None = None,
           choices: tuple[Any, ...] = (), not_secrets: bool | tuple[str, ...] = (),
           check: Callable[[Any], str | None] | None = None, want: str = "") -> Any:
    """One key of a table: its default (none: required), help text, bounds and choices.

    What the type cannot say, `check` does: given a value of the right type, it returns what is
    wrong with it (the words after the key: "must be a non-empty string, got ''") or None. `want`
    words the type in errors where `str | dict[str, Any]` would say less than "a backend name or
    a [backend] table".

    Mutable defaults (lists, dicts) are copied per instance. A secret-looking key at any depth of
    the value is refused (`parse_options`); `not_secrets` names the keys that look like one but
    hold none (a toleration's `key`), or is True where no key does: the option maps variable
    names to secret references (`secret_refs`), or its keys are paths and fields the backend checks.
    """
    meta = {"help": help, "min": min, "max": max, "choices": tuple(choices), "not_secrets": not_secrets,
            "check": check, "want": want}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class BackendOption:
    """One declared key as `describe_options` gives it: a backend's option as `diloco backends
    NAME` lists it, or a key of a spec table."""

    name: str
    type: str
    default: Any
    required: bool
    help: str
    choices: tuple[Any, ...] = ()
    min: float | None = None
    max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "default": self.default, "required": self.required,
                "help": self.help, "choices": list(self.choices), "min": self.min, "max": self.max}


def type_name(tp: Any) -> str:
    """`list[str]`, `str | list[str]`, `dict[str, str]`: how the CLI and errors write a type."""
    if tp is Any:
        return "any"
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None)) or "None"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def describe_value(value: Any) -> str:
    """What kind of TOML value `value` is, for errors: "an integer", "a table"."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def fits(tp: Any, value: Any) -> bool:
    """Whether `value` (as TOML or Python gives it) fits the annotation `tp`."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(fits(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(fits(item, v) for v in value)
    if origin is dict:
        key, item = typing.get_args(tp) or (Any, Any)
        return isinstance(value, dict) and all(fits(key, k) and fits(item, v) for k, v in value.items())
    if tp is list:
        return isinstance(value, list)
    if tp is dict:
        return isinstance(value, dict)
    raise TypeError(f"option type {tp!r} is not one diloco can check from TOML; use str, int, float, bool, "
                    f"list[...], dict[str, ...], a union of those, or Any")


def _fields(options_type: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(options_type)
    return [(f, hints[f.name]) for f in dataclasses.fields(options_type) if f.init and not f.name.startswith("_")]


def check_option(where: str, key: str, f: dataclasses.Field, tp: Any, value: Any) -> Any:
    """One value against its declaration (`key` as errors name it: `backend.region`,
    `diloco.sync_every`); the value as the table gets it (ints widened to float)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"{where}: `{key}` must be a finite number, got {value!r}")
    meta = f.metadata
    if not fits(tp, value):
        want = meta.get("want") or type_name(tp)
        raise SpecError(f"{where}: `{key}` must be {want}, got {value!r} ({describe_value(value)})")
    if meta.get("choices") and value not in meta["choices"] and value is not None:
        raise SpecError(f"{where}: `{key}` must be one of {', '.join(map(str, meta['choices']))}; got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if meta.get("min") is not None and value < meta["min"]:
            raise SpecError(f"{where}: `{key}` must be at least {meta['min']:g}, got {value!r}")
        if meta.get("max") is not None and value > meta["max"]:
            raise SpecError(f"{where}: `{key}` must be at most {meta['max']:g}, got {value!r}")
        if tp is float or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                           and float in typing.get_args(tp) and int not in typing.get_args(tp)):
            value = float(value)
    problem = meta.get("check") and meta["check"](value)
    if problem:
        raise SpecError(f"{where}: `{key}` {problem}")
    return value


def check_fields(obj: Any, where: str) -> None:
    """The fields of the dataclass instance `obj` declared with `option()`, checked in place by
    `check_option` (a request built from Python goes through the same rules as a spec's table);
    a frozen instance too, since this runs from its `__post_init__`."""
    for f, tp in _fields(type(obj)):
        if "help" in f.metadata:
            object.__setattr__(obj, f.name, check_option(where, f.name, f, tp, getattr(obj, f.name)))


def _required(f: dataclasses.Field) -> bool:
    return f.default is _MISSING and f.default_factory is _MISSING


def _default(f: dataclasses.Field) -> Any:
    return None if _required(f) else f.default if f.default is not _MISSING else f.default_factory()


def check_table(where: str, table: Mapping[str, Any], declared: type, *, prefix: str = "", context: str = "",
                see: str = "", optional: Collection[str] = ()) -> dict[str, Any]:
    """`table` against the dataclass `declared`: unknown keys, then each key in declaration order,
    present (`check_option`) or missing (required, unless in `optional`). Returns every key's
    value, defaults filled in (None for an `optional` one left out). Errors name a key as
    `{prefix}{key}`, followed by `context` (" for backend 'eks'"); `see` ends the list of keys."""
    fields = _fields(declared)
    unknown = sorted(set(table) - {f.name for f, _ in fields})
    if unknown:
        allowed = ", ".join(sorted(f.name for f, _ in fields)) or "none"
        raise SpecError(f"{where}: unknown key `{prefix}{unknown[0]}`{context} (allowed: {allowed}{see})")
    out = {}
    for f, tp in fields:
        if f.name in table:
            out[f.name] = check_option(where, prefix + f.name, f, tp, table[f.name])
        elif _required(f) and f.name not in optional:
            help = f" ({f.metadata['help']})" if f.metadata.get("help") else ""
            raise SpecError(f"{where}: missing required key `{prefix}{f.name}`{context}{help}")
        else:
            out[f.name] = _default(f)
    return out


def check_secret_keys(where: str, name: str, f: dataclasses.Field, value: Any) -> None:
    """Refuse a secret-looking key at any depth of one option's value (`labels = { api_token = ... }`):
    options are recorded in run.json and shown by `dryrun`, so its value would land in both."""
    from .inputs.specvalues import secret_key_path

    allowed = f.metadata.get("not_secrets", ())
    if allowed is True:
        return
    found = secret_key_path(f"backend.{name}", value, allowed=allowed or ())
    if found:
        raise SpecError(f"{where}: `{found}` looks like a secret, and backend options are recorded with the run "
                        f"and shown by dryrun; rename the key, or pass the value through `secrets = [...]` (an "
                        f"environment variable exported in your shell)")


def parse_options(options_type: type, table: dict[str, Any], *, source: str = "<spec>", backend: str) -> Any:
    """The spec's `[backend]` table (without `name`) as an instance of `options_type`, or one
    `SpecError` line naming the first thing wrong; the line names `backend`, so it is required."""
    from .inputs.specvalues import check_values

    check_values(source, table, root="backend")  # sizes, depth, NUL, non-finite, credentials in URIs
    values = check_table(source, table, options_type, prefix="backend.", context=f" for backend {backend!r}",
                         see=f"; see `diloco backends {backend}`")
    for f, _ in _fields(options_type):
        if f.name in table:
            check_secret_keys(source, f.name, f, values[f.name])
    return options_type(**values)


def options_from(executor_type: type, options: Any = None, overrides: dict[str, Any] | None = None,
                 **older: Any) -> Any:
    """What an executor's `__init__(options=None, /, **overrides)` keeps: `options` as given, or
    built from keyword overrides (from Python), checked by the same rules as a spec's table.

    Takes the executor class (`type(self)`), not its `Options`: the options type and the backend
    name every error line names are read from the one place a backend declares them. A call in
    backend API 1's form (the `Options` class, `backend=NAME`) is refused in one line saying so."""
    if older or dataclasses.is_dataclass(executor_type):
        from .backendapi import outdated

        raise outdated(f"options_from({getattr(executor_type, '__name__', executor_type)!s}, ..."
                       f"{', backend=...' if 'backend' in older else ''})",
                       "options_from(type(self), options, overrides) in __init__, with `Options` and `backend_name` "
                       "declared on the executor class", 1)
    if not hasattr(executor_type, "Options") or not hasattr(executor_type, "backend_name"):
        raise TypeError(f"options_from({getattr(executor_type, '__name__', executor_type)!s}, ...): declare `Options` "
                        f"(the [backend] options' dataclass) and `backend_name` on the executor class")
    options_type, backend = executor_type.Options, executor_type.backend_name
    if options is not None and not isinstance(options, options_type):
        raise TypeError(f"options must be a {options_type.__name__}, got {type(options).__name__}")
    if options is None:
        return parse_options(options_type, dict(overrides or {}), source="options", backend=backend)
    if overrides:
        return parse_options(options_type, {**dataclasses.asdict(options), **overrides}, source="options",
                             backend=backend)
    return options


def describe_options(options_type: type) -> list[BackendOption]:
    """The declared options in order, for `diloco backends NAME` and the conformance kit."""
    return [BackendOption(f.name, type_name(tp), _default(f), _required(f),
                          " ".join(f.metadata.get("help", "").split()),
                          tuple(f.metadata.get("choices") or ()), f.metadata.get("min"), f.metadata.get("max"))
            for f, tp in _fields(options_type)]
