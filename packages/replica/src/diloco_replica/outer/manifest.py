"""The model's manifest: what the run's flat θ holds, so it can be taken out with its names.

θ_global, the rounds and the checkpoints are one flat fp32 vector: the model's trainable
parameters, each flattened, in `model.parameters()` order (`modelview`). The manifest names
them: each parameter's name and shape in that order, written once per run at ``model.json``
(`diloco.store.runkeys.RunKeys.model`) by whichever replica starts first, create-only. `diloco export`
reads it to write the vector back out as named tensors (`export`).

A replica that finds a manifest of another model (names or shapes differ) stops with one line:
the store already holds a run of that id for another model, which the checkpoints' element count
alone would not catch when two models have the same number of parameters.

Names are the user's model's own: a (Distributed)DataParallel wrapper's ``module.`` and the
segments torch.compile (``_orig_mod``) and activation checkpointing
(``_checkpoint_wrapped_module``) insert, at the root or around a submodule, are not part of them,
so the export loads into the plain model, and replicas wrapped differently agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from diloco.errors import UserError
from diloco.store.runkeys import RunKeys
from diloco.store.objectstore import ObjectExists

FORMAT = 1
MAX_DIMS = 16
MAX_NAME = 1024
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})  # torch.compile's, checkpoint_wrapper's


class BadManifest(Exception):
    """A manifest object that is not one: malformed JSON, a field of the wrong kind, or shapes
    that do not add up to its element count."""


@dataclass(frozen=True)
class Manifest:
    """Each trainable parameter as (name, shape), in the flat vector's order."""

    parameters: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.parameters)

    def slices(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        """(name, shape, start, stop) of each parameter in the flat vector."""
        out, at = [], 0
        for name, shape in self.parameters:
            n = math.prod(shape)
            out.append((name, shape, at, at + n))
            at += n
        return out

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "numel": self.numel,
                           "parameters": [{"name": n, "shape": list(s)} for n, s in self.parameters]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse a manifest read from a store (trusted for nothing)."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadManifest(f"not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise BadManifest(f"not a format-{FORMAT} manifest")
        params, numel = doc.get("parameters"), doc.get("numel")
        if not isinstance(params, list) or not params or type(numel) is not int:
            raise BadManifest("'parameters' must be a non-empty list and 'numel' an integer")
        out, seen = [], set()
        for i, p in enumerate(params):
            name, shape = (p.get("name"), p.get("shape")) if isinstance(p, dict) else (None, None)
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or name in seen:
                raise BadManifest(f"parameter {i}: its name must be a unique non-empty string")
            if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                    or not all(type(d) is int and d >= 0 for d in shape)):
                raise BadManifest(f"parameter {name!r}: its shape must be a list of at most {MAX_DIMS} sizes >= 0")
            seen.add(name)
            out.append((name, tuple(shape)))
        manifest = cls(tuple(out))
        if manifest.numel != numel or numel < 1:
            raise BadManifest(f"its shapes hold {manifest.numel} values, not the 'numel' {numel} it states")
        return manifest


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside (Distributed)DataParallel and torch.compile wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            inner = model.module
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def plain_name(name: str) -> str:
    """A parameter's name without the segments wrappers insert inside the model."""
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def manifest_of(model: torch.nn.Module) -> Manifest:
    """The manifest of the parameters `modelview.model_view` syncs (trainable ones, same order)."""
    return Manifest(tuple((plain_name(name), tuple(p.shape)) for name, p in unwrapped(model).named_parameters()
                          if p.requires_grad))


def publish(store: Any, keys: RunKeys, manifest: Manifest, *, total: int | None = None) -> None:
    """Write the run's manifest, or check that the one there is this model's (UserError if not).
    `total`: the values the replica syncs, which the manifest must account for."""
    if total is not None and manifest.numel != total:
        raise ValueError(f"the manifest holds {manifest.numel} values, the replica syncs {total}")  # a bug of ours
    try:
        store.put(keys.model(), manifest.to_json(), create_only=True)
        return
    except ObjectExists:
        pass
    try:
        theirs = read(store, keys)
    except BadManifest as exc:
        raise UserError(f"{keys.model()} in the run's store is not a model manifest ({exc}); the rendezvous holds "
                        f"something else under run {keys.run!r}: use a new run id or another rendezvous") from None
    if theirs is not None and theirs != manifest:  # None: deleted between the two requests
        raise UserError(f"the rendezvous store already holds run {keys.run!r} of another model "
                        f"({_difference(theirs, manifest)}); use a new run or another rendezvous (or, if the "
                        f"model only renamed parameters, delete {keys.model()} to resume under the new names)")


def read(store: Any, keys: RunKeys) -> Manifest | None:
    """The run's manifest, None if it has none (BadManifest if the object is not one)."""
    raw = store.get(keys.model())
    return None if raw is None else Manifest.from_json(bytes(raw))


def _difference(theirs: Manifest, ours: Manifest) -> str:
    """The first parameter where two manifests differ, for the error line."""
    for i, (a, b) in enumerate(zip(theirs.parameters, ours.parameters)):
        if a != b:
            return f"parameter {i} is {a[0]} {list(a[1])} there, {b[0]} {list(b[1])} here"
    return f"{len(theirs.parameters)} parameters there, {len(ours.parameters)} here"
