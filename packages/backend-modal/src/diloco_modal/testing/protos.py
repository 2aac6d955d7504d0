"""Building responses that fit the `modal_proto` the server runs with.

The server imports the modal_proto of the client installed next to it (floor or newest), and
messages gain fields between versions: `message` leaves out fields the running proto lacks.
"""

from __future__ import annotations

from typing import Any


def message(cls: Any, **fields: Any) -> Any:
    known = cls.DESCRIPTOR.fields_by_name
    return cls(**{k: v for k, v in fields.items() if k in known and v is not None})


def env_dict(request: Any) -> dict[str, str]:
    """A SecretGetOrCreate request's values: a map in older protos, repeated entries in newer."""
    entries = request.env_dict
    if hasattr(entries, "items"):
        return dict(entries.items())
    return {e.key: e.value for e in entries}
