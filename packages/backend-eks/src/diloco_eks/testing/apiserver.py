"""kmock's Kubernetes emulator made as strict as an API server (1.29) for Jobs, pods, Secrets and
(headless) Services.

kmock's `KubernetesEmulator` stores whatever JSON it is sent. `StrictApiServer` sits in front
of its store (`_handle`, which kmock calls for every request before storing anything) and does
what a real API server does before it stores, in the same order:

1. routing: only the verbs, resources, subresources, query parameters and patch types listed
   in `protocol` are served; anything else is answered 501 Not Implemented, naming the verb
   and path, and recorded in `unimplemented` (the test fails on it);
2. authorization: `deny()` turns a verb on a resource in a namespace into a 403 as RBAC words it;
3. decoding against the 1.29 model (`model`): wrong types and unknown fields are 400 BadRequest
   (strict field validation, as `kubectl --validate=strict`);
4. defaulting and server-owned metadata (`defaults`): uid, creationTimestamp, resourceVersion,
   a Job's generated selector and labels, a Secret's stringData folded into data;
5. validation (`rules` plus the model's required fields): 422 Invalid, worded as the server's;
   on update also immutability, and `resourceVersion` preconditions (409 Conflict);
6. what the simulated controllers cannot run is refused 501 (`can_run`), instead of being
   stored and then silently run differently from a cluster.

`dryRun=All` on create answers what would be stored, storing nothing (how tests ask "would a
cluster accept this?"). Reads: GET of an object, LIST with `labelSelector` (items in name
order, as etcd returns them), and `pods/log` (from the cluster's `pod_log`). DELETE honours
`propagationPolicy` through `on_delete` (the cluster's garbage collector); a Job's default, as
on the server, orphans its pods.
"""

from __future__ import annotations

import copy
import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import kmock

from . import defaults, rules, services
from .model import KUBERNETES_VERSION, ApiModel, DecodeError, FieldError
from .patch import MERGE_PATCH, STRATEGIC_MERGE_PATCH, UnsupportedPatch, apply_patch, merge_diff
from .protocol import (NAME_ALPHABET, PARAMS, RESOURCES, Kind, Unimplemented, content_type, json_body,
                       label_selector, refused)

class StrictApiServer(kmock.KubernetesEmulator):
    """The emulator with an API server's admission in front (see the module doc)."""

    def __init__(self, *, can_run: Callable[[str, dict[str, Any]], str | None],
                 on_delete: Callable[[str, dict[str, Any], str], None],
                 pod_log: Callable[[str, str, int | None], str | None],
                 namespaces: set[str] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.can_run, self.on_delete, self.pod_log = can_run, on_delete, pod_log
        self.namespaces = namespaces  # None: every namespace exists
        self.denied: set[tuple[str, str, str]] = set()  # (verb, resource, namespace)
        self.unimplemented: list[str] = []  # requests answered 501, and the stand-in's own failures (500)
        self.model = ApiModel.load()
        self._version = 0
        self._version_lock = threading.Lock()
        for kind in RESOURCES.values():
            self.resources[f"{kind.api_version}/{kind.plural}"] = kmock.ResourceInfo(
                kind=kind.name, namespaced=True, singular=kind.name.lower(),
                verbs={"create", "get", "list", "patch", "delete"}, subresources=set(kind.subresources))

    # -- entry ---------------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        try:
            if request.resource is None:
                return await self._discovery(request)
            kind = RESOURCES.get((request.resource.group, request.resource.version, request.resource.plural))
            if kind is None:
                raise Unimplemented(f"the resource {request.resource.plural!r} of "
                                    f"{request.resource.group or 'core'}/{request.resource.version}")
            verb = self._verb(request, kind)
            unknown = set(request.params) - PARAMS[verb]
            if unknown:
                raise Unimplemented(f"the query parameter(s) {', '.join(sorted(unknown))}")
            self._authorize(verb, kind, request)
            if verb == "list":
                return aiohttp.web.json_response(self._list(request, kind))
            if verb == "log":
                return self._log(request, kind)
            if verb == "get":
                self._existing(request, kind)
            elif verb == "create":
                admitted = self._admit_create(request, kind)
                if request.params.get("dryRun") == "All":  # admitted, answered, not stored
                    return aiohttp.web.json_response(admitted, status=201)
                _store_instead(request, admitted)
            elif verb == "patch":
                _store_instead(request, self._admit_patch(request, kind))
            elif verb == "delete":
                self._admit_delete(request, kind)
        except Unimplemented as exc:
            message = f"not implemented by the Kubernetes stand-in: {request.method.value} {request.url.path_qs}: {exc}"
            self.unimplemented.append(message)
            raise refused(501, "NotImplemented", message, {"causes": [{"message": str(exc)}]}) from None
        except kmock.KubernetesError:
            raise
        except Exception as exc:  # a bug of the stand-in: answered 500 by kmock, and fails the test
            self.unimplemented.append(f"the Kubernetes stand-in failed on {request.method.value} "
                                      f"{request.url.path_qs}: {exc!r}")
            raise
        response = await super()._handle(request)
        if verb == "create" and response.status == 200 and not response.prepared:
            response.set_status(201)  # Created, as the API server answers (kmock says 200)
        return response

    def _verb(self, request: kmock.Request, kind: Kind) -> str:
        sub, method = request.subresource, request.method.value.upper()
        if not request.namespace:
            if method == "GET" and request.name is None and not request.params.get("watch"):
                return "list"  # across namespaces (the controller's view)
            raise Unimplemented("cluster-scoped access to a namespaced resource")
        if sub and (sub not in kind.subresources or (sub == "log") != (method == "GET")):
            raise Unimplemented(f"the subresource {kind.plural}/{sub} for {method}")
        if request.params.get("watch") in ("true", "1"):
            raise Unimplemented("watch")
        if sub == "log":
            return "log"
        verb = {("GET", False): "list", ("GET", True): "get", ("POST", False): "create", ("PATCH", True): "patch",
                ("DELETE", True): "delete"}.get((method, request.name is not None))
        if verb is None or (sub == "status" and verb not in ("get", "patch")):
            raise Unimplemented(f"{method} on {'an object' if request.name else 'a collection'}")
        return verb

    def _authorize(self, verb: str, kind: Kind, request: kmock.Request) -> None:
        if (verb, kind.plural, request.namespace) in self.denied:
            group = f' in API group "{kind.group}"' if kind.group else ' in API group ""'
            raise refused(403, "Forbidden", f'{kind.resource} is forbidden: User "system:serviceaccount:diloco:'
                                            f'launcher" cannot {verb} resource "{kind.plural}"{group} in the '
                                            f'namespace "{request.namespace}"',
                          {"group": kind.group, "kind": kind.plural})

    def deny(self, verb: str, plural: str, namespace: str) -> None:
        """Refuse `verb` on `plural` in `namespace` with 403, as a missing RBAC role does."""
        self.denied.add((verb, plural, namespace))

    # -- reads ---------------------------------------------------------------------------------

    async def _discovery(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        if request.method.value.upper() != "GET" or path not in (
                "/", "/version", "/api", "/apis", "/api/v1", "/apis/batch", "/apis/batch/v1"):
            raise Unimplemented("only discovery (GET /version, /api, /apis, ...) is served outside the resources")
        return await super()._handle(request)

    async def _serve_server_version(self, request: kmock.Request) -> dict[str, str]:
        major, minor = KUBERNETES_VERSION.split(".")
        return {"major": major, "minor": minor, "gitVersion": f"v{KUBERNETES_VERSION}.0", "platform": "linux/amd64"}

    def _stored(self, kind: Kind, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        key = (kmock.resource(kind.group, kind.version, kind.plural), namespace, name)
        obj = self.objects[key] if key in self.objects else None
        return None if obj is None or obj.deleted else obj.raw

    def _existing(self, request: kmock.Request, kind: Kind) -> dict[str, Any]:
        obj = self._stored(kind, request.namespace, request.name)
        if obj is None:
            raise refused(404, "NotFound", f'{kind.resource} "{request.name}" not found',
                          {"name": request.name, "group": kind.group, "kind": kind.plural})
        return obj

    def _list(self, request: kmock.Request, kind: Kind) -> dict[str, Any]:
        match = label_selector(request.params.get("labelSelector") or "")
        resource = kmock.resource(kind.group, kind.version, kind.plural)
        items = [obj.raw for (res, ns, _), obj in self.objects.items()
                 if res == resource and not obj.deleted and request.namespace in (None, ns)]
        items = [o for o in items if match((o.get("metadata") or {}).get("labels") or {})]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return {"kind": f"{kind.name}List", "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(self._version)}, "items": items}

    def _log(self, request: kmock.Request, kind: Kind) -> aiohttp.web.StreamResponse:
        pod = self._existing(request, kind)
        container = request.params.get("container")
        names = [c["name"] for c in pod["spec"]["containers"]]
        if container is not None and container not in names:
            raise refused(400, "BadRequest", f"container {container} is not valid for pod {request.name}")
        tail = request.params.get("tailLines")
        text = self.pod_log(request.namespace, request.name, int(tail) if tail is not None else None)
        if text is None:
            raise refused(400, "BadRequest", f'container "{names[0]}" in pod "{request.name}" is waiting to start: '
                                             "ContainerCreating")
        return aiohttp.web.Response(text=text, content_type="text/plain")

    # -- writes --------------------------------------------------------------------------------

    def _admit_create(self, request: kmock.Request, kind: Kind) -> dict[str, Any]:
        body = self._body(request, kind)
        decoded = self._decode(body, kind)  # metadata, if given, is an object from here on
        meta = body["metadata"] = body.get("metadata") or {}
        if meta.get("namespace") and meta["namespace"] != request.namespace:
            raise refused(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                             "sent on the request")
        if meta.get("resourceVersion"):
            raise refused(400, "BadRequest", "resourceVersion should not be set on objects to be created")
        if self.namespaces is not None and request.namespace not in self.namespaces:
            raise refused(404, "NotFound", f'namespaces "{request.namespace}" not found',
                          {"name": request.namespace, "kind": "namespaces"})
        meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(secrets.choice(NAME_ALPHABET) for _ in range(5))
        obj = dict(body)
        defaults.server_metadata(obj, uid=str(uuid.uuid4()), now=_now(), resource_version=self._next_version())
        if kind.name == "Job":
            obj["status"] = {}
        obj = defaults.for_kind(kind.name, obj)
        self._validate(kind, obj, decoded.required, self._rules(kind, obj, decoded))
        if self._stored(kind, request.namespace, meta.get("name")) is not None:
            raise refused(409, "AlreadyExists", f'{kind.resource} "{meta["name"]}" already exists',
                          {"name": meta["name"], "group": kind.group, "kind": kind.plural})
        problem = self.can_run(kind.name, obj) if request.params.get("dryRun") != "All" else None  # nothing runs
        if problem:
            raise Unimplemented(problem)
        return obj

    def _admit_patch(self, request: kmock.Request, kind: Kind) -> dict[str, Any]:
        current = copy.deepcopy(self._existing(request, kind))  # the store's own dict: never edited here
        patch_type = content_type(request)
        if patch_type not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
            raise Unimplemented(f"the patch type {patch_type or '(none)'} (merge and strategic merge patches are)")
        self._field_validation(request)
        try:
            merged = apply_patch(current, json_body(request), patch_type)
        except UnsupportedPatch as exc:
            raise Unimplemented(str(exc)) from None
        wanted_version = ((merged.get("metadata") or {}).get("resourceVersion"))
        if wanted_version != current["metadata"]["resourceVersion"]:
            raise refused(409, "Conflict", f'Operation cannot be fulfilled on {kind.resource} "{request.name}": the '
                                           "object has been modified; please apply your changes to the latest "
                                           "version and try again")
        if request.subresource == "status":
            new = {**current, "status": merged.get("status")}
        else:
            new = {**merged, **({"status": current["status"]} if "status" in current else {})}
        if kind.name == "Secret":
            new = defaults.for_kind("Secret", new)
        decoded = self._decode(new, kind)
        errs = self._rules(kind, new, decoded) + self._immutable(kind, current, new)
        self._validate(kind, new, decoded.required, errs)
        new["metadata"]["resourceVersion"] = self._next_version()
        return merge_diff(current, new)

    def _immutable(self, kind: Kind, old: dict[str, Any], new: dict[str, Any]) -> list[FieldError]:
        errs = [FieldError.invalid(f"metadata.{key}", new["metadata"].get(key), "field is immutable")
                for key in ("name", "namespace", "uid", "creationTimestamp", "generateName")
                if old["metadata"].get(key) != new["metadata"].get(key)]
        if new["metadata"].get("finalizers") != old["metadata"].get("finalizers"):
            raise Unimplemented("finalizers")
        if kind.name == "Secret":
            return errs + rules.secret_update(old, new)
        if kind.name == "Service" and old["spec"] != new["spec"]:
            raise Unimplemented("changes to a Service's spec after creation")
        changed = sorted(k for k in {*old["spec"], *new["spec"]} if old["spec"].get(k) != new["spec"].get(k))
        fixed = {"Job": {"template", "completionMode", "selector", "manualSelector", "backoffLimitPerIndex",
                         "podFailurePolicy", "podReplacementPolicy"}}.get(kind.name, set(new["spec"]))
        errs += [FieldError.invalid(f"spec.{k}", new["spec"].get(k), "field is immutable") for k in changed if k in fixed]
        if changed and not errs:
            raise Unimplemented(f"changes to a {kind.name}'s spec after creation ({', '.join(changed)})")
        return errs

    def _admit_delete(self, request: kmock.Request, kind: Kind) -> None:
        obj = self._existing(request, kind)
        options = json_body(request) if request.body else {}
        if options:
            self._decode({"kind": "DeleteOptions", "apiVersion": "v1", **options}, None)
            if set(options) - {"kind", "apiVersion", "propagationPolicy"}:
                raise Unimplemented(f"the delete options {sorted(set(options) - {'kind', 'apiVersion'})}")
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy")
        policy = policy or ("Orphan" if kind.name == "Job" else "Background")  # batch/v1 Jobs orphan by default
        if policy not in ("Orphan", "Background", "Foreground"):
            raise refused(422, "Invalid", f'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: Unsupported '
                                          f'value: "{policy}": supported values: "Foreground", "Background", "Orphan"')
        if policy == "Foreground":
            raise Unimplemented("foreground deletion (it needs the foregroundDeletion finalizer)")
        self._next_version()
        self.on_delete(kind.name, obj, policy)

    # -- admission steps -----------------------------------------------------------------------

    def _body(self, request: kmock.Request, kind: Kind) -> dict[str, Any]:
        if request.params.get("dryRun") not in (None, "All"):
            raise refused(400, "BadRequest", f'Invalid dryRun parameter value "{request.params["dryRun"]}"')
        body_type = content_type(request)
        if body_type not in ("", "application/json"):  # none: the server takes JSON, its first type
            raise Unimplemented(f"the request body type {body_type} (application/json is)")
        self._field_validation(request)
        body = json_body(request)
        if not body.get("kind"):
            raise refused(400, "BadRequest", f"Object 'Kind' is missing in '{json.dumps(body)[:200]}'")
        if body.get("apiVersion") != kind.api_version or body["kind"] != kind.name:
            raise refused(400, "BadRequest", f"the API version in the data ({body.get('apiVersion')}) and kind "
                                             f"({body['kind']}) do not match the expected {kind.api_version} "
                                             f"{kind.name}")
        return body

    @staticmethod
    def _field_validation(request: kmock.Request) -> None:
        if request.params.get("fieldValidation") not in (None, "Strict"):
            raise Unimplemented(f"fieldValidation={request.params['fieldValidation']} (the stand-in is always "
                                "Strict)")

    def _decode(self, body: dict[str, Any], kind: Kind | None):
        model = kind.model if kind else "V1DeleteOptions"
        name = kind.name if kind else "DeleteOptions"
        prefix = f'{name} in version "v1" cannot be handled as a {name}: '
        try:
            decoded = self.model.decode(body, model)
        except DecodeError as exc:
            raise refused(400, "BadRequest", prefix + str(exc)) from None
        if decoded.unknown:
            raise refused(400, "BadRequest", prefix + "strict decoding error: " +
                          ", ".join(f'unknown field "{p}"' for p in decoded.unknown))
        return decoded

    def _rules(self, kind: Kind, obj: dict[str, Any], decoded) -> list[FieldError]:
        checks = {"Secret": rules.secret, "Service": services.validate, "Job": rules.job, "Pod": rules.pod}
        return checks[kind.name](obj)

    def _validate(self, kind: Kind, obj: dict[str, Any], required: list[FieldError], errs: list[FieldError]) -> None:
        errs = required + [e for e in errs if str(e) not in {str(r) for r in required}]
        if not errs:
            return
        name = (obj.get("metadata") or {}).get("name") or ""
        body = str(errs[0]) if len(errs) == 1 else "[" + ", ".join(str(e) for e in errs) + "]"
        raise refused(422, "Invalid", f'{kind.qualified} "{name}" is invalid: {body}', {
            "name": name, "group": kind.group, "kind": kind.name,
            "causes": [{"reason": e.reason, "message": e.body(), "field": e.path} for e in errs]})

    def _next_version(self) -> str:
        with self._version_lock:
            self._version += 1
            return str(self._version)


def _store_instead(request: kmock.Request, data: dict[str, Any]) -> None:
    """Have kmock store `data` (the admitted object; for a patch, the merge patch that yields it)
    instead of the body as sent. kmock routes a request by its identity, so the request itself
    is updated rather than copied; its raw `body` still holds what the client sent."""
    object.__setattr__(request, "data", data)

def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
