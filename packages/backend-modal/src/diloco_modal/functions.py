"""Function mode: finding the user's Modal function (and deploying its app) when submitting.

`function` is 'app-name/fn' (an already deployed function, looked up by name), 'module:fn'
(imported from the spec's workdir; with `deploy`, its module's one `modal.App` is deployed
first), or, from Python, the decorated function object itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from diloco.errors import UserError

from .options import ModalOptions
from .sdk import sdk


def is_modal_function(obj: Any) -> bool:
    return hasattr(obj, "spawn") and hasattr(obj, "remote")


def function_ref(fn: Any) -> str:
    """'module:qualname' of a decorated function object, how the options and the plan name it."""
    if not is_modal_function(fn):
        raise TypeError(f"function must be a Modal function (decorated with @app.function, so it has spawn "
                        f"and remote), got {type(fn).__name__}")
    try:
        body = getattr(fn, "_raw_f_", None) or fn  # the decorated Python function, where modal has it
    except AssertionError:  # a function looked up by name has no local body
        body = fn
    return f"{getattr(body, '__module__', '?')}:{getattr(body, '__qualname__', repr(fn))}"


def check_ref(ref: str | None) -> None:
    if ref is not None and "/" not in ref and ":" not in ref:
        raise ValueError(f"`backend.function` must be 'module:function' or 'app-name/function-name', got {ref!r}")


def check_given(opts: ModalOptions, given: Any) -> None:
    """What can be wrong with a function object passed from Python, found when planning."""
    if given is not None and opts.deploy:
        raise UserError("deploy = true needs `function` as 'module:function' (its module's app is deployed); "
                        "with a function object, deploy its app yourself (app.deploy())")


def resolve_function(opts: ModalOptions, given: Any, workdir: str | None, call: Callable[..., Any]) -> Any:
    """The spawnable function; `given` is the object passed from Python, if any; `call` is the
    executor's error-translating SDK call."""
    modal = sdk()
    if given is not None:
        check_given(opts, given)
        return given
    ref = opts.function or ""
    if "/" in ref and ":" not in ref:
        app_name, _, name = ref.partition("/")
        return call(f"look up function {ref!r}", modal.Function.from_name, app_name, name,
                    environment_name=opts.environment)
    module_name, _, attr = ref.partition(":")
    if workdir and workdir not in sys.path:
        sys.path.insert(0, workdir)
    try:
        module = importlib.import_module(module_name)
        fn = module
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"[backend] function {ref!r}: {exc}") from None
    if not is_modal_function(fn):
        raise UserError(f"[backend] function {ref!r} is a {type(fn).__name__}, not a Modal function: decorate it "
                        f"with @app.function(...)")
    if opts.deploy:
        apps = [v for v in vars(module).values() if isinstance(v, modal.App)]
        if len(apps) != 1:
            raise UserError(f"[backend] deploy = true: module {module_name!r} must define exactly one modal.App "
                            f"(found {len(apps)})")
        call(f"deploy app {apps[0].name!r}", apps[0].deploy, environment_name=opts.environment)
    return fn
