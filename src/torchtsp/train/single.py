"""A short single-process training loop of the reference model (the baseline the TSP trainer must match)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..data.samples import BatchStream, PackedSamples
from ..data.sources import TokenSource, builtin_corpus, open_source
from ..data.tokenizers import ByteTokenizer
from ..model import Transformer
from .optim import build_adamw, warmup_cosine


@torch.no_grad()
def greedy_continue(model: Transformer, prompt: str, new_tokens: int = 64) -> str:
    """Prompt plus ``new_tokens`` argmax tokens, recomputing the whole sequence each step (fine at demo scale)."""
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode(prompt) or [tok.eot_id]])
    for _ in range(new_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len :])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tok.decode(ids[0].tolist())


def train_single(
    cfg: ModelConfig,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int = 0,
    data: str | os.PathLike | torch.Tensor | None = None,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    log_every: int = 1,
    prompt: str | None = "def ",
) -> list[float]:
    """Train ``Transformer(cfg)`` with AdamW for ``steps`` steps; returns the per-step losses.

    ``data`` is what ``--data`` names (one dataset; ``None``: the built-in corpus, byte-tokenized) or a 1-D
    tensor of token ids. Batches are drawn as the parallel trainer draws them.
    After training, prints a greedy continuation of ``prompt`` unless it is ``None``.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    cfg.check_length(seq_len, "seq_len")
    if isinstance(data, torch.Tensor):
        source = TokenSource("tensor", data.numpy().astype(np.int64), "tensor")
    elif data is None:
        source = TokenSource("builtin", builtin_corpus(ByteTokenizer()), "builtin")
    else:
        source = open_source(str(data), ByteTokenizer())
    stream = BatchStream([(1.0, PackedSamples(source, seq_len))], batch_size, seed)

    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = build_adamw((([name], p) for name, p in model.named_parameters()), lr, weight_decay)
    warmup = max(1, steps // 10) if warmup is None else warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, steps, warmup))

    losses = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train", unit="step", dynamic_ncols=True)
    for step in bar:
        batch = stream.next_batch()
        tokens, labels = batch[:, :-1], batch[:, 1:]
        loss = model.loss(tokens, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            tok_s = (step + 1) * batch_size * seq_len / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:,.0f}")
    bar.close()

    if prompt is not None:
        model.eval()
        print(f"sample: {greedy_continue(model, prompt)!r}")
    return losses
