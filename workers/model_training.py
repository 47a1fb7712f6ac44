"""Train a freshly built checkpoint on the repo's corpus (`kvserve make-model --train-steps N`).

A randomly initialised model's next-token distributions are nearly flat: its two best tokens are often within
a hundredth of a logprob, so any approximation (a quantized KV pool, another reduction order) flips its greedy
choices and says nothing about how a served model would fare. A few hundred steps of next-token training on
`workers/data/corpus.txt` (the text the benchmark workloads cut their prompts from) give the distributions a
trained model has: most positions decided by a wide margin, some still close.

The corpus's token stream is split once: the last ``HELD_OUT`` of it is never trained on and gives the held-out
loss. Training windows are ``[<s>] + seq_len - 1`` consecutive tokens from the rest, at positions drawn from a
generator seeded by the build's seed, so a build is reproducible on one machine. AdamW, linear warm-up (20 steps, or a tenth of them if fewer) then
cosine decay to a tenth of the peak rate, gradients clipped at 1.0, float32 throughout (the caller casts).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

HELD_OUT = 0.1  # share of the corpus's tokens, at its end, never trained on


@dataclass
class TrainingReport:
    steps: int
    seq_len: int
    batch_size: int
    corpus_tokens: int
    train_tokens_seen: int
    initial_train_loss: float  # on the first batch, before any step
    final_train_loss: float  # mean of the last 10 steps' batches
    initial_held_out_loss: float
    held_out_loss: float
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def corpus_ids(tokenizer) -> list[int]:
    """The corpus as one token stream (a `tokenizers.Tokenizer`; the leading `<s>` its encoding adds dropped)."""
    from workers.model_builder import CORPUS_PATH

    return tokenizer.encode(CORPUS_PATH.read_text()).ids[1:]


def _windows(ids: torch.Tensor, starts: torch.Tensor, seq_len: int, bos_id: int) -> torch.Tensor:
    body = torch.stack([ids[s: s + seq_len - 1] for s in starts.tolist()])
    return torch.cat([torch.full((len(starts), 1), bos_id, dtype=body.dtype), body], dim=1)


@torch.no_grad()
def _held_out_loss(model, ids: torch.Tensor, seq_len: int, bos_id: int) -> float:
    """Mean next-token loss over consecutive held-out windows (each `<s>` + seq_len - 1 tokens)."""
    starts = torch.arange(0, len(ids) - seq_len + 1, seq_len - 1)
    if len(starts) == 0:
        raise ValueError(f"the held-out part ({len(ids)} tokens) is shorter than one {seq_len}-token window")
    training = model.training
    model.eval()
    losses = [float(model(input_ids=w, labels=w).loss) for w in _windows(ids, starts, seq_len, bos_id).split(8)]
    model.train(training)
    return sum(losses) / len(losses)


def train_on_corpus(model, tokenizer, *, steps: int, seed: int, bos_id: int, seq_len: int = 256,
                    batch_size: int = 8, lr: float = 2e-3, warmup: int = 20) -> TrainingReport:
    """Train `model` (a transformers causal LM, float32) in place for `steps` AdamW steps on the corpus; it
    is left in eval mode. The global RNG (dropout, where a config has it) is seeded with `seed` and the
    caller's state restored afterwards."""
    if steps < 1:
        raise ValueError(f"train steps must be >= 1, got {steps}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _train(model, tokenizer, steps=steps, seed=seed, bos_id=bos_id, seq_len=seq_len,
                      batch_size=batch_size, lr=lr, warmup=warmup)


def _train(model, tokenizer, *, steps: int, seed: int, bos_id: int, seq_len: int, batch_size: int, lr: float,
           warmup: int) -> TrainingReport:
    ids = torch.tensor(corpus_ids(tokenizer), dtype=torch.long)
    cut = int(len(ids) * (1 - HELD_OUT))
    train_ids, held_ids = ids[:cut], ids[cut:]
    if len(train_ids) < seq_len:
        raise ValueError(f"the corpus's training part ({len(train_ids)} tokens) is shorter than seq_len {seq_len}")
    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))
    warmup = min(warmup, max(1, steps // 10))

    def rate(step: int) -> float:  # multiplier of lr for step (0-based)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    initial_held_out = _held_out_loss(model, held_ids, seq_len, bos_id)
    start = time.perf_counter()
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(train_ids) - seq_len + 2, (batch_size,), generator=generator)
        batch = _windows(train_ids, starts, seq_len, bos_id)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return TrainingReport(
        steps=steps, seq_len=seq_len, batch_size=batch_size, corpus_tokens=len(ids),
        train_tokens_seen=steps * batch_size * seq_len, initial_train_loss=losses[0],
        final_train_loss=sum(losses[-10:]) / len(losses[-10:]), initial_held_out_loss=initial_held_out,
        held_out_loss=_held_out_loss(model, held_ids, seq_len, bos_id), seconds=time.perf_counter() - start)
