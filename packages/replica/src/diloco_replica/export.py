"""`diloco export`: a run's global model out of its store, as named tensors in a safetensors file.

The store holds θ_global as checkpoint pieces of one flat fp32 vector (`checkpoints`) and, beside
them, the model's manifest (`manifest`): each trainable parameter's name and shape in the
vector's order. Export loads one complete checkpoint — the newest by default, which is the run's
last round once its training has ended (`GlobalState.checkpoint_last`) — and writes each
parameter as its own fp32 tensor under its name to ``<out>/model.safetensors``, so
``model.load_state_dict(safetensors.torch.load_file(path), strict=False)`` restores the trained
weights into a fresh model of the same code (buffers and frozen parameters are not part of
θ_global: they stay the model's own). The file's metadata names the run, the round and θ's
digest (`DiLoCo.theta_digest`, the one every replica reports). Where a trainer integration
stored the model's own configuration (`modelconfig`: a transformers ``config.json``), it is
written beside the weights, and the directory loads with the library's ``from_pretrained``.

It only reads: a corrupt piece fails the export with one line naming it (a replica that met it
would void the checkpoint; this reader changes nothing in the run's store).

Run by the launcher's `diloco export` as ``python -m diloco_replica.export`` (core never imports
torch): one JSON line on stdout when it worked, one ``error: ...`` line on stderr and exit 2
when it did not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.errors import UserError
from diloco.store.runkeys import RunKeys

from .round.checkpoints import Checkpoints
from .round.lanes import Lanes
from .outer.manifest import BadManifest, Manifest
from .outer.manifest import read as read_manifest
from .outer.modelconfig import CONFIG_FILE, BadConfig
from .outer.modelconfig import read as read_config
from .outer.step import blocks_digest
from .round.io import RoundIO
from .round.storeaccess import CountingStore

FILE = "model.safetensors"
READ_TIMEOUT = 60.0  # seconds; export polls nothing, the round settings only fill RoundIO


@dataclass(frozen=True)
class Exported:
    """What `export` wrote."""

    run: str
    round: int
    rounds: list[int]        # every complete checkpoint the store holds (the one taken among them)
    path: str
    config: str | None       # the model's configuration written beside it, if the run stored one
    tensors: int
    parameters: int          # values in θ_global
    theta_digest: str        # `DiLoCo.theta_digest` of what was written


def export(store: Any, run_id: str, out: str | Path, *, round_: int | None = None, log=None) -> Exported:
    """Write checkpoint `round_` (default: the newest complete one) of run `run_id` in `store`
    to ``<out>/model.safetensors``; refuses to replace a file already there."""
    from safetensors.numpy import save_file

    keys = RunKeys(run_id)
    manifest = _manifest(store, keys)
    try:
        config = read_config(store, keys)
    except BadConfig as exc:
        raise UserError(f"{keys.model_config()} in {store.uri} is not a model configuration ({exc})") from None
    targets = [Path(out) / FILE] + ([Path(out) / CONFIG_FILE] if config is not None else [])
    for target in targets:
        if target.exists():
            raise UserError(f"{target} already exists; export to another --out directory, or remove it first")
    try:  # before the download: an --out that cannot be written fails at once
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the --out directory {out}: {exc.strerror or exc}") from None
    with ThreadPoolExecutor(4, thread_name_prefix="diloco-export") as pool:
        io = RoundIO(CountingStore(store), keys, Lanes(), pool, run_id, rank=0, n=1, round_timeout=READ_TIMEOUT,
                     poll_interval=1.0, poll_max=1.0, log=log or (lambda msg: None))
        checkpoints = Checkpoints(io, manifest.numel)
        complete = checkpoints.complete()
        if not complete:
            raise UserError(f"run {run_id!r} has no complete checkpoint in {store.uri} yet (its first is written at "
                            f"round 0, when a replica starts)")
        r = complete[-1] if round_ is None else round_
        if r not in complete:
            raise UserError(f"run {run_id!r} has no complete checkpoint of round {r} in {store.uri}; "
                            f"it has rounds {_listed(complete)}")
        loaded = checkpoints.load(r, 0, manifest.numel, void=False)
        if loaded is None:
            older = [c for c in complete if c < r]
            raise UserError(f"checkpoint {r} of run {run_id!r} could not be read whole (a piece is corrupt or was "
                            f"deleted while reading); " + (f"try --round {older[-1]}" if older else "no older one"))
    theta = loaded[0]
    digest = f"{blocks_digest(theta, 0):016x}"
    flat = theta.numpy()
    tensors = {name: flat[a:b].reshape(shape) for name, shape, a, b in manifest.slices()}
    _write_new(targets[0], lambda tmp: save_file(tensors, tmp, metadata={
        "diloco_run": run_id, "diloco_round": str(r), "theta_digest": digest, "format": "pt"}))
    if config is not None:
        _write_new(targets[1], lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
    return Exported(run_id, r, complete, str(targets[0]), str(targets[1]) if config is not None else None,
                    len(tensors), manifest.numel, digest)


def _write_new(target: Path, write) -> None:
    """`write(tmp)` a file, then give it `target`'s name, create-only: whole or not at all (an
    interrupted export leaves no half a model under the real name), a file that appeared
    meanwhile kept, not replaced, and the permissions of a file the user created."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=target.suffix)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's is 0600
        os.link(tmp, target)
    except FileExistsError:
        raise UserError(f"{target} appeared while exporting; export to another --out directory") from None
    except OSError as exc:
        raise UserError(f"writing {target} failed: {exc.strerror or exc}") from None
    finally:
        os.unlink(tmp)


def _manifest(store: Any, keys: RunKeys) -> Manifest:
    try:
        manifest = read_manifest(store, keys)
    except BadManifest as exc:
        raise UserError(f"{keys.model()} in {store.uri} is not a model manifest ({exc})") from None
    if manifest is None:
        raise UserError(f"run {keys.run!r} has no model manifest ({keys.model()}) in {store.uri}: no replica of "
                        f"diloco-replica 0.3 or later has started in it, or this is not the run's store")
    return manifest


def _listed(rounds: list[int]) -> str:
    return ", ".join(map(str, rounds)) if len(rounds) <= 12 else f"{rounds[0]} … {rounds[-1]} ({len(rounds)} in all)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_replica.export", description=__doc__.split("\n")[0])
    parser.add_argument("store", help="the run's rendezvous URI")
    parser.add_argument("run", help="the run's id")
    parser.add_argument("out", help="the directory to write model.safetensors (and config.json) into")
    parser.add_argument("--round", dest="round_", type=int, default=None)
    args = parser.parse_args(argv)
    from diloco.store.objectstore import open_store

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    try:
        if args.round_ is not None and args.round_ < 0:
            raise UserError(f"--round {args.round_}: a round is 0 or more")
        result = export(open_store(args.store), args.run, args.out, round_=args.round_)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # the store refused or failed: one line, never a traceback
        print(f"error: reading run {args.run!r} from {args.store} failed: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
