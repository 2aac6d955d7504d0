"""How a function call (function mode) is doing, read without unpickling anything.

The SDK offers two ways to ask, and neither can decide whether a call ended:
- `FunctionCall.get(timeout=0)` unpickles whatever the call returned, and diloco unpickles
  nothing it reads from a network;
- `FunctionCall.get_call_graph()` is documented as best-effort and not real time: right after a
  spawn it is empty, and it can show an ended call as pending (or a running one as absent) for
  a while. Reading "absent" as failed relaunched a rank whose first call still ran, and made
  cancel skip that call, leaving its GPU container running.

The authoritative record is the call's output, which `get()` reads first: `FunctionGetOutputs`
with `timeout=0` and `clear_on_success=False` returns, once the input ended, its GenericResult
(status, exception, traceback, and the return value's bytes, which are never deserialized).
`outcome` sends that same request through the call's own client and reads only the status;
the call graph then only tells a call waiting for a container (PENDING) from one running. If
the SDK no longer exposes that RPC, the call graph is read alone, and only its terminal
statuses count as ended: an empty or lagging graph reads as running, never as failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from diloco.protocol import ReplicaStatus

from . import results

# GenericResult statuses (modal_proto.api_pb2.GenericResult.GENERIC_STATUS_*), as `modal.types.InputStatus` names them.
_ENDED = {"SUCCESS": ReplicaStatus.SUCCEEDED, "TERMINATED": ReplicaStatus.CANCELLED, "FAILURE": ReplicaStatus.FAILED,
          "INIT_FAILURE": ReplicaStatus.FAILED, "TIMEOUT": ReplicaStatus.FAILED,
          "INTERNAL_FAILURE": ReplicaStatus.FAILED}
TIMEOUT_EXIT = 124


@dataclass(frozen=True)
class Outcome:
    status: ReplicaStatus
    exit_code: int | None = None  # known for a timeout (124) and a failure of run_replica
    exception: str = ""


def _output_reader():
    """A blocking function(call) -> GenericResult | None, through the modal client's own stub."""
    from modal._utils.async_utils import synchronize_api
    from modal_proto import api_pb2

    async def read_output(call: Any) -> Any:
        await call.hydrate()
        request = api_pb2.FunctionGetOutputsRequest(function_call_id=call.object_id, timeout=0,
                                                    last_entry_id="0-0", clear_on_success=False,
                                                    requested_at=time.time())
        response = await call._client._stub.FunctionGetOutputs(request)
        return response.outputs[0].result if response.outputs else None

    return synchronize_api(read_output, target_module=__name__)


_reader: Any = None


def _output(call: Any) -> Any:
    global _reader
    if _reader is None:
        _reader = _output_reader()
    return _reader(call)


def _status_name(value: Any) -> str:
    """A GenericResult status's name; one this client's proto does not know (Modal added it since)
    is named, not raised on."""
    from modal_proto import api_pb2

    try:
        return api_pb2.GenericResult.GenericStatus.Name(value).removeprefix("GENERIC_STATUS_")
    except ValueError:
        return f"UNKNOWN_{value}"


def from_result(result: Any) -> Outcome:
    """How a call ended, from its output record: an output means the input ended, so a status
    this client does not know reads as failed. The exit code is the replica's only when the call
    failed with `run_replica`'s own exception (`results.replica_exit_code`), never log text."""
    name = _status_name(result.status)
    code = TIMEOUT_EXIT if name == "TIMEOUT" else results.replica_exit_code(result.exception)
    return Outcome(_ENDED.get(name, ReplicaStatus.FAILED), code, result.exception)


def from_graph(graph: list[Any], call_id: str) -> Outcome:
    """The call graph alone: its terminal statuses end the call; absent or PENDING is not an end."""
    mine = [i for i in graph if getattr(i, "function_call_id", None) == call_id]
    if not mine:
        return Outcome(ReplicaStatus.PENDING)  # not in the graph yet: unknown, so not ended
    info = mine[0]
    name = getattr(info.status, "name", str(info.status))
    if name in _ENDED:
        return Outcome(_ENDED[name], TIMEOUT_EXIT if name == "TIMEOUT" else None)
    return Outcome(ReplicaStatus.RUNNING if info.task_id else ReplicaStatus.PENDING)


def outcome(call: Any) -> Outcome:
    """The call's status: its output if it has one (authoritative), else what the graph says."""
    try:
        result = _output(call)
    except (AttributeError, ImportError):  # an SDK without this RPC path: the graph alone
        result = None
    if result is None:
        return from_graph(call.get_call_graph(), call.object_id)
    return from_result(result)
