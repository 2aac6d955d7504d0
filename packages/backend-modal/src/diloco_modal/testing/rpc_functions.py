"""The fake Modal server's function RPCs: deploying a function (precreate, create), finding it by
name, binding a variant of it (`with_options`), spawning calls (map, put inputs), and what a
caller can learn about a call.

A variant (`FunctionBindParams`) is a function of its own, as on Modal: an id deterministic in the
request, the base function's definition, and the options the request replaces (only secrets,
resources, timeout and placement: any other option is refused as unimplemented, loudly).

Each call holds one input, run in a container (`containers.start`, kind "function"), or, for a
clustered function (`@modal.clustered(size=K)`: the definition's `_experimental_group_size`), in
K containers started together, each given the same input (`cluster`); how it
ended is authoritative in `FunctionGetOutputs` (the output's GenericResult, as Modal keeps it).
`FunctionGetCallGraph` is what Modal documents it to be, best-effort and not real time: a call
is absent from its graph for `call_graph_lag` seconds after the spawn, and afterwards the graph
shows the call as it was `call_graph_lag` seconds ago (still PENDING for that long after it
ended). A cancelled call's input is TERMINATED; its containers are killed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from typing import Any

from google.protobuf.empty_pb2 import Empty
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from . import containers
from .protos import message
from .rpc_apps import environment_of
from .store import append_jsonl, new_id, read_json
from .validate import check_cluster, check_placement, check_resources, check_timeout

CALL_GRAPH_LAG = 2.0  # seconds; FakeModal(call_graph_lag=...) sets another
_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_BINDABLE = {"secret_ids", "replace_secret_ids", "resources", "timeout_secs", "scheduler_placement",
             "cloud_provider_str"}  # the FunctionOptions the fake applies to a variant
_INPUT_STATUS = {"success": api_pb2.GenericResult.GENERIC_STATUS_SUCCESS,
                 "failure": api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
                 "terminated": api_pb2.GenericResult.GENERIC_STATUS_TERMINATED,
                 "timeout": api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT}


class FunctionRpcs:
    store: Any

    # -- deploying and finding functions -----------------------------------------------------------

    def function(self, function_id: str) -> dict[str, Any]:
        record = self.store.get(function_id)
        if record is None or record.get("kind") != "function":
            raise GRPCError(Status.NOT_FOUND, f"Function {function_id} not found")
        return record

    def function_metadata(self, function_id: str) -> api_pb2.FunctionHandleMetadata:
        record = self.function(function_id)
        return message(
            api_pb2.FunctionHandleMetadata, function_name=record["function_name"],
            function_type=api_pb2.Function.FUNCTION_TYPE_FUNCTION,
            app_id=record["app_id"], definition_id=f"de-{function_id[3:]}",
            supported_input_formats=record["input_formats"], supported_output_formats=record["output_formats"])

    def rpc_FunctionPrecreate(self, request: api_pb2.FunctionPrecreateRequest) -> api_pb2.FunctionPrecreateResponse:
        self.app(request.app_id)
        function_id = request.existing_function_id or new_id("fu")
        self.store.put(function_id, {
            "kind": "function", "app_id": request.app_id, "function_name": request.function_name, "created": False,
            "input_formats": list(request.supported_input_formats) or [api_pb2.DATA_FORMAT_PICKLE],
            "output_formats": list(request.supported_output_formats) or [api_pb2.DATA_FORMAT_PICKLE]})
        return api_pb2.FunctionPrecreateResponse(function_id=function_id,
                                                 handle_metadata=self.function_metadata(function_id))

    def rpc_FunctionCreate(self, request: api_pb2.FunctionCreateRequest) -> api_pb2.FunctionCreateResponse:
        """The function's definition: its module and name (what a container imports), image,
        mounts, secrets, resources and timeout, checked as Modal checks them."""
        self.app(request.app_id)
        if request.HasField("function"):
            d = request.function
            data = api_pb2.FunctionData(ranked_functions=[api_pb2.FunctionData.RankedFunction(rank=0, function=d)])
        else:  # several ranked definitions (GPU fallbacks): the first is the one the fake runs
            data = request.function_data
            if not data.ranked_functions:
                raise GRPCError(Status.INVALID_ARGUMENT, "FunctionData without functions")
            d = api_pb2.Function()
            d.CopyFrom(data.ranked_functions[0].function)
            d.module_name, d.function_name = data.module_name or d.module_name, data.function_name or d.function_name
            d.timeout_secs = data.timeout_secs or d.timeout_secs
        check_timeout(d.timeout_secs, "Function")
        check_resources(d.resources)
        check_cluster(d._experimental_group_size, d.resources)
        self._image(d.image_id)
        for secret_id in d.secret_ids:
            self.secret_values(secret_id)
        function_id = request.existing_function_id or new_id("fu")
        previous = self.store.get(function_id) or {}
        self.store.put(function_id, {
            "kind": "function", "app_id": request.app_id, "function_name": d.function_name, "created": True,
            "module_name": d.module_name, "image_id": d.image_id, "mount_ids": list(d.mount_ids),
            "secret_ids": list(d.secret_ids), "timeout": d.timeout_secs, "retries": d.retry_policy.retries,
            "cluster_size": max(d._experimental_group_size, 1),
            "data": base64.b64encode(data.SerializeToString()).decode(),
            "input_formats": list(d.supported_input_formats) or previous.get("input_formats")
            or [api_pb2.DATA_FORMAT_PICKLE],
            "output_formats": list(d.supported_output_formats) or previous.get("output_formats")
            or [api_pb2.DATA_FORMAT_PICKLE]})
        return api_pb2.FunctionCreateResponse(function_id=function_id, function_data=data,
                                              handle_metadata=self.function_metadata(function_id))

    def rpc_FunctionGet(self, request: api_pb2.FunctionGetRequest) -> api_pb2.FunctionGetResponse:
        """`Function.from_name(app, name)`: a function of a deployed app."""
        env = environment_of(request.environment_name)
        apps = self.store.apps()
        app_id = apps["deployed"].get(f"{env}/{request.app_name}")
        if app_id is None:  # the client prefixes "Lookup failed for Function 'x' from the 'y' app: "
            raise GRPCError(Status.NOT_FOUND, f"App '{request.app_name}' not found in environment '{env}'")
        function_id = apps["by_id"][app_id]["functions"].get(request.object_tag)
        if function_id is None:
            raise GRPCError(Status.NOT_FOUND, f"Function '{request.object_tag}' not found in app '{request.app_name}'")
        data = api_pb2.FunctionData.FromString(base64.b64decode(self.function(function_id)["data"]))
        return message(api_pb2.FunctionGetResponse, function_id=function_id, function=data,
                       handle_metadata=self.function_metadata(function_id))

    def rpc_FunctionBindParams(self, request: api_pb2.FunctionBindParamsRequest
                               ) -> api_pb2.FunctionBindParamsResponse:
        """A variant of a created function (`fn.with_options(...)`), checked as Modal checks it: a
        plain function takes no parameters, every secret exists, resources, timeout and placement
        are within Modal's limits. Its id is deterministic in the request (the client caches it)."""
        environment_of(request.environment_name)
        base = self.function(request.function_id)
        if not base["created"]:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Function {request.function_id} was never created (deployed)")
        if base.get("bound_from"):
            raise GRPCError(Status.INVALID_ARGUMENT, f"Function {request.function_id} is a bound variant: bind its "
                                                     f"base function {base['bound_from']}")
        if request.serialized_params:
            raise GRPCError(Status.INVALID_ARGUMENT, f"Function {base['function_name']} takes no parameters (it is "
                                                     f"not a method of a parametrized class)")
        options = request.function_options
        set_fields = {field.name for field, _ in options.ListFields()}
        for name in sorted(set_fields - _BINDABLE):
            append_jsonl(self.store.root / "unimplemented.jsonl",
                         {"rpc": f"FunctionBindParams.function_options.{name}"})
            raise GRPCError(Status.UNIMPLEMENTED, f"FunctionOptions.{name} is not implemented by diloco's fake Modal "
                                                  f"server (diloco_modal.testing)")
        for secret_id in options.secret_ids:
            self.secret_values(secret_id)
        check_resources(options.resources)
        if base.get("cluster_size", 1) > 1:  # the variant's resources: the fields it sets, over the function's
            resources = api_pb2.Resources()
            resources.CopyFrom(api_pb2.FunctionData.FromString(base64.b64decode(base["data"]))
                               .ranked_functions[0].function.resources)
            resources.MergeFrom(options.resources)
            check_cluster(base["cluster_size"], resources)
        if "timeout_secs" in set_fields:
            check_timeout(options.timeout_secs, "Function")
        check_placement(options.cloud_provider_str, options.scheduler_placement)
        # replace_secret_ids (the client sets it whenever it sends secrets): the variant's secrets
        # are these, not the base function's; without it they are added to the base function's.
        secret_ids = list(options.secret_ids) if options.replace_secret_ids \
            else [*base["secret_ids"], *options.secret_ids]
        digest = int.from_bytes(hashlib.sha256(request.SerializeToString(deterministic=True)).digest(), "big")
        bound_id = "fu-" + "".join(_BASE62[(digest >> (6 * i)) % 62] for i in range(22))
        self.store.put(bound_id, {
            **base, "bound_from": request.function_id, "secret_ids": secret_ids,
            "timeout": options.timeout_secs if "timeout_secs" in set_fields else base["timeout"]})
        return api_pb2.FunctionBindParamsResponse(bound_function_id=bound_id,
                                                  handle_metadata=self.function_metadata(bound_id))

    # -- spawning ----------------------------------------------------------------------------------

    def _start_input(self, function_id: str, call_id: str, item: api_pb2.FunctionPutInputsItem
                     ) -> api_pb2.FunctionPutInputsResponseItem:
        fn = self.function(function_id)
        if not fn["created"]:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Function {function_id} was never created (deployed)")
        if item.input.args_blob_id:
            raise GRPCError(Status.INVALID_ARGUMENT, "the fake takes inputs sent inline only (blobs: UNIMPLEMENTED)")
        data_format = item.input.data_format or api_pb2.DATA_FORMAT_PICKLE
        if data_format not in fn["input_formats"]:
            raise GRPCError(Status.INVALID_ARGUMENT, f"Function {fn['function_name']} does not accept data format "
                                                     f"{data_format}")
        env: dict[str, str] = {}
        for secret_id in fn["secret_ids"]:
            env.update(self.secret_values(secret_id))
        input_id = new_id("in")
        containers.start(self.store, call_id, {
            "kind": "function", "app_id": fn["app_id"], "function_id": function_id, "input_id": input_id,
            "module_name": fn["module_name"], "function_name": fn["function_name"], "mount_ids": fn["mount_ids"],
            "env": env, "timeout": fn["timeout"], "created_at": time.time(), "cluster_size": fn.get("cluster_size", 1),
            "input": {"format": data_format, "data": base64.b64encode(item.input.args).decode()}})
        return api_pb2.FunctionPutInputsResponseItem(idx=item.idx, input_id=input_id, input_jwt=f"jwt-{input_id}")

    def rpc_FunctionMap(self, request: api_pb2.FunctionMapRequest) -> api_pb2.FunctionMapResponse:
        self.function(request.function_id)
        call_id = new_id("fc")
        self.store.put(call_id, {"kind": "function_call", "function_id": request.function_id})
        started = [self._start_input(request.function_id, call_id, item) for item in request.pipelined_inputs]
        return api_pb2.FunctionMapResponse(function_call_id=call_id, pipelined_inputs=started,
                                           function_call_jwt=f"jwt-{call_id}",
                                           retry_policy=api_pb2.FunctionRetryPolicy(retries=0))

    def rpc_FunctionPutInputs(self, request: api_pb2.FunctionPutInputsRequest) -> api_pb2.FunctionPutInputsResponse:
        if self.store.container_dir(request.function_call_id).exists():
            raise GRPCError(Status.INVALID_ARGUMENT, "the fake runs one input per function call")
        started = [self._start_input(request.function_id, request.function_call_id, item) for item in request.inputs]
        return api_pb2.FunctionPutInputsResponse(inputs=started)

    # -- observing and cancelling calls ------------------------------------------------------------

    def _call_spec(self, call_id: str) -> dict[str, Any]:
        spec = read_json(self.store.container_dir(call_id) / "spec.json")
        if spec is None or spec.get("kind") != "function":
            raise GRPCError(Status.NOT_FOUND, f"Function call {call_id} not found")
        return spec

    def rpc_FunctionCallFromId(self, request: api_pb2.FunctionCallFromIdRequest) -> api_pb2.FunctionCallFromIdResponse:
        spec = self._call_spec(request.function_call_id)
        return api_pb2.FunctionCallFromIdResponse(
            function_call_id=request.function_call_id, num_inputs=1,
            metadata=api_pb2.FunctionCallHandleMetadata(app_id=spec["app_id"], function_id=spec["function_id"]))

    def rpc_FunctionGetCallGraph(self, request: api_pb2.FunctionGetCallGraphRequest
                                 ) -> api_pb2.FunctionGetCallGraphResponse:
        """Best-effort and lagging, as documented (see the module docstring)."""
        spec = self._call_spec(request.function_call_id)
        lag = float(self.store.config.get("call_graph_lag", CALL_GRAPH_LAG))
        seen_at = time.time() - lag
        if spec["created_at"] > seen_at:
            return api_pb2.FunctionGetCallGraphResponse()
        ended = self.store.exit_of(request.function_call_id)
        status = 0  # PENDING
        if ended is not None and ended["ended_at"] <= seen_at:
            status = _INPUT_STATUS[ended["status"]]
        fn = self.store.get(spec["function_id"]) or {}
        return api_pb2.FunctionGetCallGraphResponse(
            inputs=[api_pb2.InputCallGraphInfo(input_id=spec["input_id"], status=status,
                                               function_call_id=request.function_call_id,
                                               task_id=containers.task_id_of(self.store, request.function_call_id))],
            function_calls=[api_pb2.FunctionCallCallGraphInfo(
                function_call_id=request.function_call_id, function_name=spec["function_name"],
                module_name=fn.get("module_name", ""))])

    async def rpc_FunctionGetOutputs(self, request: api_pb2.FunctionGetOutputsRequest
                                     ) -> api_pb2.FunctionGetOutputsResponse:
        """The call's output once its input ended (a long poll of `timeout` seconds). The result
        carries the status, exception and traceback; its data is CBOR `None` (the fake keeps no
        return values: diloco reads results from logs)."""
        spec = self._call_spec(request.function_call_id)
        deadline = time.monotonic() + min(request.timeout, 50.0)
        while True:
            result = containers.result_of(self.store, request.function_call_id)
            if result is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        if result is None:
            return api_pb2.FunctionGetOutputsResponse(num_unfinished_inputs=1, last_entry_id=request.last_entry_id)
        if result.status == api_pb2.GenericResult.GENERIC_STATUS_SUCCESS:
            result.data = b"\xf6"  # CBOR null
        item = api_pb2.FunctionGetOutputsItem(result=result, idx=0, input_id=spec["input_id"],
                                              data_format=api_pb2.DATA_FORMAT_CBOR,
                                              task_id=containers.task_id_of(self.store, request.function_call_id))
        return api_pb2.FunctionGetOutputsResponse(outputs=[item], idxs=[0], last_entry_id="1-0")

    def rpc_FunctionCallCancel(self, request: api_pb2.FunctionCallCancelRequest) -> Empty:
        """Cancel the call: its input ends TERMINATED and its containers are killed (an input that
        already ended keeps its result)."""
        self._call_spec(request.function_call_id)
        containers.kill(self.store, request.function_call_id, "terminated", 137)
        return Empty()
