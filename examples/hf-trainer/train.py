"""A Hugging Face `transformers.Trainer` training a Llama (~3.3M parameters, built from a config:
no weights downloaded) with DiLoCo, on local text: the Python standard library's top-level
modules, byte-level, so no tokenizer download either.

The training function is the one you already have for the Trainer — model, datasets,
`TrainingArguments`, `Trainer(...).train()` — and adopting DiLoCo is the lines marked `# DiLoCo`:

    callback = DiLoCoCallback(ctx)                                # joins the run
    trainer = Trainer(..., callbacks=[callback])                  # the Trainer's steps drive the rounds
    trainer.train(resume_from_checkpoint=callback.resume)         # a relaunched replica resumes where the run is

The spec next to this file runs it: `diloco run examples/hf-trainer/diloco.toml`. The trained
model is in `<output_dir>/diloco-final` on replica 0 and, from any shell, `diloco export RUN --out
DIR` writes a directory `LlamaForCausalLM.from_pretrained(DIR)` loads.
"""

from __future__ import annotations

import sysconfig
import tempfile
from pathlib import Path

import torch

from diloco.bootstrap.context import ReplicaContext


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of `seq_len` bytes; a causal LM's labels are its inputs."""

    def __init__(self, data: bytes, seq_len: int):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def stdlib_text(max_bytes: int, eval_fraction: float = 0.05) -> tuple[bytes, bytes]:
    """Up to `max_bytes` of the stdlib's top-level modules, sorted by name; the last
    `eval_fraction` of them held out for evaluation."""
    text = b"\n".join(path.read_bytes() for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    text = text[:max_bytes]
    cut = int(len(text) * (1 - eval_fraction))
    return text[:cut], text[cut:]


def llama(seed: int, hidden: int, layers: int, heads: int, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3 + 63) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=seq_len, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train(ctx: ReplicaContext, batch_size: int = 8, seq_len: int = 128, hidden: int = 256, layers: int = 4,
          heads: int = 4, lr: float = 1e-3, warmup: int = 30, seed: int = 0, threads: int = 1,
          max_bytes: int = 3_000_000, eval_steps: int = 0, logging_steps: int = 50, output_dir: str = "") -> dict:
    """Train for the spec's [diloco] total_steps (the Trainer's max_steps). Returns the global
    model's digest and eval loss (the same on every replica), and where this replica's training
    began with the first learning rate it logged: a relaunched replica's are the run's step and
    the schedule's value there, not 0."""
    from transformers import Trainer, TrainingArguments

    from diloco_replica.integrations.transformers import DiLoCoCallback  # DiLoCo

    torch.set_num_threads(threads)
    train_text, eval_text = stdlib_text(max_bytes)
    model = llama(seed, hidden, layers, heads, seq_len)
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="hf-trainer-"), max_steps=int(ctx.settings["total_steps"]),
        per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size, learning_rate=lr,
        lr_scheduler_type="cosine", warmup_steps=warmup, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps or None, logging_steps=logging_steps,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=seed, use_cpu=not torch.cuda.is_available())
    callback = DiLoCoCallback(ctx)  # DiLoCo
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(train_text, seq_len),
                      eval_dataset=_first(ByteWindows(eval_text, seq_len), 64), callbacks=[callback])  # DiLoCo
    trainer.train(resume_from_checkpoint=callback.resume)  # DiLoCo
    eval_loss = trainer.evaluate()["eval_loss"]  # the global model: the same on every replica
    first_log = next((e for e in trainer.state.log_history if "learning_rate" in e), {})
    return {"rank": ctx.rank, "rounds": callback.diloco.round, "eval_loss": eval_loss,
            "theta_digest": callback.theta_digest, "parameters": sum(p.numel() for p in model.parameters()),
            "started_at": callback.started_at,
            "first_logged": {"step": first_log.get("step"), "learning_rate": first_log.get("learning_rate")}}


def _first(dataset: torch.utils.data.Dataset, n: int) -> torch.utils.data.Subset:
    return torch.utils.data.Subset(dataset, range(min(n, len(dataset))))
