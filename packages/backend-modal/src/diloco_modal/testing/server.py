"""`python -m diloco_modal.testing.server ROOT`: a fake Modal control plane the real modal client talks to.

A gRPC servicer of the `ModalClient` service from the `modal_proto` package the client ships,
served with grpclib on 127.0.0.1 (as modal-client's own tests stand the cloud in), so every call
diloco makes goes through the real client: its argument checks, its request building, its
retries, its error mapping. The client is pointed here with `MODAL_SERVER_URL` and a token
(`MODAL_TOKEN_ID` / `MODAL_TOKEN_SECRET`); `FakeModal` (in `diloco_modal.testing`) starts this
process and gives tests those settings.

An RPC the fake implements is a method `rpc_<Name>(request) -> response` (or `stream_<Name>`,
an async generator, for a server stream) on one of the mixins, one concern each:
`rpc_apps` (hello, tokens, apps, deploys), `rpc_build` (images, mounts, secrets, volumes),
`rpc_sandboxes`, `rpc_functions`, `rpc_logs`. Every other RPC of the service answers
UNIMPLEMENTED with its name and is written to `unimplemented.jsonl`, which the test fixtures
assert empty: a code path that reaches an RPC the fake does not know fails the test loudly.
Every answered RPC is written, with its request, to `rpcs.jsonl` (what tests assert on), and its
request's serialized bytes to `raw/<Name>.bin` (what tests search for a secret's value; file
uploads, `MountPutFile`, are left out: they are the shipped files, checked by hash).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from grpclib import GRPCError, Status
from grpclib.events import RecvRequest, listen
from grpclib.server import Server
from modal_proto import api_grpc

from .rpc_apps import AppRpcs
from .rpc_build import BuildRpcs
from .rpc_functions import FunctionRpcs
from .rpc_logs import LogRpcs
from .rpc_sandboxes import SandboxRpcs
from .store import TOKEN, Store, append_jsonl, write_json


_RAW_LEFT_OUT = {"MountPutFile"}  # file contents: large, and checked by hash instead


def _without_bytes(message: Any) -> dict[str, Any]:
    """The request as JSON, each bytes field replaced by its length (file contents, pickles)."""
    copy = type(message)()
    copy.CopyFrom(message)
    sizes: dict[str, int] = {}

    def repeated(field: Any) -> bool:
        flag = getattr(field, "is_repeated", None)  # newer protobuf; `label` before
        return flag if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED

    def strip(msg: Any, path: str) -> None:
        for field, value in msg.ListFields():
            where = f"{path}{field.name}"
            if field.type == FieldDescriptor.TYPE_BYTES:
                if repeated(field):
                    sizes[where] = sum(len(v) for v in value)
                else:
                    sizes[where] = len(value)
                msg.ClearField(field.name)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                if repeated(field):
                    if not (field.message_type.GetOptions().map_entry):
                        for i, item in enumerate(value):
                            strip(item, f"{where}[{i}].")
                else:
                    strip(value, f"{where}.")

    strip(copy, "")
    out = MessageToDict(copy, preserving_proto_field_name=True)
    if sizes:
        out["_bytes"] = sizes
    return out


class FakeModalServicer(AppRpcs, BuildRpcs, SandboxRpcs, FunctionRpcs, LogRpcs, api_grpc.ModalClientBase):
    """The ModalClient service, as much of it as diloco's calls reach (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.store = Store(root)
        self.client_versions: set[str] = set()

    def _record(self, name: str, request: Any) -> None:
        self.store.record_rpc(name, _without_bytes(request))
        if name not in _RAW_LEFT_OUT:
            self.store.record_raw(name, request.SerializeToString())

    async def recv_request(self, event: RecvRequest) -> None:
        """Modal's checks on every call: a client type and version, and a valid token."""
        md = event.metadata
        version = md.get("x-modal-client-version")
        if not version or "x-modal-client-type" not in md:
            raise GRPCError(Status.FAILED_PRECONDITION, "Missing x-modal-client-version or x-modal-client-type")
        if version not in self.client_versions:
            self.client_versions.add(version)
            self.store.configure(client_versions=sorted(self.client_versions))
        token = tuple(self.store.config.get("token") or TOKEN)
        if (md.get("x-modal-token-id"), md.get("x-modal-token-secret")) != token:
            raise GRPCError(Status.UNAUTHENTICATED, "Invalid token. If you have token credentials, see "
                                                    "modal.com/docs/reference/modal.config for setup help.")


def _failing_loudly(name: str, handler: Any):
    """A bug in the fake itself is written to errors.jsonl (the fixtures assert it empty) and
    answered INTERNAL, never mistaken for Modal's behaviour."""
    async def guarded(self: FakeModalServicer, stream: Any) -> None:
        try:
            await handler(self, stream)
        except GRPCError:
            raise
        except Exception as exc:
            append_jsonl(self.store.root / "errors.jsonl", {"rpc": name, "error": traceback.format_exc()})
            raise GRPCError(Status.INTERNAL, f"bug in diloco's fake Modal server ({name}): {exc!r}") from exc
    guarded.__name__ = name
    return guarded


def _unary(name: str, impl: Any):
    async def handler(self: FakeModalServicer, stream: Any) -> None:
        request = await stream.recv_message()
        self._record(name, request)
        response = impl(self, request)
        if inspect.isawaitable(response):
            response = await response
        await stream.send_message(response)
    return _failing_loudly(name, handler)


def _server_stream(name: str, impl: Any):
    async def handler(self: FakeModalServicer, stream: Any) -> None:
        request = await stream.recv_message()
        self._record(name, request)
        async for response in impl(self, request):
            await stream.send_message(response)
    return _failing_loudly(name, handler)


def _unimplemented(name: str):
    async def handler(self: FakeModalServicer, stream: Any) -> None:
        append_jsonl(self.store.root / "unimplemented.jsonl", {"rpc": name})
        raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not implemented by diloco's fake Modal server "
                                              f"(diloco_modal.testing): implement rpc_{name} or avoid the call")
    handler.__name__ = name
    return handler


def _wire(cls: type) -> type:
    """Every abstract RPC of ModalClientBase becomes a handler: ours, or a loud UNIMPLEMENTED."""
    for name in sorted(api_grpc.ModalClientBase.__abstractmethods__):
        if hasattr(cls, f"rpc_{name}"):
            setattr(cls, name, _unary(name, getattr(cls, f"rpc_{name}")))
        elif hasattr(cls, f"stream_{name}"):
            setattr(cls, name, _server_stream(name, getattr(cls, f"stream_{name}")))
        else:
            setattr(cls, name, _unimplemented(name))
    cls.__abstractmethods__ = frozenset()
    return cls


_wire(FakeModalServicer)


def implemented_rpcs() -> list[str]:
    """The ModalClient RPCs the fake answers (the README lists them)."""
    return sorted(n for n in api_grpc.ModalClientBase.__abstractmethods__
                  if hasattr(FakeModalServicer, f"rpc_{n}") or hasattr(FakeModalServicer, f"stream_{n}"))


async def serve(root: Path) -> None:
    servicer = FakeModalServicer(root)
    server = Server([servicer])
    listen(server, RecvRequest, servicer.recv_request)
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    write_json(Path(root) / "server.json", {"url": f"http://127.0.0.1:{port}", "pid": os.getpid()})
    await stop.wait()
    server.close()
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1])))
