"""What the transformers.Trainer tests train: a tiny Llama from a config, token windows in memory,
the Trainer's arguments, and a probe that records what the Trainer did (where it started, its
learning rate there, the batches it read), as a plain module the tests and their replica
processes import."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

VOCAB, SEQ = 64, 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def windows(n: int = 400, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Examples a causal LM trains on: random token windows, their own labels."""
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": (x := torch.randint(0, VOCAB, (SEQ,), generator=gen)), "labels": x} for _ in range(n)]


def arguments(out: str, max_steps: int, **overrides) -> TrainingArguments:
    settings = dict(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
                    lr_scheduler_type="linear", warmup_steps=3, report_to=[], save_strategy="no", logging_steps=5,
                    use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**settings, **overrides})


class Probe(TrainerCallback):
    """Where the Trainer started (its step and learning rate, after every callback before this one
    ran), and every training batch the model saw, in order."""

    def __init__(self):
        self.start_step: int | None = None
        self.start_lr: float | None = None
        self.batches: list[torch.Tensor] = []
        self.steps_ended: list[int] = []

    def on_init_end(self, args, state, control, model=None, **kwargs):
        model.register_forward_hook(self._seen, with_kwargs=True)
        return control

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.start_step, self.start_lr = state.global_step, lr_scheduler.get_last_lr()[0]
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_ended.append(state.global_step)
        return control

    def _seen(self, module, args, kwargs, output):
        if module.training:
            self.batches.append(kwargs["input_ids"].clone())


def trainer(model, args, data, *callbacks) -> Trainer:
    return Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def accumulated_bf16_rows(out: str, sync_every: int) -> list[dict]:
    """Two rounds of the callback under bf16 autocast, two micro-batches a step, evaluated every
    round: the rounds' rows."""
    import uuid
    from dataclasses import asdict

    from diloco.bootstrap.context import ReplicaContext
    from diloco.store.objectstore import open_store
    from diloco_replica.integrations.transformers import DiLoCoCallback

    callback = DiLoCoCallback(ReplicaContext(0, 1, "hf-accumulate"), store=open_store(f"memory://{uuid.uuid4().hex}"),
                              sync_every=sync_every, save_final=False)
    args = arguments(out, 2 * sync_every, gradient_accumulation_steps=2, bf16=True, eval_strategy="steps",
                     eval_steps=sync_every)
    Trainer(model=tiny_llama(), args=args, train_dataset=windows(), eval_dataset=windows(8, seed=2),
            callbacks=[callback]).train()
    return [asdict(row) for row in callback.diloco.metrics]
