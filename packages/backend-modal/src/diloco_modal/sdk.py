"""Talking to Modal: the SDK imported on first use, and its errors as one line that names what failed.

modal is never imported when this package is (`diloco backends` stays fast), nor for a dry run
of sandbox mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diloco.errors import BackendError, UserError


def sdk() -> Any:
    try:
        import modal
    except ImportError:  # pragma: no cover - modal is a dependency of this package
        raise UserError("the modal backend needs the modal SDK: pip install diloco-backend-modal") from None
    return modal


def dashboard_url(object_id: str) -> str:
    return f"https://modal.com/id/{object_id}"


def call(what: str, function_ref: str | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """One SDK call, with Modal's errors turned into one line (`function_ref` names the function
    whose app may not be deployed)."""
    exc_mod = sdk().exception
    try:
        return fn(*args, **kwargs)
    except exc_mod.AuthError as exc:
        if "missing" in str(exc).lower():
            raise UserError("no Modal token configured: run `modal token new` (or set MODAL_TOKEN_ID and "
                            "MODAL_TOKEN_SECRET)") from None
        raise UserError("Modal refused the token (from MODAL_TOKEN_ID / MODAL_TOKEN_SECRET or ~/.modal.toml): run "
                        "`modal token new`") from None
    except exc_mod.NotFoundError as exc:
        raise UserError(f"Modal cannot find what {what} needs: {exc}") from None
    except exc_mod.ExecutionError as exc:
        if "not been hydrated" in str(exc):
            # A 'module:fn' object is never hydrated by deploying its app elsewhere (`modal deploy`
            # in another process): only deploying it from here, or looking it up by name, works.
            fn = (function_ref or "").partition(":")[2] or "function-name"
            raise UserError(f"Modal function {function_ref!r} is not deployed with this run: set [backend] deploy = "
                            f"true (diloco deploys its module's app first), or deploy the app yourself (`modal "
                            f"deploy`) and set [backend] function = 'APP-NAME/{fn}'") from None
        raise BackendError(f"Modal failed to {what}: {exc}") from None
    except exc_mod.InvalidError as exc:
        raise UserError(f"Modal refused to {what}: {exc}") from None
    except exc_mod.Error as exc:
        raise BackendError(f"Modal failed to {what}: {type(exc).__name__}: {exc}") from None
