"""The messages between a training process and its sync process: JSON, one per frame.

Framed by `multiprocessing.connection` (`send_bytes`/`recv_bytes`), never pickled: the sync
process is ours, but nothing that arrives is trusted, and JSON is all the requests need.
"""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any

def send(conn: Connection, op: str, **fields: Any) -> None:
    conn.send_bytes(json.dumps({"op": op, **fields}).encode())


def receive(conn: Connection) -> dict[str, Any]:
    msg = json.loads(conn.recv_bytes())
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError(f"malformed message from the other process: {str(msg)[:200]}")
    return msg
