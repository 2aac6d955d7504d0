"""The shape of the API the stand-in serves: its kinds and the query parameters of each verb,
errors as the API server's `Status`, request bodies and label selectors, and the HTTP server
(kmock's, with the API server's 3 MiB body limit)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import aiohttp.web_runner
import aiohttp.web_server
import kmock


@dataclass(frozen=True)
class Kind:
    """A kind the stand-in serves, with the names the server uses for it in URLs and messages."""

    name: str  # "Job"
    group: str  # "batch"; "" for core
    version: str
    plural: str
    model: str  # the client model class: V1Job
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How the server names the kind in messages: `Job.batch`, `Secret`, `Service`."""
        return f"{self.name}.{self.group}" if self.group else self.name

    @property
    def resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES = {(k.group, k.version, k.plural): k for k in (
    Kind("Job", "batch", "v1", "jobs", "V1Job", ("status",)),
    Kind("Pod", "", "v1", "pods", "V1Pod", ("status", "log")),
    Kind("Secret", "", "v1", "secrets", "V1Secret"),
    Kind("Service", "", "v1", "services", "V1Service"),
)}
# query parameters served per verb; any other is answered 501 (fieldSelector, limit, watch, ...)
WRITE_PARAMS = {"pretty", "fieldManager", "fieldValidation"}
PARAMS = {
    "create": WRITE_PARAMS | {"dryRun"}, "patch": WRITE_PARAMS, "get": {"pretty"},
    "list": {"pretty", "labelSelector"}, "delete": {"pretty", "propagationPolicy"},
    "log": {"pretty", "tailLines", "container"},
}
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # generateName's suffix letters: no vowels, no look-alikes
_SELECTOR_TERM = re.compile(r"^\s*([^!=\s]+)\s*(==|=|!=)\s*([^\s]*)\s*$|^\s*(!?)([^!=\s]+)\s*$")
MAX_REQUEST_BODY = 3 * 1024 * 1024  # the API server's limit (aiohttp's default is 1 MiB)


class HttpServer(aiohttp.test_utils.RawTestServer):
    """kmock's HTTP server class, taking request bodies up to the API server's 3 MiB."""

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web_runner.ServerRunner:
        def request(message, payload, protocol, writer, task):
            return aiohttp.web.BaseRequest(message, payload, protocol, writer, task, self._loop,
                                           client_max_size=MAX_REQUEST_BODY)

        server = aiohttp.web_server.Server(self._handler, loop=self._loop, debug=debug, request_factory=request,
                                          **kwargs)
        return aiohttp.web_runner.ServerRunner(server, debug=debug, **kwargs)


class Unimplemented(Exception):
    """A valid request the stand-in does not implement: answered 501 and recorded."""


def refused(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> kmock.KubernetesError:
    """The error kmock answers as a `Status` body with this code, reason and message."""
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {})


def content_type(request: kmock.Request) -> str:
    value = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
    return value.split(";")[0].strip().lower()


def json_body(request: kmock.Request) -> dict[str, Any]:
    try:
        body = json.loads(request.body or b"null")
    except ValueError as exc:
        raise refused(400, "BadRequest", f"the body of the request was in an unknown format: {exc}") from None
    if not isinstance(body, dict):
        raise refused(400, "BadRequest", "the body of the request must be a JSON object")
    return body


def label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """An equality-based label selector (`a=b,c!=d,e,!f`); set-based ones are not implemented."""
    terms = []
    for part in filter(None, text.split(",")):
        m = _SELECTOR_TERM.match(part)
        if not m or " in " in part or " notin " in part:
            raise Unimplemented(f"the label selector term {part!r} (only equality-based selectors are)")
        terms.append(m.groups())

    def match(labels: dict[str, str]) -> bool:
        for key, op, value, bang, exists_key in terms:
            if key is not None:
                if (labels.get(key) == value) != (op in ("=", "==")):
                    return False
            elif (exists_key in labels) == bool(bang):
                return False
        return True
    return match
