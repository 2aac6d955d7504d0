"""Function mode: finding the user's Modal function (and deploying its app) when submitting, and
giving its calls the spec's forwarded secrets.

`function` is 'app-name/fn' (an already deployed function, looked up by name), 'module:fn'
(imported from the spec's workdir; with `deploy`, its module's one `modal.App` is deployed
first), or, from Python, the decorated function object itself.

Forwarded secrets never travel as a call's input (Modal keeps inputs for the call's lifetime and
shows them to whoever reads the call). They are one ephemeral `modal.Secret.from_dict`, attached
with `fn.with_options(secrets=...)` (modal >= 1.5.5 has it): the calls go to that variant of the
function, whose containers get the values as environment variables. `with_options` *replaces*
the function's secrets (the client sends `replace_secret_ids`), so the function's own secrets
are passed along, the forwarded one after them (as in sandbox mode, after the named ones).
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


def lookup_of(opts: ModalOptions, given: Any) -> tuple[str, str] | None:
    """(app name, function name) of a function deployed elsewhere and looked up by name."""
    ref = opts.function or ""
    if given is None and "/" in ref and ":" not in ref:
        app_name, _, name = ref.partition("/")
        return app_name, name
    return None


def with_forwarded_secrets(fn: Any, values: dict[str, str], lookup: tuple[str, str] | None,
                           environment: str | None, call: Callable[..., Any]) -> Any:
    """`fn` itself when nothing is forwarded; else its variant whose containers also hold `values`
    (one ephemeral Modal secret), keeping the function's own secrets."""
    if not values:
        return fn
    modal = sdk()
    own = call("read the secrets of the function", _own_secrets, fn, lookup, environment)
    return fn.with_options(secrets=[*own, modal.Secret.from_dict(dict(values))])


def _own_secrets(fn: Any, lookup: tuple[str, str] | None, environment: str | None) -> list[Any]:
    """The secrets the function was deployed with, as modal Secret objects: a function defined
    here has them in its definition; one deployed elsewhere has their ids in what Modal answers
    for it (`FunctionGet`: kept by modal >= 1.6 as the function's info, asked again otherwise)."""
    from modal._utils.async_utils import synchronizer

    raw = synchronizer._translate_in(fn)
    if raw._spec is not None:
        return [synchronizer._translate_out(s) for s in raw._spec.secrets]
    fn.hydrate()
    info = getattr(raw, "_function_info", None)
    if info is not None:
        ids = list(info.secrets)
    elif lookup is not None:
        ids = _deployed_secret_ids(fn, lookup, environment)
    else:
        raise UserError("forwarded `secrets` need the secrets the function was deployed with, which this modal "
                        "client cannot read from a looked-up function object: set [backend] function = "
                        "'APP-NAME/function-name' instead")
    modal = sdk()
    return [modal.Secret._new_hydrated(i, fn.client, None) for i in ids]


def _deployed_secret_ids(fn: Any, lookup: tuple[str, str], environment: str | None) -> list[str]:
    from modal._object import _get_environment_name  # how `Function.from_name` picks it
    from modal._utils.async_utils import synchronize_api
    from modal_proto import api_pb2

    async def read(function: Any) -> list[str]:
        request = api_pb2.FunctionGetRequest(app_name=lookup[0], object_tag=lookup[1],
                                             environment_name=_get_environment_name(environment))
        response = await function._client._stub.FunctionGet(request)
        if response.function_id != function.object_id or not response.function.ranked_functions:
            raise sdk().exception.ExecutionError(f"Modal answered for another function than {lookup[0]}/{lookup[1]}")
        return list(response.function.ranked_functions[0].function.secret_ids)

    return synchronize_api(read, target_module=__name__)(fn)


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
