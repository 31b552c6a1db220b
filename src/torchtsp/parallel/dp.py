"""DP: every rank holds the whole model and 1/D of the batch rows; gradients are all-reduced."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.comm import DEFAULT_TIMEOUT_S
from ..model import IGNORE_INDEX, Transformer
from .base import ReplicatedTransformer, global_mean


class DPTransformer(ReplicatedTransformer):
    scheme = "dp"
    axis = "dp"

    def __init__(self, model: Transformer, mesh, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(model, mesh, timeout_s)

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[0] % self.comm.size:
            raise ValueError(f"batch size {tokens.shape[0]} must be divisible by the DP degree {self.comm.size}")
        return tokens.chunk(self.comm.size, dim=0)[self.comm.rank]

    def loss_on_shard(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.module(tokens)  # each weight's gradient is all-reduced as soon as backward produces it
        nll_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum")
        return global_mean(nll_sum, labels, self.comm)
