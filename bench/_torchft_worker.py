"""One torchft DiLoCo replica for bench/peers.py; runs in the bench's own torchft venv, never in diloco's.

The same training as examples/tiny-lm/tiny_lm.py's `train` (its model, data, batches, learning-
rate schedule and evaluation are imported from it, and its settings are read from the very spec
the diloco side runs, so the two sides cannot drift apart): inner AdamW (diloco_replica's
`inner_optimizer` settings), outer SGD-Nesterov at the spec's outer lr and momentum, H inner
steps a round, the example's thread count. torchft's side of it is the setup its own tests use: a TCPStore per replica group, a
`Manager` on a gloo process group with a synchronous quorum (DiLoCo refuses an async one), and
`DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=H)` around the loop, which syncs
inside the inner optimizer's step every H steps.

It writes JSON lines to --events (appended, one per line, flushed): `up` once its Manager is
running, `round` after every sync (wall-clock time, whether it committed, participants, the
step's seconds), `done` with its eval loss (replica 0) and median inner step. A restarted
replica (--rejoin) skips the start barrier: the bench relaunches it into a running job, as a
scheduler would (torchft leaves relaunching to the user).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a restart's seconds to rejoin are mostly theirs

import argparse
import inspect
import json
import statistics
import sys
import tomllib
import zlib
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples" / "tiny-lm"), str(ROOT / "packages" / "core" / "src")]

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import Manager  # noqa: E402
from torchft.local_sgd import DiLoCo  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

import tiny_lm  # noqa: E402

# diloco_replica.inner_optimizer's settings (that package is not importable in this venv)
INNER_WEIGHT_DECAY, INNER_BETAS = 0.1, (0.9, 0.95)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", type=Path, required=True, help="the diloco side's spec: [args] and [diloco] are read")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--timeout-s", type=float, required=True, help="the Manager's and gloo's timeout")
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--go", type=Path, required=True, help="the start barrier: a file the bench creates")
    p.add_argument("--rejoin", action="store_true")
    return p.parse_args()


def training(spec: dict) -> dict:
    """tiny_lm.train's keyword arguments as the diloco side gets them: its defaults, the spec's
    [args] over them, and the run's length and H from [diloco]."""
    defaults = {k: v.default for k, v in inspect.signature(tiny_lm.train).parameters.items()
                if v.default is not inspect.Parameter.empty}
    d = spec["diloco"]
    if not d.get("nesterov", True) or d.get("transport", "fp32") != "fp32":
        raise SystemExit("the torchft side runs fp32 SGD-Nesterov only: nesterov = true, transport = \"fp32\"")
    return {**defaults, **spec["args"], "steps": d["total_steps"], "H": d["sync_every"], "outer_lr": d["outer_lr"],
            "outer_momentum": d["outer_momentum"]}


def main() -> None:
    a = parse()
    c = argparse.Namespace(**training(tomllib.loads(a.spec.read_text())))
    events = a.events.open("a", buffering=1)

    def emit(kind: str, **fields) -> None:
        events.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")

    imported = time.time()
    torch.set_num_threads(c.threads)
    train_data, eval_data = tiny_lm.load_corpus(c.max_bytes)
    model = tiny_lm.build(c.seed, c.context, c.dim, c.layers)
    inner = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=INNER_WEIGHT_DECAY, betas=INNER_BETAS)
    outer = torch.optim.SGD(model.parameters(), lr=c.outer_lr, momentum=c.outer_momentum, nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout_s)), min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica-{a.replica}", lighthouse_addr=a.lighthouse, store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, timeout=timedelta(seconds=a.timeout_s))
    # what this round's should_commit answered: a healed replica's step count moves without a
    # commit, so the count cannot tell
    commits: list[bool] = []
    answer = manager.should_commit

    def should_commit(*args, **kwargs) -> bool:
        commits.append(answer(*args, **kwargs))
        return commits[-1]

    manager.should_commit = should_commit
    emit("up", rejoin=a.rejoin, imports_s=imported - STARTED, since_start_s=time.time() - STARTED)
    while not a.rejoin and not a.go.exists():  # every Manager up before anyone trains, or the first
        time.sleep(0.02)                       # to ask forms a quorum of one
    rounds, H = c.steps // c.H, c.H
    inner_s: list[float] = []
    local = 0  # inner steps since the last sync, as DiLoCo counts them
    started = time.monotonic()
    # DiLoCo syncs inside its post-step hook of the inner optimizer: hooks registered before and
    # after it time exactly that (quorum, Δ, all-reduce, commit, outer step)
    marks: list[float] = []
    inner.register_step_post_hook(lambda *_: marks.append(time.monotonic()))
    with DiLoCo(manager, [model], inner, outer, sync_every=H):
        inner.register_step_post_hook(lambda *_: marks.append(time.monotonic()))
        while manager.current_step() < rounds:
            step = manager.current_step() * H + local
            t0 = time.monotonic()
            gen = torch.Generator().manual_seed(hash((c.seed, a.replica, step)) & 0x7FFF_FFFF)
            for group in inner.param_groups:
                group["lr"] = tiny_lm.lr_at(step, c.steps, c.lr, c.warmup)
            x, y = tiny_lm.batch(train_data, c.batch_size, c.context, gen)
            loss = tiny_lm.loss_of(model, x, y)
            loss.backward()
            inner.step()  # every H-th call: quorum, all-reduce of Δ, outer step (DiLoCo's post-hook)
            inner.zero_grad(set_to_none=True)
            seconds = time.monotonic() - t0
            local += 1
            if local < H:
                inner_s.append(seconds)
                continue
            local = 0
            emit("round", round=manager.current_step(), committed=any(commits),
                 participants=manager.num_participants(), step_s=seconds, sync_s=marks[-1] - marks[-2],
                 loss=loss.item())
            commits.clear()
    wall = time.monotonic() - started
    eval_loss = tiny_lm.evaluate(model, eval_data, c.context) if a.replica == 0 else None
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    emit("done", eval_loss=eval_loss, inner_step_s=statistics.median(inner_s) if inner_s else None, wall_s=wall,
         theta_crc32=zlib.crc32(theta.numpy().tobytes()))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
