"""Data parallelism over any scheme, on the ``dp`` mesh axis.

``DataParallel`` wraps a scheme's model (TSP, TP, SP, TP x SP, torch_tp, or ``Replica``, the whole model
on one rank): each of the dp replicas takes B/dp rows of the global batch and runs the scheme on them
over the model axes; the loss is the mean over every token of every replica (both the NLL sum and the
target count are summed over dp), and every gradient is summed over dp as backward produces it. The
``dp`` scheme is this wrapper over ``Replica``, i.e. over a model axis of size 1.
"""

from __future__ import annotations

import torch

from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..layers import LossTerms
from ..model import Transformer
from .base import ParallelTransformer, SumOverAxis, materialize, reference_view, sum_router_stats_over


class Replica(ParallelTransformer):
    """The whole reference model on this rank, on whole sequences: the model side of the ``dp`` scheme."""

    scheme = "dp"

    def __init__(self, model: Transformer, mesh, recompute: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights=None):
        super().__init__(model.cfg, mesh)
        materialize(model, mesh, weights)
        self.module = model
        self.recompute = recompute

    def comms(self):
        return {}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def loss_terms(self, tokens, labels, documents=None):
        return self.module.loss_terms(tokens, labels, recompute=self.recompute, document_ids=documents)

    def reference_parts(self, name, local):
        return [(name.removeprefix("module."), local, {})]

    def _full(self, pick):
        return {name: pick(p) for name, p in self.module.named_parameters()}


class DataParallel(ParallelTransformer):
    """``inner`` (a scheme's model on this rank's model axes) replicated over the ``dp`` mesh axis."""

    # Whether backward sums each gradient over dp (all-reduce); a distributed optimizer (train/zero.py), which
    # reduce-scatters them itself, turns it off.
    grad_sum_over_dp = True

    def __init__(self, inner: ParallelTransformer, mesh, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.scheme = inner.scheme  # the instance attribute the base class reads (mesh already checked)
        super().__init__(inner.cfg, mesh)
        self.module = inner
        self.dp = AxisComm.from_mesh(mesh, "dp", timeout_s)
        for p in inner.parameters():
            # On the gradient flowing into each weight (before accumulation into .grad): accumulation over
            # several backward passes stays exact, and the sums overlap the rest of backward.
            p.register_hook(self._sum_over_replicas)

    def _sum_over_replicas(self, grad: torch.Tensor) -> torch.Tensor:
        if self.dp.size == 1 or not self.grad_sum_over_dp:
            return grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # torch_tp: this rank's DTensor piece
        # Summed in float32: a bf16 sum over replicas would lose the low bits of every gradient.
        total = self.dp.all_reduce(local.to(torch.float32, copy=True), label="dp.grad").to(local.dtype)
        if local is grad:
            return total
        return type(grad).from_local(total, grad.device_mesh, grad.placements, run_check=False,
                                     shape=grad.shape, stride=grad.stride())

    @property
    def recompute(self) -> bool:
        return getattr(self.module, "recompute", False)

    def comms(self):
        return {**self.module.comms(), "dp": self.dp}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This replica's B/dp rows, then the inner scheme's share of them."""
        if tokens.shape[0] % self.dp.size:
            raise ValueError(f"batch size {tokens.shape[0]} must be divisible by the DP degree {self.dp.size}")
        return self.module.shard_batch(tokens.chunk(self.dp.size, dim=0)[self.dp.rank])

    def shard_documents(self, documents):
        """This replica's rows' documents, then the inner scheme's share of them."""
        if documents is None:
            return None
        rows = len(documents.runs) // self.dp.size
        return self.module.shard_documents(documents.rows(self.dp.rank * rows, (self.dp.rank + 1) * rows))

    def loss_terms(self, tokens, labels, documents=None):
        nll_sum, count, router = self.module.loss_terms(tokens, labels, documents)
        count = self.dp.all_reduce(count.clone(), label="loss")
        return LossTerms(SumOverAxis.apply(nll_sum, self.dp), count, router)

    def sum_router_stats(self, stats):
        """The inner scheme's sums over its ranks, then over the replicas (each saw other batch rows)."""
        return sum_router_stats_over(self.dp, *self.module.sum_router_stats(stats))

    def reference_parts(self, name, local):
        return self.module.reference_parts(name.removeprefix("module."), local)

    def shard_view(self):
        """The dp scheme: the whole model, and the replicas' axis (each decodes its own rows of a batch)."""
        if self.scheme != "dp":
            raise ValueError(f"generate runs {self.scheme} on its own axis; data-parallel replicas of it (dp > 1) "
                             f"are not supported yet: generate with dp = 1")
        return reference_view(self.module.module, self.dp)

    def _full(self, pick):
        return self.module._full(pick)
