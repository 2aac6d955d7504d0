"""What DiLoCo inside `transformers.Trainer` and `lightning.Trainer` costs per round, against the
hand-written loop.

One replica (a file:// store, so a round is the whole protocol with no one to wait for) trains
the same Llama (built from a config) on the same token windows, six ways, each in a process of
its own, alternating `BENCH_REPEATS` times:

- `loop`: the hand-written loop (AdamW, linear warmup schedule, clipping at 1.0) without DiLoCo;
- `loop+diloco`: the same loop with `DiLoCo(model, opt, ctx)` and `diloco.step()` (the wrapper);
- `trainer`: `transformers.Trainer` with the same optimizer, schedule and clipping, without DiLoCo;
- `trainer+callback`: the same Trainer with `DiLoCoCallback` (the integration);
- `lightning`, `lightning+callback`: a LightningModule around the same model, the same optimizer,
  schedule and clipping, in `lightning.Trainer`, without and with its `DiLoCoCallback`.

A row's `s_per_round` is the wall time of H inner steps and their round (the first round, a
warm-up, left out; the median of the repeats), and `diloco_s_per_round` what DiLoCo adds to its
own baseline (`loop+diloco` − `loop`, `trainer+callback` − `trainer`): on a shared machine the
wall times move by more than a round costs, so the integration's overhead is measured where it
is spent instead: `in_diloco_s_per_round`, the time inside `diloco.step()` (the wrapper) or
inside the callback's per-step event (the integration: the same call, plus reading the step's
loss and tokens), per round; `callback_vs_wrapper_s_per_round` (transformers) and
`lightning_callback_vs_wrapper_s_per_round` are the differences. Every row
reports its process's peak host RSS (`host_peak_gb`) and, for the DiLoCo rows, the peak added
over its baseline in multiples of the fp32 model.

    .venv/bin/python bench/trainers.py                       # a 3.3M Llama, H = 50, 4 rounds
    BENCH_HIDDEN=512 BENCH_LAYERS=8 .venv/bin/python bench/trainers.py
    BENCH_QUICK=1 ...                                        # a smoke run (tiny model, H = 5)
Prints JSON {rows, callback_vs_wrapper_s_per_round, ...}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from _common import knob, peak_rss_kb  # noqa: E402 - bench/ is the script's directory

HIDDEN = int(knob("BENCH_HIDDEN", "256", "32"))
LAYERS = int(knob("BENCH_LAYERS", "4", "1"))
HEADS = int(knob("BENCH_HEADS", "4", "2"))
SEQ = int(knob("BENCH_SEQ", "128", "16"))
BATCH = int(knob("BENCH_BATCH", "8", "4"))
H = int(knob("BENCH_H", "50", "5"))
ROUNDS = int(knob("BENCH_ROUNDS", "4", "3"))
REPEATS = int(knob("BENCH_REPEATS", "2", "1"))
KINDS = ["loop", "loop+diloco", "trainer", "trainer+callback", "lightning", "lightning+callback"]
LR, WARMUP = 1e-3, 10


def llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=HIDDEN * 8 // 3 // 64 * 64 or 64,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=SEQ, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def windows(n: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": (x := torch.randint(0, 256, (SEQ,), generator=gen)), "labels": x} for _ in range(n)]


def linear_warmup(step: int, steps: int) -> float:
    """transformers' "linear" schedule's factor after `step` steps (what the Trainer rows use)."""
    return step / WARMUP if step < WARMUP else max(0.0, (steps - step) / max(1, steps - WARMUP))


def train_lightning(model, data, steps: int, ends: list[float], inside: list[float], callback) -> None:
    """`lightning.Trainer` over a LightningModule holding `model`: the loop rows' optimizer,
    schedule and clipping; `callback` (DiLoCo's, or None) timed in its per-batch event."""
    import lightning as L
    import torch

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_warmup(s, steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())

    callbacks = [Clock()]
    if callback is not None:
        event = callback.on_train_batch_end

        def timed(*args, **kwargs):  # Lightning calls the instance's attribute
            t0 = time.perf_counter()
            event(*args, **kwargs)
            inside.append(time.perf_counter() - t0)

        callback.on_train_batch_end = timed
        callbacks.insert(0, callback)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=callbacks)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=BATCH))


def one_row(kind: str) -> dict:
    """Train `kind` for ROUNDS × H steps in this process; the wall time of each round's steps."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from diloco.bootstrap.context import ReplicaContext
    from diloco.store.objectstore import open_store

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    steps = ROUNDS * H
    model, data = llama(), windows(steps * BATCH)
    ends: list[float] = []  # perf_counter after each optimizer step (its round included)
    inside: list[float] = []  # seconds inside DiLoCo's per-step call, each step
    store = open_store(f"file://{tempfile.mkdtemp(prefix='bench-trainers-')}")
    ctx = ReplicaContext(0, 1, f"bench-{uuid.uuid4().hex[:8]}")
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=BATCH,
                             learning_rate=LR, lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=1.0,
                             report_to=[], save_strategy="no", logging_steps=10_000, disable_tqdm=True, use_cpu=True,
                             optim="adamw_torch")
    if kind.startswith("lightning"):
        callback = None
        if kind == "lightning+callback":
            from diloco_replica.integrations.lightning import DiLoCoCallback

            callback = DiLoCoCallback(ctx, store=store, sync_every=H, save_final=False, per_replica_data=False)
        train_lightning(model, data, steps, ends, inside, callback)
    elif kind.startswith("trainer"):
        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                ends.append(time.perf_counter())

        callbacks = [Clock()]
        if kind == "trainer+callback":
            from diloco_replica.integrations.transformers import DiLoCoCallback

            callback = DiLoCoCallback(ctx, store=store, sync_every=H, save_final=False)
            event = callback.on_step_end

            def timed(*args, **kwargs):  # the Trainer calls the instance's attribute
                t0 = time.perf_counter()
                out = event(*args, **kwargs)
                inside.append(time.perf_counter() - t0)
                return out

            callback.on_step_end = timed
            callbacks.insert(0, callback)
        Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)  # its optimizer and schedule, built alike
        trainer.create_optimizer_and_scheduler(num_training_steps=steps)
        opt, schedule = trainer.optimizer, trainer.lr_scheduler
        diloco = None
        if kind == "loop+diloco":
            from diloco_replica import DiLoCo

            diloco = DiLoCo(model, opt, ctx, store=store, sync_every=H)
        for k in range(steps):
            ids = torch.stack([d["input_ids"] for d in data[k * BATCH:(k + 1) * BATCH]])
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            model.zero_grad()
            if diloco is not None:
                t0 = time.perf_counter()
                diloco.step(loss=loss.item(), tokens=ids.numel())
                inside.append(time.perf_counter() - t0)
            ends.append(time.perf_counter())
        if diloco is not None:
            diloco.close()
    rounds = [ends[(r + 1) * H - 1] - ends[r * H - 1] for r in range(1, ROUNDS)]  # round 1: the warm-up
    in_rounds = [sum(inside[r * H:(r + 1) * H]) for r in range(1, ROUNDS)] if inside else [0.0]
    return {"kind": kind, "s_per_round": statistics.median(rounds), "host_peak_gb": peak_rss_kb() / 2**20,
            "in_diloco_s_per_round": statistics.median(in_rounds),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        print(json.dumps(one_row(sys.argv[2])))
        return
    got: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(REPEATS):
        for kind in KINDS:  # alternating: drift on the machine falls on every kind alike
            proc = subprocess.run([sys.executable, __file__, "--row", kind], capture_output=True, text=True,
                                  timeout=3600)
            if proc.returncode != 0:
                sys.exit(f"row {kind} failed:\n{proc.stderr[-3000:]}")
            got[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    model_gb = got["loop"][0]["parameters"] * 4 / 2**30
    rows = []
    for kind in KINDS:
        rows.append({"kind": kind, "s_per_round": round(statistics.median(r["s_per_round"] for r in got[kind]), 4),
                     "in_diloco_s_per_round": round(statistics.median(r["in_diloco_s_per_round"] for r in got[kind]), 4),
                     "host_peak_gb": round(max(r["host_peak_gb"] for r in got[kind]), 3)})
    by = {r["kind"]: r for r in rows}
    for kind, base in (("loop+diloco", "loop"), ("trainer+callback", "trainer"), ("lightning+callback", "lightning")):
        by[kind]["diloco_s_per_round"] = round(by[kind]["s_per_round"] - by[base]["s_per_round"], 4)
        by[kind]["host_added_x_model"] = round((by[kind]["host_peak_gb"] - by[base]["host_peak_gb"]) / model_gb, 2)
    print(json.dumps({
        "model": {"parameters": got["loop"][0]["parameters"], "hidden": HIDDEN, "layers": LAYERS, "seq": SEQ,
                  "batch": BATCH}, "H": H, "rounds_timed": ROUNDS - 1, "repeats": REPEATS, "rows": rows,
        "callback_vs_wrapper_s_per_round": round(by["trainer+callback"]["in_diloco_s_per_round"]
                                                 - by["loop+diloco"]["in_diloco_s_per_round"], 4),
        "lightning_callback_vs_wrapper_s_per_round": round(by["lightning+callback"]["in_diloco_s_per_round"]
                                                           - by["loop+diloco"]["in_diloco_s_per_round"], 4),
        "trainer_vs_loop": round(by["trainer"]["s_per_round"] / by["loop"]["s_per_round"], 3),
        "lightning_vs_loop": round(by["lightning"]["s_per_round"] / by["loop"]["s_per_round"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
