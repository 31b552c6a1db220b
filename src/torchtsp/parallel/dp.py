"""Data parallelism over any scheme, on the ``dp`` mesh axis.

``DataParallel`` wraps a scheme's model (TSP, TP, SP, TP x SP, torch_tp, or ``Replica``, the whole model
on one rank): each of the dp replicas takes B/dp rows of the global batch and runs the scheme on them
over the model axes; the loss is the mean over every token of every replica (both the NLL sum and the
target count are summed over dp), and every gradient is summed over dp as backward produces it. The
``dp`` scheme is this wrapper over ``Replica``, i.e. over a model axis of size 1.
"""

from __future__ import annotations

import contextlib

import torch

from ..compiled import compile_blocks
from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..layers import LossTerms
from ..model import Transformer
from ..recompute import NONE, recompute_policy
from .base import ParallelTransformer, SumOverAxis, materialize, reference_view, sum_router_stats_over


class Replica(ParallelTransformer):
    """The whole reference model on this rank, on whole sequences: the model side of the ``dp`` scheme."""

    scheme = "dp"

    def __init__(self, model: Transformer, mesh, recompute: str | bool = NONE, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights=None):
        super().__init__(model.cfg, mesh)
        materialize(model, mesh, weights)
        self.module = model
        self.recompute = recompute_policy(recompute)
        compile_blocks(model.layers)  # under --compile: no collective inside a block, so each is compiled whole

    def comms(self):
        return {}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def loss_terms(self, tokens, labels, documents=None):
        return self.module.loss_terms(tokens, labels, recompute=self.recompute, document_ids=documents)

    def reference_parts(self, name, local):
        return [(name.removeprefix("module."), local, {})]

    def fsdp_blocks(self):
        return list(self.module.layers)  # whole replicated blocks, one unit each (torchtitan's apply_fsdp)

    def _full(self, pick):
        return {name: pick(p) for name, p in self.module.named_parameters()}


class AllReduceGrads:
    """The gradient sum of data parallelism without a distributed optimizer: every gradient all-reduced over the
    ``dp`` replicas, in float32 (a bf16 sum over replicas would lose the low bits of every gradient).

    A gradient-sum strategy (also ``train/zero.py``'s ``ZeroOptimizer``, whose reduce-scatter replaces this) is
    given to a model once (``sum_gradients_with``) and offers two ways to sum: ``in_backward(params)`` hooks
    each parameter so its gradient is summed as backward produces it (returns the hooks' handles); the
    context ``over_pass(params)`` sums the gradients a whole pass adds to ``.grad`` as it ends (a pipeline
    schedule, whose every microbatch runs a backward)."""

    def __init__(self, dp: AxisComm):
        self.dp = dp

    def in_backward(self, params) -> list:
        # On the gradient flowing into each weight (before accumulation into .grad): accumulation over
        # several backward passes stays exact, and the sums overlap the rest of backward.
        return [p.register_hook(self._sum) for p in params]

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        if self.dp.size == 1:
            return grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # torch_tp: this rank's DTensor piece
        total = self.dp.all_reduce(local.to(torch.float32, copy=True), label="dp.grad").to(local.dtype)
        if local is grad:
            return total
        return type(grad).from_local(total, grad.device_mesh, grad.placements, run_check=False,
                                     shape=grad.shape, stride=grad.stride())

    @contextlib.contextmanager
    def over_pass(self, params):
        """Gradients of earlier passes (accumulation) are already summed: set aside, then added back."""
        params = list(params)
        earlier = {p: p.grad for p in params if p.grad is not None} if self.dp.size > 1 else {}
        for p in earlier:
            p.grad = None
        yield
        if self.dp.size == 1:
            return
        for p in params:
            if p.grad is not None:
                p.grad.copy_(self._sum(p.grad))
            if p in earlier:
                p.grad = earlier[p] if p.grad is None else p.grad.add_(earlier[p])


class DataParallel(ParallelTransformer):
    """``inner`` (a scheme's model on this rank's model axes) replicated over the ``dp`` mesh axis."""

    def __init__(self, inner: ParallelTransformer, mesh, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.scheme = inner.scheme  # the instance attribute the base class reads (mesh already checked)
        super().__init__(inner.cfg, mesh)
        self.module = inner
        self.dp = AxisComm.from_mesh(mesh, "dp", timeout_s)
        self._grad_hooks = []
        self.sum_gradients_with(AllReduceGrads(self.dp))

    def sum_gradients_with(self, strategy) -> None:
        """Sum every gradient over the replicas, as backward produces it, with ``strategy`` (``AllReduceGrads``
        by default; a distributed optimizer's reduce-scatter); None keeps the one in use."""
        if strategy is None:
            return
        for handle in self._grad_hooks:
            handle.remove()
        self.grad_sum = strategy
        self._grad_hooks = strategy.in_backward(self.module.parameters())

    @property
    def recompute(self) -> str:
        return getattr(self.module, "recompute", NONE)

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
