"""`python -m diloco_modal.testing.call DIR`: one function input inside a container of the fake cloud.

What Modal's container runtime does with an input: import the function's module (mounted at
/root, on sys.path), decode the input the client sent, call the function's body, and report
how it ended. In a clustered function's container (DIR is then one of the call's nodes, see
`cluster`), the runtime first sets the SDK's cluster info, as Modal's does from its
TaskClusterHello answer: this container's rank, the cluster's id and its containers' addresses
(`modal.experimental.get_cluster_info()` then answers, as on Modal).

Like Modal's runtime, a `KeyboardInterrupt` (how a preemption's SIGINT surfaces) marks the
input as interrupted, so the container restarts it; any other exception is printed with its
traceback, as Modal logs it, and fails the input.

Decoding: the executor asks the client for CBOR payloads; a pickled input (an older client, or
`MODAL_PAYLOAD_FORMAT=pickle`) is unpickled here. That is acceptable only because this is the
test's own fake cloud deserializing the test's own input, exactly as Modal's runtime would:
diloco itself never unpickles anything it reads.
"""

from __future__ import annotations

import base64
import importlib
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

from modal_proto import api_pb2

from .store import read_json, write_json


def decode_input(payload: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    data = base64.b64decode(payload["data"])
    if payload["format"] == api_pb2.DATA_FORMAT_CBOR:
        import cbor2

        args, kwargs = cbor2.loads(data)
    elif payload["format"] in (api_pb2.DATA_FORMAT_PICKLE, api_pb2.DATA_FORMAT_UNSPECIFIED):
        args, kwargs = pickle.loads(data)  # noqa: S301 - the fake's own test input, see the module docstring
    else:
        raise ValueError(f"the fake decodes CBOR and pickle inputs only, got data format {payload['format']}")
    return list(args), dict(kwargs)


def _body(module_name: str, function_name: str) -> Any:
    obj: Any = importlib.import_module(module_name)
    for part in function_name.split("."):
        obj = getattr(obj, part)
    if hasattr(obj, "spawn"):  # the decorated modal.Function: its Python body, as Modal's runtime calls it
        from modal._utils.async_utils import synchronizer

        return synchronizer._translate_in(obj)._raw_f
    return obj


def enter_cluster(cluster: dict[str, Any]) -> None:
    """Set the installed SDK's cluster info, where its runtime keeps it: `modal._cluster` (1.6 and
    later) or `modal._clustered_functions` (1.5); loudly, for an SDK that keeps it elsewhere."""
    fields = {"rank": cluster["rank"], "cluster_id": cluster["cluster_id"],
              "container_ips": list(cluster["container_ips"]), "container_ipv4_ips": list(cluster["container_ips"]),
              "fabric_ids": []}
    try:
        from modal import _cluster as newer
    except ImportError:
        newer = None
    if newer is not None and hasattr(newer, "current_cluster_context"):
        newer.current_cluster_context = newer.ClusterContext(**fields)
        return
    from modal import _clustered_functions as older

    if not hasattr(older, "cluster_info"):
        raise RuntimeError("diloco's fake Modal cloud does not know where this modal client keeps its cluster info: "
                           "teach diloco_modal.testing.call.enter_cluster")
    older.cluster_info = older.ClusterInfo(**fields)


def main(obj_dir: Path) -> int:
    spec = read_json(obj_dir / "spec.json")
    outcome: dict[str, Any]
    try:
        if "rank" in spec.get("cluster", {}):
            enter_cluster(spec["cluster"])
        args, kwargs = decode_input(spec["input"])
        body = _body(spec["module_name"], spec["function_name"])
        result = body(*args, **kwargs)
        outcome = {"status": "success", "result_type": type(result).__name__}
    except KeyboardInterrupt:
        outcome = {"status": "interrupted"}
    except BaseException as exc:  # noqa: BLE001 - every failure of the body fails the input, as on Modal
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        outcome = {"status": "failure", "exception": repr(exc), "traceback": tb}  # Modal keeps repr(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    write_json(obj_dir / "outcome.json", outcome)
    return 0 if outcome["status"] == "success" else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
