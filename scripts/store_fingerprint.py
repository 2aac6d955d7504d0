"""The store's keys and bytes, fingerprinted: proof that a refactor changed no object a run writes.

    .venv/bin/python scripts/store_fingerprint.py --out before.json     # on the old tree
    .venv/bin/python scripts/store_fingerprint.py --out after.json      # on the new tree
    .venv/bin/python scripts/store_fingerprint.py --compare before.json after.json

Each scenario (the sync modes a refactor of the round path can break: fp32, int8 with error
feedback, int4, topk, fragments with an overlapped exchange, the sync process) trains three
replicas of a small MLP in this process (one thread each, a file:// store, the same seeds) to its
end, three times. Every object is fingerprinted by the SHA-256 of its bytes (a wire object's
header without the field that names which replica won a race) and by the shape of its JSON (every
key path and the type under it). An object whose bytes differ between runs of the same code
(timings, hosts, process ids) is compared by its shape alone; one that only some runs wrote (a
summary written in the background as the run closes) is not compared. `--compare` passes when
both files have the same keys, the same bytes where both sides were stable, and the same shapes.

It uses only public names (`diloco.ReplicaContext`, `diloco_replica.DiLoCo`), so the same script
runs against any tree: put the tree's src folders first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import tempfile
import threading
from pathlib import Path

SCENARIOS = {
    "fp32": {},
    "int8": {"transport": "int8"},
    "int4": {"transport": "int4"},
    "topk": {"transport": "topk", "topk_density": 0.05},
    "fragments-overlap": {"fragments": 2, "overlap": True, "overlap_delay": 1},
    "sync-process": {"exchange": "process"},
}
REPLICAS, H, ROUNDS = 3, 4, 3
RUNS = 3  # runs of each scenario: what differs between them varies with timing, not with the code


def model():
    """The same θ_0 on every replica, built in the main thread (torch's global generator is shared)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))


def train(rank: int, model, root: Path, settings: dict, errors: list) -> None:
    try:
        import torch

        from diloco import ReplicaContext
        from diloco_replica import DiLoCo

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx = ReplicaContext(rank, REPLICAS, "fingerprint", rendezvous=f"file://{root}")
        diloco = DiLoCo(model, opt, ctx, sync_every=H, total_steps=H * ROUNDS, round_timeout=120.0,
                        **{"exchange": "thread", **settings})
        for step in diloco.steps():
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(16, 64, generator=g)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
        diloco.close()
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        errors.append(f"rank {rank}: {type(e).__name__}: {e}")


def run_once(settings: dict) -> dict[str, bytes]:
    import torch

    torch.set_num_threads(1)  # one order of summation inside every kernel, run after run
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        errors: list[str] = []
        threads = [threading.Thread(target=train, args=(r, model(), root, settings, errors)) for r in range(REPLICAS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit("a replica failed: " + "; ".join(errors))
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def shape(value, path: str = "") -> list[str]:
    """Every key path of a JSON value with the type found there."""
    if isinstance(value, dict):
        return [s for k in sorted(value) for s in shape(value[k], f"{path}/{k}")]
    if isinstance(value, list):
        return [s for i, v in enumerate(value) for s in shape(v, f"{path}[{i}]")]
    return [f"{path}:{type(value).__name__}"]


def canonical(data: bytes) -> tuple[bytes, object]:
    """The bytes that must not change, and the JSON whose shape stands for them where they vary.

    A wire object (b"DLCO", version, u32 header length, u64 header hash, header JSON, payload) is
    its header without `meta.decided_by` (which replica's create-only write won the round's
    membership: a race, run to run) and its payload; the header hash goes with the field."""
    if data[:4] == b"DLCO" and len(data) >= 17:
        (length,) = struct.unpack_from("<I", data, 5)
        header = json.loads(data[17:17 + length])
        if isinstance(header.get("meta"), dict):
            header["meta"].pop("decided_by", None)
        return json.dumps(header, sort_keys=True).encode() + data[17 + length:], header
    try:
        return data, json.loads(data)
    except ValueError:
        return data, None


def fingerprint(runs: list[dict[str, bytes]]) -> dict[str, object]:
    out: dict[str, object] = {}
    keys = set().union(*runs)
    for key in sorted(keys):
        if any(key not in run for run in runs):  # written in some runs of the same code, not all
            out[key] = {"sometimes": True}
            continue
        forms = [canonical(run[key]) for run in runs]
        out[key] = {"sha256": hashlib.sha256(forms[0][0]).hexdigest(),
                    "shape": shape(forms[0][1]) if forms[0][1] is not None else len(forms[0][0]),
                    "stable": all(f[0] == forms[0][0] for f in forms)}
    return out


def compare(a: dict, b: dict) -> list[str]:
    """Differences: a key only one side wrote every time, a stable object whose bytes changed, or
    an object that varies (on either side) whose shape changed."""
    problems = []
    for scenario in sorted(set(a) | set(b)):
        x, y = a.get(scenario, {}), b.get(scenario, {})
        for key in sorted(set(x) | set(y)):
            u, v = x.get(key), y.get(key)
            if u is None or v is None:
                if not (u or v).get("sometimes"):
                    problems.append(f"{scenario}: {key} only in {'the first' if v is None else 'the second'}")
            elif u.get("sometimes") or v.get("sometimes"):
                continue
            elif u["stable"] and v["stable"]:
                if u["sha256"] != v["sha256"]:
                    problems.append(f"{scenario}: {key}: different bytes")
            elif u["shape"] != v["shape"]:
                problems.append(f"{scenario}: {key}: a different shape")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run these scenarios alone")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        problems = compare(a, b)
        counts = {s: len(v) for s, v in a.items()}
        stable = sum(bool(v.get("stable")) for s in a.values() for v in s.values())
        print(f"{sum(counts.values())} objects in {len(a)} scenarios ({stable} byte-stable): "
              + ("the same keys, bytes and shapes" if not problems else f"{len(problems)} differences"))
        for p in problems:
            print("  " + p)
        sys.exit(1 if problems else 0)
    result = {}
    for name in args.only or SCENARIOS:
        settings = SCENARIOS[name]
        result[name] = fingerprint([run_once(settings) for _ in range(RUNS)])
        varies = sum(not v.get("stable") for v in result[name].values())
        print(f"{name}: {len(result[name])} objects, {varies} vary between runs of the same code", flush=True)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
