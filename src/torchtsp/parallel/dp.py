"""DP: every rank holds the whole model and 1/D of the batch rows; gradients are all-reduced."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..model import IGNORE_INDEX, Transformer
from .base import ParallelTransformer, ReplicatedGrad, global_mean


class DPTransformer(ParallelTransformer):
    scheme = "dp"

    def __init__(self, model: Transformer, mesh, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(model.cfg)
        self.comm = AxisComm.from_mesh(mesh, "dp", timeout_s)
        self.module = model  # the replica

    def comms(self):
        return {"dp": self.comm}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[0] % self.comm.size:
            raise ValueError(f"batch size {tokens.shape[0]} must be divisible by the DP degree {self.comm.size}")
        return tokens.chunk(self.comm.size, dim=0)[self.comm.rank]

    def loss_on_shard(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Each weight's gradient is all-reduced as soon as backward has produced it.
        weights = {name: ReplicatedGrad.apply(p, self.comm) for name, p in self.module.named_parameters()}
        logits = functional_call(self.module, weights, (tokens,))
        nll_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum")
        return global_mean(nll_sum, labels, self.comm)

    def reference_parts(self, name, local):
        return [(name.removeprefix("module."), local, {})]

    def _full(self, pick):
        return {name: pick(p) for name, p in self.module.named_parameters()}
