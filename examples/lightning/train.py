"""A `lightning.Trainer` training a small byte-level GPT with DiLoCo, on local text: the Python
standard library's top-level modules, so nothing is downloaded.

The training function is the one you already have for Lightning — a LightningModule, dataloaders,
`Trainer(...).fit()` — and adopting DiLoCo is the lines marked `# DiLoCo`:

    callback = DiLoCoCallback(ctx)                                # joins the run in fit()
    trainer = L.Trainer(max_steps=..., callbacks=[callback])      # the Trainer's steps drive the rounds
    trainer.fit(module, train_loader, val_loader)                 # a relaunched replica resumes at the run's step

The spec next to this file runs it: `diloco run examples/lightning/diloco.toml`. The trained
weights are in `<default_root_dir>/diloco-final/model.safetensors` on replica 0 and, from any
shell, `diloco export RUN --out DIR` writes them with the module's parameter names.
"""

from __future__ import annotations

import math
import sysconfig
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch import nn

from diloco.bootstrap.context import ReplicaContext
from diloco_replica.integrations.lightning import DiLoCoCallback  # DiLoCo


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of `seq_len` + 1 bytes: inputs and the next byte of each."""

    def __init__(self, data: bytes, seq_len: int):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def stdlib_text(max_bytes: int, eval_fraction: float = 0.05) -> tuple[bytes, bytes]:
    """Up to `max_bytes` of the stdlib's top-level modules, sorted by name; the last
    `eval_fraction` of them held out for validation."""
    text = b"\n".join(path.read_bytes() for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    text = text[:max_bytes]
    cut = int(len(text) * (1 - eval_fraction))
    return text[:cut], text[cut:]


class ByteLM(L.LightningModule):
    """A causal transformer over bytes: AdamW, linear warmup then cosine decay, stepped per optimizer step."""

    def __init__(self, dim: int, layers: int, heads: int, seq_len: int, lr: float, warmup: int, total: int,
                 sharded: bool = False):
        super().__init__()
        self.lr, self.warmup, self.total, self.sharded = lr, warmup, total, sharded
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss (a forward, so FSDP2's hooks gather a sharded module's parameters around it)."""
        n = x.shape[1]
        h = self.blocks(self.embed(x) + self.position[:n], mask=self.mask[:n, :n], is_causal=True)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def configure_model(self):
        """With Lightning's ModelParallelStrategy: FSDP2, each block and then the whole model sharded
        over the replica's processes (`fully_shard` on the strategy's data-parallel mesh)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not self.sharded or isinstance(self, FSDPModule):  # validate() after fit() asks again
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return self(*batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(*batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, self.warmup, self.total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class FirstLearningRate(L.Callback):
    """The learning rate of this process's first optimizer step."""

    value: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.value is None:
            self.value = trainer.optimizers[0].param_groups[0]["lr"]


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The learning rate's factor after `step` optimizer steps."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def train(ctx: ReplicaContext, batch_size: int = 16, seq_len: int = 64, dim: int = 128, layers: int = 2,
          heads: int = 4, lr: float = 2e-3, warmup: int = 30, seed: int = 0, threads: int = 1,
          max_bytes: int = 2_000_000, val_every: int = 0, default_root_dir: str = "", parallel: str = "ddp") -> dict:
    """Train for the spec's [diloco] total_steps (the Trainer's max_steps). Returns the global
    model's digest and validation loss (the same on every replica), and where this replica's
    training began with its first learning rate: a relaunched replica's are the run's step and the
    schedule's value there, not 0. `parallel`: how a replica of several processes (torchrun) trains,
    "ddp" (Lightning's DDPStrategy) or "fsdp2" (its ModelParallelStrategy, the module sharded by
    `configure_model`)."""
    torch.set_num_threads(threads)
    L.seed_everything(seed, verbose=False)
    total = int(ctx.settings["total_steps"])
    train_text, val_text = stdlib_text(max_bytes)
    sharded = ctx.lanes > 1 and parallel == "fsdp2"
    module = ByteLM(dim, layers, heads, seq_len, lr, warmup, total, sharded=sharded)
    train_loader = torch.utils.data.DataLoader(ByteWindows(train_text, seq_len), batch_size=batch_size, shuffle=True)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ByteWindows(val_text, seq_len), range(64)),
                                             batch_size=batch_size)
    first_lr = FirstLearningRate()
    callback = DiLoCoCallback(ctx)  # DiLoCo
    # a replica of several processes (processes_per_replica, under torchrun): Lightning's DDP or FSDP2 over them
    if ctx.lanes > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=ctx.lanes, tensor_parallel_size=1) if sharded else "ddp"
        placement = {"devices": ctx.lanes, "strategy": strategy}
    else:
        placement = {"devices": "auto"}
    trainer = L.Trainer(max_steps=total, accelerator="auto", **placement, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=val_every or None,
                        default_root_dir=default_root_dir or tempfile.mkdtemp(prefix="lightning-"),
                        callbacks=[callback, first_lr])  # DiLoCo
    trainer.fit(module, train_loader, val_loader if val_every else None)
    # the global model (the same on every replica), through the Trainer's strategy (a sharded one too)
    val_loss = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    return {"rank": ctx.rank, "lane": ctx.lane, "rounds": callback.diloco.round, "eval_loss": val_loss,
            "theta_digest": callback.theta_digest, "parameters": sum(p.numel() for p in module.parameters()),
            "started_at": callback.started_at, "first_lr": first_lr.value, "global_step": trainer.global_step}
