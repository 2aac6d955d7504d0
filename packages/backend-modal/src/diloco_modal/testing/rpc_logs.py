"""The fake Modal server's log RPC: `AppFetchLogs`, what `Sandbox.logs.tail(n)` and
`FunctionCall.logs.tail(n)` send (an app, a filter by task or function call, a time window and a
limit on the number of entries).

An entry is a raw chunk of a container's output, as the container captured it (see
`container`): `tail(n)` therefore returns the last n chunks, not the last n lines.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

from modal_proto import api_pb2

from .protos import message
from .store import read_json, read_jsonl


def _seconds(ts: Any) -> float:
    return ts.seconds + ts.nanos / 1e9


class LogRpcs:
    store: Any

    def _log_rows(self, request: api_pb2.AppFetchLogsRequest) -> list[dict[str, Any]]:
        rows = []
        for object_id in self.store.container_ids():
            obj = self.store.container_dir(object_id)
            spec = read_json(obj / "spec.json", {})
            if spec.get("app_id") != request.app_id:
                continue
            if request.function_call_id and object_id != request.function_call_id:
                continue
            if request.sandbox_id and object_id != request.sandbox_id:
                continue
            if request.function_id and spec.get("function_id") != request.function_id:
                continue
            for row in read_jsonl(obj / "logs.jsonl"):
                if request.task_id and row["task_id"] != request.task_id:
                    continue
                if request.source and row["fd"] != request.source:
                    continue
                rows.append({**row, "object_id": object_id, "kind": spec.get("kind")})
        return rows

    def rpc_AppFetchLogs(self, request: api_pb2.AppFetchLogsRequest) -> api_pb2.AppFetchLogsResponse:
        """The most recent `limit` entries in [since, until), oldest first, batched by task."""
        since = _seconds(request.since) if request.HasField("since") else 0.0
        until = _seconds(request.until) if request.HasField("until") else float("inf")
        rows = [r for r in self._log_rows(request) if since <= r["t"] / 1e9 < until]
        rows.sort(key=lambda r: r["t"])
        if request.limit:
            rows = rows[-request.limit:]
        batches = []
        for i, ((task_id, object_id), group) in enumerate(groupby(rows, key=lambda r: (r["task_id"], r["object_id"]))):
            group = list(group)
            call_id = object_id if group[0]["kind"] == "function" else ""
            items = [message(api_pb2.TaskLogs, data=r["data"], file_descriptor=r["fd"], timestamp=r["t"] / 1e9,
                             timestamp_ns=r["t"], function_call_id=call_id, input_id=r.get("input_id", ""),
                             container_id=task_id) for r in group]
            batches.append(message(api_pb2.TaskLogsBatch, task_id=task_id, items=items,
                                   entry_id=f"{group[-1]['t']}-{i}", input_id=group[0].get("input_id", ""),
                                   sandbox_id=object_id if not call_id else ""))
        return api_pb2.AppFetchLogsResponse(batches=batches)
