"""The trained model out of the store: the run's manifest names θ's parameters, the run's last
round is checkpointed when training ends, and `diloco_replica.export` writes it as safetensors
that load into a fresh model with the bytes every replica ended on."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco.errors import UserError
from diloco.store.runkeys import RunKeys
from diloco.store.objectstore import open_store
from diloco_replica.export import export
from diloco_replica.outer.manifest import BadManifest, Manifest, manifest_of, publish, unwrapped


def mlp(dim: int) -> torch.nn.Sequential:
    """replica_jobs.mlp_rounds' model, built fresh."""
    return torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.Tanh(), torch.nn.Linear(4 * dim, 1))


def test_the_manifest_names_the_trainable_parameters_in_the_synced_order():
    model = mlp(3)
    model[0].bias.requires_grad_(False)  # frozen: not in θ_global, not in the manifest
    m = manifest_of(model)
    assert m.parameters == (("0.weight", (12, 3)), ("2.weight", (1, 12)), ("2.bias", (1,)))
    assert m.numel == 36 + 12 + 1
    assert [(a, b) for _, _, a, b in m.slices()] == [(0, 36), (36, 48), (48, 49)]
    assert Manifest.from_json(m.to_json()) == m

    class Compiled(torch.nn.Module):  # torch.compile's wrapper keeps the model as `_orig_mod`
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    assert unwrapped(Compiled(model)) is model and manifest_of(Compiled(model)) == m

    class Checkpointed(torch.nn.Module):  # activation checkpointing's wrapper around a submodule
        def __init__(self, inner):
            super().__init__()
            self._checkpoint_wrapped_module = inner

    nested = mlp(3)
    nested[0].bias.requires_grad_(False)
    nested[0], nested[2] = Compiled(nested[0]), Checkpointed(nested[2])  # 0._orig_mod.weight, ...
    assert manifest_of(torch.nn.DataParallel(nested)) == m  # every wrapper's segment left out, at any depth


@pytest.mark.parametrize("doc, problem", [
    (b"\xff", "not JSON"),
    (b"[]", "not a format-1 manifest"),
    (b'{"format": 2, "numel": 1, "parameters": [{"name": "w", "shape": [1]}]}', "not a format-1 manifest"),
    (b'{"format": 1, "numel": 1, "parameters": []}', "non-empty list"),
    (b'{"format": 1, "numel": "1", "parameters": [{"name": "w", "shape": [1]}]}', "non-empty list"),
    (b'{"format": 1, "numel": 2, "parameters": [{"name": "w", "shape": [1]}, {"name": "w", "shape": [1]}]}',
     "unique"),
    (b'{"format": 1, "numel": 1, "parameters": [{"name": "", "shape": [1]}]}', "unique non-empty"),
    (b'{"format": 1, "numel": 1, "parameters": [{"name": "w", "shape": [-1]}]}', "sizes >= 0"),
    (b'{"format": 1, "numel": 1, "parameters": [{"name": "w", "shape": [1.0]}]}', "sizes >= 0"),
    (b'{"format": 1, "numel": 1, "parameters": [{"name": "w", "shape": 1}]}', "sizes >= 0"),
    (b'{"format": 1, "numel": 5, "parameters": [{"name": "w", "shape": [2, 2]}]}', "hold 4 values, not"),
    (b'{"format": 1, "numel": 0, "parameters": [{"name": "w", "shape": [0]}]}', "hold 0 values"),
])
def test_a_manifest_from_the_store_is_trusted_for_nothing(doc, problem):
    with pytest.raises(BadManifest, match=problem):
        Manifest.from_json(doc)


def test_a_replica_of_another_model_is_stopped_by_the_manifest(tmp_path):
    store, keys = open_store((tmp_path / "store").as_uri()), RunKeys("run-1")
    publish(store, keys, manifest_of(mlp(3)))
    publish(store, keys, manifest_of(mlp(3)))  # the same model: agreed
    wide = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))  # 4·9 = 3·12: same count
    with pytest.raises(UserError, match=r"of another model \(parameter 0 is 0.weight \[12, 3\] there, 0.weight \[9, 4\]"):
        publish(store, keys, manifest_of(wide))
    store.put(RunKeys("run-2").model(), b"not a manifest")
    with pytest.raises(UserError, match="is not a model manifest"):
        publish(store, RunKeys("run-2"), manifest_of(mlp(3)))


def flat(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([tensors[name].reshape(-1) for name, _ in model.named_parameters()])


@pytest.mark.parametrize("exchange", ["thread", "process"])
def test_the_last_round_is_exported_and_loads_into_a_fresh_model(replicas, store_uri, tmp_path, exchange):
    """10 steps, a round every 2, checkpoints every 3 rounds: the run ends at round 5, which only
    the end of training checkpoints (from the round's thread, or its sync process); the export
    holds it, bit for bit what every replica ended on."""
    handles = replicas.launch("mlp_rounds", 2, rendezvous=store_uri, args={"steps": 10, "dim": 8},
                              settings={"sync_every": 2, "checkpoint_every": 3, "exchange": exchange})
    results = replicas.results(handles)
    assert {r["rounds"][-1]["round"] for r in results} == {5} and len({r["final"] for r in results}) == 1
    store = open_store(store_uri)

    out = export(store, replicas.run_id, tmp_path / "out")
    assert (out.round, out.rounds, out.tensors, out.parameters) == (5, [3, 5], 4, 8 * 32 + 32 + 32 + 1)
    tensors = load_file(out.path)
    model = mlp(8)
    model.load_state_dict(tensors, strict=True)  # every name and shape of the model, nothing else
    assert zlib.crc32(flat(tensors, model).numpy().tobytes()) == results[0]["final"]
    with open(out.path, "rb") as f:  # the safetensors header's metadata names what it holds
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    assert meta["diloco_run"] == replicas.run_id and meta["diloco_round"] == "5"
    assert meta["theta_digest"] == out.theta_digest

    older = export(store, replicas.run_id, tmp_path / "older", round_=3)  # an earlier checkpoint, on request
    assert older.round == 3 and results[0]["hashes"]["3"] != results[0]["final"]
    assert zlib.crc32(flat(load_file(older.path), model).numpy().tobytes()) == results[0]["hashes"]["3"]


def test_export_refuses_in_one_line_and_changes_nothing(replicas, store_uri, tmp_path, capsys):
    handles = replicas.launch("mlp_rounds", 1, rendezvous=store_uri, settings={"sync_every": 2, "checkpoint_every": 2},
                              args={"steps": 8, "dim": 4})
    replicas.results(handles)
    keys, store = RunKeys(replicas.run_id), open_store(store_uri)

    def run(*args: str) -> subprocess.CompletedProcess:  # the command as users run it, its own process
        return subprocess.run([sys.executable, "-m", "diloco_replica.export", store_uri, *args],
                              capture_output=True, text=True, timeout=120)

    def refused(*args: str) -> str:  # the same command's main(), in this process: its exit code, its stderr
        from diloco_replica.export import main

        capsys.readouterr()
        assert main([store_uri, *args]) == 2
        out, err = capsys.readouterr()
        assert not out and len(err.strip().splitlines()) == 1, err
        return err

    ok = run(replicas.run_id, str(tmp_path / "a"))
    assert ok.returncode == 0 and json.loads(ok.stdout)["round"] == 4
    assert refused(replicas.run_id, str(tmp_path / "a")).strip().endswith(
        "already exists; export to another --out directory, or remove it first")
    assert "has no complete checkpoint of round 1" in refused(replicas.run_id, str(tmp_path / "b"), "--round", "1")
    assert "has no model manifest" in refused("no-such-run", str(tmp_path / "c"))
    # a corrupt piece of the newest checkpoint: named, an older one suggested, nothing voided
    piece = next(k for k in (m["path"] for m in store.list(keys.checkpoint(4))) if not k.endswith("/void"))
    blob = bytearray(store.get(piece))
    blob[-1] ^= 0xFF
    store.put(piece, bytes(blob))
    bad = run(replicas.run_id, str(tmp_path / "d"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "checkpoint 4 of run" in bad.stderr and "try --round 2" in bad.stderr
    assert store.get(keys.checkpoint(4, "void")) is None and not (Path(tmp_path / "d") / "model.safetensors").exists()
