"""Optimizer pieces shared by the single-device reference loop and the parallel trainer."""

from __future__ import annotations

import math

import torch

from ..distributed.comm import AxisComm


def warmup_cosine(step: int, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = steps - 1 - warmup
    progress = 1.0 if decay_steps <= 0 else (step - warmup) / decay_steps
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def is_norm_weight(reference_name: str) -> bool:
    return reference_name.endswith("norm.weight")


def build_adamw(named_params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the given (name, parameter) pairs; norm weights get no weight decay.

    ``named_params`` yields (reference names of the parameter, parameter): a sharded parameter may
    hold pieces of several reference parameters; it is a norm only if all of them are.
    """
    decay, no_decay = [], []
    for names, p in named_params:
        (no_decay if all(is_norm_weight(n) for n in names) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def global_grad_norm(grads, comms: dict[str, AxisComm]) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each element counted once.

    ``grads`` yields (piece of a gradient, {mesh axis: dim} it is sharded over). Squares of pieces
    sharded over the same axes are summed locally, then over those axes; replicated pieces are
    identical on every rank and are counted as they are. A piece held by several ranks of an axis
    (``{axis: (dim, chunks)}``: chunks slices over the axis, e.g. replicated KV heads) is weighed by
    chunks/size, so the sum over the axis counts each slice once.
    """
    squares: dict[tuple[str, ...], torch.Tensor] = {}
    for piece, shard_dims in grads:
        key = tuple(sorted(shard_dims))
        square = piece.float().pow(2).sum()
        for axis, dim in shard_dims.items():
            if isinstance(dim, tuple):
                square = square * (dim[1] / comms[axis].size)
        squares[key] = squares.get(key, 0.0) + square
    total = 0.0
    for axes, sq in squares.items():
        for axis in axes:
            sq = comms[axis].all_reduce(sq, label="grad_norm")
        total = total + sq
    return torch.as_tensor(total, dtype=torch.float32).sqrt()


class MasterWeights:
    """bf16 parameters for compute and communication; fp32 master copies own the optimizer.

    ``grads_to_masters`` before clipping and the optimizer step, ``masters_to_params`` after it.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        for p in params:
            p.data = p.data.to(torch.bfloat16)

    def grads_to_masters(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_params(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
