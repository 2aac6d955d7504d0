"""The fake Modal server's RPCs for the client itself and for apps: hello, tokens, the
environment, app lookup and creation, deploys (`App.deploy`: create, layout, publish).

An app is a record in `apps.json`: its name and environment, and once published ("deployed")
the functions it holds by tag; `FunctionGet` (in `rpc_functions`) looks them up there.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from google.protobuf.empty_pb2 import Empty
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .store import new_id
from .validate import check_name

IMAGE_BUILDER_VERSION = "2025.06"  # one every client from the floor to the newest supports
ENVIRONMENT = "main"  # the only environment of the fake workspace


def environment_of(name: str) -> str:
    """The environment a request names ('' is the profile's default); others do not exist."""
    if name and name != ENVIRONMENT:
        raise GRPCError(Status.NOT_FOUND, f"Environment '{name}' not found")
    return ENVIRONMENT


class AppRpcs:
    store: Any

    def rpc_ClientHello(self, request: Empty) -> api_pb2.ClientHelloResponse:
        return api_pb2.ClientHelloResponse(image_builder_version=IMAGE_BUILDER_VERSION)

    def rpc_AuthTokenGet(self, request: api_pb2.AuthTokenGetRequest) -> api_pb2.AuthTokenGetResponse:
        """A JWT-shaped token (the client reads only its `exp`); the fake checks nothing in it."""
        def part(data: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
        token = f"{part({'alg': 'none'})}.{part({'exp': int(time.time()) + 3600})}.fake"
        return api_pb2.AuthTokenGetResponse(token=token)

    def rpc_EnvironmentGetOrCreate(self, request: api_pb2.EnvironmentGetOrCreateRequest
                                   ) -> api_pb2.EnvironmentGetOrCreateResponse:
        name = environment_of(request.deployment_name)
        settings = api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION, webhook_suffix="modal.run")
        return api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-fakemain", metadata=api_pb2.EnvironmentMetadata(name=name, settings=settings))

    # -- apps --------------------------------------------------------------------------------------

    def _new_app(self, name: str, environment: str, state: str) -> str:
        apps = self.store.apps()
        app_id = new_id("ap")
        apps["by_id"][app_id] = {"name": name, "environment": environment, "state": state, "functions": {}}
        self.store.save_apps(apps)
        return app_id

    def app(self, app_id: str) -> dict[str, Any]:
        found = self.store.apps()["by_id"].get(app_id)
        if found is None:
            raise GRPCError(Status.NOT_FOUND, f"App {app_id} not found")
        return found

    def rpc_AppGetOrCreate(self, request: api_pb2.AppGetOrCreateRequest) -> api_pb2.AppGetOrCreateResponse:
        """`App.lookup(name, create_if_missing=...)`: the deployed or looked-up app of that name."""
        check_name(request.app_name, "App")
        env = environment_of(request.environment_name)
        apps = self.store.apps()
        key = f"{env}/{request.app_name}"
        app_id = apps["deployed"].get(key) or apps.get("lookups", {}).get(key)
        if app_id is None:
            if request.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{request.app_name}' not found in environment '{env}'")
            app_id = self._new_app(request.app_name, env, "ephemeral")
            apps = self.store.apps()
            apps.setdefault("lookups", {})[key] = app_id
            self.store.save_apps(apps)
        return api_pb2.AppGetOrCreateResponse(app_id=app_id)

    def rpc_AppCreate(self, request: api_pb2.AppCreateRequest) -> api_pb2.AppCreateResponse:
        app_id = self._new_app(request.description, environment_of(request.environment_name), "initializing")
        return api_pb2.AppCreateResponse(app_id=app_id, app_page_url=f"https://modal.com/apps/{app_id}",
                                         app_logs_url=f"https://modal.com/logs/{app_id}")

    def rpc_AppGetByDeploymentName(self, request: api_pb2.AppGetByDeploymentNameRequest
                                   ) -> api_pb2.AppGetByDeploymentNameResponse:
        env = environment_of(request.environment_name)
        app_id = self.store.apps()["deployed"].get(f"{env}/{request.name}", "")
        return api_pb2.AppGetByDeploymentNameResponse(app_id=app_id, environment_name=env)

    def rpc_AppGetLayout(self, request: api_pb2.AppGetLayoutRequest) -> api_pb2.AppGetLayoutResponse:
        """A deployed app's functions, so that deploying it again updates them in place."""
        functions = self.app(request.app_id)["functions"]
        objects = [api_pb2.Object(object_id=fid, function_handle_metadata=self.function_metadata(fid))
                   for fid in functions.values()]
        return api_pb2.AppGetLayoutResponse(app_layout=api_pb2.AppLayout(objects=objects, function_ids=functions))

    def rpc_AppHeartbeat(self, request: api_pb2.AppHeartbeatRequest) -> Empty:
        self.app(request.app_id)
        return Empty()

    def rpc_AppPublish(self, request: api_pb2.AppPublishRequest) -> api_pb2.AppPublishResponse:
        """`modal deploy`: the app gets its name and its functions become reachable by it."""
        check_name(request.name, "App")
        apps = self.store.apps()
        app = apps["by_id"].get(request.app_id)
        if app is None:
            raise GRPCError(Status.NOT_FOUND, f"App {request.app_id} not found")
        for tag, function_id in request.function_ids.items():
            if self.store.get(function_id) is None:
                raise GRPCError(Status.NOT_FOUND, f"Function {function_id} ({tag}) was never created")
        app.update(name=request.name, state="deployed", functions=dict(request.function_ids))
        apps["deployed"][f"{app['environment']}/{request.name}"] = request.app_id
        self.store.save_apps(apps)
        return api_pb2.AppPublishResponse(url=f"https://modal.com/apps/{request.app_id}", deployed_at=time.time())

    def rpc_AppClientDisconnect(self, request: api_pb2.AppClientDisconnectRequest) -> Empty:
        return Empty()
