"""torch_tp: the OUTSIDE PEER — the reference model parallelised by PyTorch's own tensor parallelism.

This scheme exists to show that our TP baseline is not a straw man: it applies
``torch.distributed.tensor.parallel`` (``parallelize_module``, DTensor) to the reference ``Transformer``
on the ``tp`` mesh axis, with the plan torchtitan uses for Llama:

* ``attention.wq/wk/wv`` and ``feed_forward.w_gate/w_up``: ``ColwiseParallel`` (output features sharded;
  local shards come back as plain tensors, and the model's ``view(B, S, -1, d)`` turns them into the
  local heads);
* ``attention.wo`` and ``feed_forward.w_down``: ``RowwiseParallel`` (all-reduce, or reduce-scatter to
  sequence shards with sequence parallelism);
* ``tok_embeddings``: ``RowwiseParallel`` with replicated input (vocabulary-sharded embedding);
* LM head: ``ColwiseParallel`` (vocabulary-sharded logits), fed to ``loss_parallel()``: a
  vocabulary-parallel cross-entropy that never gathers the [tokens, V] logits;
* ``attention`` and ``feed_forward``: ``PrepareModuleInput`` makes their input one replicated DTensor, so
  the input gradients of the column-parallel projections are reduced once per block in backward;
* with ``sequence_parallel=True``: ``SequenceParallel`` for the RMSNorms and the residual stream sharded on
  the sequence dimension (all-gathered by ``PrepareModuleInput``, reduce-scattered by the row-parallel
  projections).

Per layer and step this moves what Megatron TP(+SP) moves: forward 2 all-reduces (or 2 all-gathers and
2 reduce-scatters with SP) of [B, S, h], backward the same; plus one gather/scatter for the embedding and
LM head and three [B·S]-element all-reduces in the vocabulary-parallel cross-entropy.

Unlike our own schemes, this file calls ``torch.distributed.tensor`` APIs directly (they run their
own collectives), so its traffic is NOT counted by ``torchtsp.distributed.comm``: ``comms()`` is empty,
and ``timeout_s`` is accepted for a uniform interface but the process group's own timeout applies.

The reference model must be identical on every rank (as for every scheme): ``distribute_tensor`` scatters
the sharded weights from the axis' rank 0, while ``SequenceParallel`` keeps each rank's own norm weights.

The LM head: ``Transformer.forward`` applies it with ``F.linear``, so the loss here calls ``output`` as a
module. With tied embeddings there is no ``output`` module: the LM head reuses the vocabulary-sharded
embedding DTensor directly, computing the local logit shard exactly as ``ColwiseParallel`` would.

``loss_parallel()`` requires the backward to run inside the context as well, which the caller's
``loss.backward()`` would not; ``_LossParallelCrossEntropy`` bridges this: its backward differentiates the
cross-entropy's own graph inside the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..distributed.comm import DEFAULT_TIMEOUT_S
from ..layers import CAUSAL, IGNORE_INDEX, LossTerms, layer_rope, rope_length, rope_positions, scale_embeddings
from ..model import Transformer
from ..recompute import NONE, SELECTIVE, recompute_policy
from ..weights import WeightSource
from .base import ParallelTransformer, weight_source


class _LossParallelCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropy over tokens from vocabulary-sharded logits (a DTensor sharded on the last dim).

    ``loss_parallel()`` must be active in forward AND backward; the caller's ``loss.backward()`` runs outside
    it, so this function builds the cross-entropy's own small graph in forward and differentiates it inside
    the context in backward (no recomputation, no extra collectives)."""

    @staticmethod
    def forward(ctx, logits: DTensor, labels: torch.Tensor):
        with torch.enable_grad(), loss_parallel():
            ctx.leaf = logits.detach().requires_grad_()
            ctx.nll_sum = F.cross_entropy(ctx.leaf.flatten(0, 1).float(), labels.flatten(),
                                          ignore_index=IGNORE_INDEX, reduction="sum")  # replicated DTensor
        return ctx.nll_sum.detach().to_local()

    @staticmethod
    def backward(ctx, grad):
        nll_sum, leaf = ctx.nll_sum, ctx.leaf
        del ctx.nll_sum, ctx.leaf  # backward runs once: release the graph
        grad = DTensor.from_local(grad, nll_sum.device_mesh, nll_sum.placements, run_check=False)
        with loss_parallel():
            (dlogits,) = torch.autograd.grad(nll_sum, leaf, grad)
        return dlogits, None


# Selective recompute for DTensor TP, in torchtitan's "op" form (an outside peer, so PyTorch's own mechanism):
# the matmul and attention outputs and the functional collectives' results are kept, everything else (norms,
# rotary, silu, products) recomputed, so backward's re-run of a layer issues no collective again. Our own schemes
# cannot use it: their collectives are in-place c10d calls counted in Python (docs/design.md, "Selective recompute").
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_cudnn_attention.default,
              torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_gather_into_tensor.default,
              torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.wait_tensor.default}


def _save_matmuls_and_collectives(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls_and_collectives)


class TorchTPTransformer(ParallelTransformer):
    """A reference ``Transformer`` parallelised in place by ``torch.distributed.tensor.parallel``."""

    scheme = "torch_tp"

    def __init__(self, model: Transformer, mesh, sequence_parallel: bool = True, recompute: str | bool = NONE,
                 timeout_s: float = DEFAULT_TIMEOUT_S, weights: WeightSource | None = None):
        super().__init__(model.cfg, mesh)
        self.recompute = recompute_policy(recompute)
        self.mesh = mesh["tp"]
        self.tp = self.mesh.size()
        self.sequence_parallel = sequence_parallel
        self.timeout_s = timeout_s  # not applied: DTensor's collectives use the process group's timeout

        sp = sequence_parallel
        resid = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
        layer_plan = {
            # Attention.forward(x, cos, sin, mask) and the MLP take x as one replicated DTensor (all-gathered over
            # the sequence with SP), so the q/k/v (gate/up) input gradients are summed as one partial DTensor
            # and reduced ONCE in backward (reduce-scatter with SP, all-reduce without), as in Megatron.
            "attention": PrepareModuleInput(input_layouts=(resid, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=resid),
            "feed_forward": PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w_gate": ColwiseParallel(),
            "feed_forward.w_up": ColwiseParallel(),
            "feed_forward.w_down": RowwiseParallel(output_layouts=resid),
        }
        if sp:
            layer_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        for layer in model.layers:
            parallelize_module(layer, self.mesh, layer_plan)
        top_plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=resid)}
        if sp:
            top_plan["norm"] = SequenceParallel()
        if model.output is not None:
            top_plan["output"] = ColwiseParallel(input_layouts=resid,
                                                 output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, self.mesh, top_plan)
        self._materialize(model, mesh, weights)
        self.module = model

    @torch.no_grad()
    def _materialize(self, model: Transformer, mesh, weights: WeightSource | None) -> None:
        """A model built on the meta device (or given ``weights``): each DTensor's local piece is read alone."""
        if weights is None and next(model.parameters()).device.type != "meta":
            return  # parallelize_module already distributed the built model's weights
        weights = weight_source(model, mesh, weights)
        model.to_empty(device=weights.device)
        rank = self.mesh.get_local_rank()
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):  # left alone by the plan (norms without sequence parallelism)
                p.copy_(weights.get(name))
                continue
            (placement,) = p.placements
            dim = placement.dim if placement.is_shard() else None
            p.to_local().copy_(weights.get(name, dim, self.tp, rank))

    def comms(self):
        return {}  # DTensor runs its own collectives; our comm layer does not see them

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """The global batch, unchanged (every TP rank computes on every token)."""
        return tokens

    def _logits(self, z) -> DTensor:
        """Vocabulary-sharded logits DTensor [B, S, V] (Shard(-1)) from the final-norm hidden states."""
        m = self.module
        if m.output is not None:
            return m.output(z)
        # Tied: the embedding's vocabulary-sharded weight (Shard(0)) is the LM head, applied as ColwiseParallel
        # would: replicated input (all-gathered over the sequence with SP), local logit slice, Shard(-1) output.
        weight = m.tok_embeddings.weight
        if isinstance(z, DTensor):  # sequence parallel: all-gather (its backward reduce-scatters)
            z = z.redistribute(placements=[Replicate()])
        else:  # replicated activations (its backward all-reduces the partial gradients)
            z = DTensor.from_local(z, self.mesh, [Replicate()], run_check=False)
        # Each rank's dz covers its vocabulary slice only: a partial sum, which the backward of the
        # redistribute / from_local above reduces (reduce-scatter with SP, all-reduce without).
        local = F.linear(z.to_local(grad_placements=[Partial()]), weight.to_local())
        shape = (*z.shape[:-1], weight.shape[0])
        return DTensor.from_local(local, self.mesh, [Shard(-1)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def loss_terms(self, tokens: torch.Tensor, labels: torch.Tensor, documents=None) -> LossTerms:
        """Summed cross-entropy and target count of the global batch (``shard_batch`` is the identity)."""
        m, cfg = self.module, self.cfg
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        tables = layer_rope(rope_positions(positions, documents), cfg, rope_length(tokens.shape[1], documents,
                                                                                     positions))
        mask = CAUSAL if documents is None else documents.mask()  # each block adds its own window
        x = scale_embeddings(m.tok_embeddings(tokens), cfg)  # [B, S, h], or [B, S/T, h] local shard with SP
        for layer, (cos, sin) in zip(m.layers, tables):
            if self.recompute == NONE:
                x = layer(x, cos, sin, None, mask)
            else:  # full: the layer's forward again in backward; selective: torch's op policy (_save_matmuls)
                x = checkpoint(layer, x, cos, sin, None, mask, use_reentrant=False,
                               **({"context_fn": _selective_contexts} if self.recompute == SELECTIVE else {}))
        nll_sum = _LossParallelCrossEntropy.apply(self._logits(m.norm(x)), labels)
        # Every rank holds every token: the local count is the global one.
        return LossTerms(nll_sum, (labels != IGNORE_INDEX).sum().to(nll_sum.dtype))

    def _full(self, pick) -> dict[str, torch.Tensor]:
        full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
        return {name: full(pick(p)) for name, p in self.module.named_parameters()}
