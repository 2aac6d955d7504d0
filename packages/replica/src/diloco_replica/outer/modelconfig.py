"""The model's own configuration in the run's store, beside its manifest.

The manifest (`manifest`) names θ's tensors; it does not say how to build the model they belong
to. A trainer integration that knows the model's library writes that library's configuration
once per run (a transformers ``config.json``: `integrations.transformers`) at
`diloco.store.runkeys.RunKeys.model_config`, create-only, and `diloco export` writes it beside the
weights, so the export is a directory the library loads (``from_pretrained``).

Read from a store, so not trusted: one JSON object of at most `MAX_BYTES`, its ``model_type`` a
string where it has one; it is parsed and written out again, never executed or unpickled.
"""

from __future__ import annotations

import json
from typing import Any

from diloco.store.runkeys import RunKeys
from diloco.store.objectstore import ObjectExists

CONFIG_FILE = "config.json"  # what export names it: the name from_pretrained reads
MAX_BYTES = 1 << 20  # a transformers config.json is a few kB; anything near a MiB is not one


class BadConfig(ValueError):
    """The object at `RunKeys.model_config` is not a model configuration."""


def publish(store: Any, keys: RunKeys, config: dict[str, Any]) -> None:
    """Write the run's model configuration unless one is there (the first replica's stays: the
    manifest has already proven every replica trains the same model)."""
    data = json.dumps(config, sort_keys=True).encode()
    if len(data) > MAX_BYTES:
        raise ValueError(f"the model's configuration is {len(data)} bytes, over {MAX_BYTES}")
    try:
        store.put(keys.model_config(), data, create_only=True)
    except ObjectExists:
        pass


def parse(data: bytes) -> dict[str, Any]:
    """The configuration in `data`, checked (BadConfig if it is not one)."""
    if len(data) > MAX_BYTES:
        raise BadConfig(f"{len(data)} bytes, over {MAX_BYTES}")
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadConfig(f"not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadConfig(f"a JSON {type(config).__name__}, not an object")
    if "model_type" in config and not isinstance(config["model_type"], str):
        raise BadConfig("its model_type is not a string")
    return config


def read(store: Any, keys: RunKeys) -> dict[str, Any] | None:
    """The run's model configuration, None if it has none (BadConfig if the object is not one)."""
    raw = store.get(keys.model_config())
    return None if raw is None else parse(bytes(raw))
