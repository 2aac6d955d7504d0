"""A backend's `[backend]` options, read from its executor: what `diloco backends NAME` lists.

An executor's options are its `__init__`'s keyword parameters: the signature gives each one's
name, type and default, and is also what a spec's `[backend]` table is checked against
(`diloco.spec.validate_backend_options`), so the list cannot drift from what is accepted. The
help text comes from the `Args:` section of the `__init__` docstring (Google style, parsed by
docstring_parser), so a third-party executor that documents its parameters the usual way gets
help in the CLI for free.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendOption:
    name: str
    type: str
    default: Any
    required: bool
    help: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "default": self.default, "required": self.required,
                "help": self.help}


def _type_name(annotation: Any, default: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return type(default).__name__ if default not in (None, inspect.Parameter.empty) else "any"
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.replace("typing.", "")
    if default is None:  # "| None" only says the option may be left out, which the default already shows
        text = " | ".join(p for p in (x.strip() for x in text.split("|")) if p != "None") or "any"
    return text


def _param_help(cls: type) -> dict[str, str]:
    import docstring_parser

    helps: dict[str, str] = {}
    for doc in (inspect.getdoc(cls.__init__), inspect.getdoc(cls)):
        if not doc:
            continue
        for p in docstring_parser.parse(doc).params:
            helps.setdefault(p.arg_name, " ".join((p.description or "").split()))
    return helps


def backend_options(cls: type) -> list[BackendOption]:
    """The executor's options in signature order (internal parameters starting with _ left out)."""
    params = inspect.signature(cls.__init__).parameters
    helps = _param_help(cls)
    out = []
    for name, p in params.items():
        if name == "self" or name.startswith("_") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        required = p.default is inspect.Parameter.empty
        default = None if required else p.default
        out.append(BackendOption(name, _type_name(p.annotation, default), default, required, helps.get(name, "")))
    return out
