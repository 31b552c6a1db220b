"""What every parallel scheme shares: the public interface, the one training layer loop, the mesh-axis check and
two tiny autograd bridges."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..distributed.comm import AxisComm
from ..distributed.mesh import mesh_device, mesh_sizes
from ..host import on_host
from ..layer_kinds import LayerSpec
from ..layers import (
    IGNORE_INDEX,
    Documents,
    LossTerms,
    Mask,
    Placement,
    RouterStats,
    as_documents,
    block_forward,
    load_balancing_loss,
    rope_length,
    rope_positions,
    rope_tables,
)
from ..model import reference_shapes
from ..recompute import FULL, NONE
from ..schemes import SCHEMES
from ..weights import ModelWeights, SeededWeights, WeightSource
from .params import layer_params


class SumOverAxis(torch.autograd.Function):
    """Forward: all-reduce a per-rank partial sum. Backward: identity, because every rank holds the
    same global value and each rank back-propagates only its own share of it."""

    @staticmethod
    def forward(ctx, partial, comm: AxisComm):
        return comm.all_reduce(partial.clone(), label="loss")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReplicatedGrad(torch.autograd.Function):
    """Forward: identity on each tensor. Backward: their gradients summed over the axis, in one all-reduce (in
    ``sum_dtype``, default the gradients' own).

    Wrap weights replicated over an axis whose ranks see different tokens: each rank's local gradient covers
    its own tokens only, the sum covers them all. One call over several weights is one node of the backward
    graph, run once every weight's gradient is in: one meeting of the ranks instead of one per weight. TSP
    sums its norm weights' bf16 gradients in float32: each rank's partial sum is rounded once, not again at
    every addition. ``replicated_grad`` is the one-tensor form.
    """

    @staticmethod
    def forward(ctx, comm: AxisComm, sum_dtype, *tensors):
        ctx.comm, ctx.sum_dtype = comm, sum_dtype
        views = tuple(t.view_as(t) for t in tensors)
        return views[0] if len(views) == 1 else views

    @staticmethod
    def backward(ctx, *grads):
        dtype = ctx.sum_dtype or grads[0].dtype
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        summed = ctx.comm.all_reduce(flat, label="replicated.grad")
        parts = summed.split([g.numel() for g in grads])
        return (None, None, *(part.view_as(g).to(g.dtype) for part, g in zip(parts, grads)))


def replicated_grad(tensor: torch.Tensor, comm: AxisComm, sum_dtype=None) -> torch.Tensor:
    """``tensor`` in forward; in backward its gradient summed over ``comm`` (``ReplicatedGrad``)."""
    return ReplicatedGrad.apply(comm, sum_dtype, tensor)


def global_sum_and_count(nll_sum: torch.Tensor, labels: torch.Tensor, comm: AxisComm):
    """(sum of every rank's NLL sum, count of every rank's targets) over ``comm``, for ranks that hold
    different tokens; the sum back-propagates each rank's own share."""
    count = comm.all_reduce((labels != IGNORE_INDEX).sum().to(nll_sum.dtype), label="loss")
    return SumOverAxis.apply(nll_sum, comm), count


def sum_router_stats_over(comm: AxisComm, counts: torch.Tensor, probs: torch.Tensor, rows):
    """Router statistics summed over ``comm``, for ranks that hold different tokens: one all-reduce; the
    probability sums back-propagate each rank's own share (as ``SumOverAxis``)."""
    rows = torch.as_tensor(rows, dtype=probs.dtype, device=probs.device).detach().reshape(1)
    total = SumOverAxis.apply(torch.cat([counts, probs, rows]), comm)
    E = counts.shape[0]
    return total[:E].detach(), total[E:2 * E], total[2 * E].detach()


def weight_source(model, mesh, weights: WeightSource | None = None) -> WeightSource:
    """Where a scheme's shards come from, on the device this rank computes on: ``weights`` if given; else the
    model's own tensors, or, for a model built on the meta device, its seeded initial values."""
    on_meta = next(model.parameters()).device.type == "meta"
    device = mesh_device(mesh) if on_meta else next(model.parameters()).device
    if weights is None:
        weights = SeededWeights(model.cfg, model.init_seed) if on_meta else ModelWeights(model)
    elif weights.shapes != reference_shapes(model.cfg):
        raise ValueError("the weights describe another model than the one given to parallelize; build the model "
                         "from the checkpoint's config")
    return weights.on(device)


@torch.no_grad()
def materialize(model, mesh, weights: WeightSource | None = None) -> None:
    """Give a replicated scheme's whole model its weights, one tensor at a time: from ``weights`` if given,
    from the seeded initial values if it is on the meta device; a built model without ``weights`` is kept."""
    on_meta = next(model.parameters()).device.type == "meta"
    if weights is None and not on_meta:
        return
    weights = weight_source(model, mesh, weights)
    if on_meta:
        model.to_empty(device=weights.device)
    for name, p in model.named_parameters():
        p.copy_(weights.get(name))


@dataclass(frozen=True)
class ShardView:
    """What an inference engine reads of a model on this rank, detached (no autograd): ``layers``, per layer the
    weights under ``parallel.tp.layer_params``' names (this rank's slices of them, or whole); ``embedding`` and
    ``head``, this rank's vocabulary rows (padded to equal slices) or the whole tables; ``norm``, the final norm;
    ``comm``, the axis the weight slices, or the tokens, are split over."""

    cfg: object
    comm: AxisComm
    layers: tuple[dict[str, torch.Tensor], ...]
    embedding: torch.Tensor
    head: torch.Tensor
    norm: torch.Tensor


def reference_view(model, comm: AxisComm) -> ShardView:
    """The whole reference ``Transformer``'s weights as a view, with the axis its replicas split tokens (or rows)
    over."""
    layers = tuple({attr: layer.get_parameter(ref).detach() for attr, (ref, _) in layer_params(model.cfg, i).items()}
                   for i, layer in enumerate(model.layers))
    return ShardView(model.cfg, comm, layers, model.tok_embeddings.weight.detach(), model.output_weight.detach(),
                     model.norm.weight.detach())


class LayerInputs(NamedTuple):
    """What the layer loop hands a scheme's ``placement`` for one layer: its kind (``spec``), the RoPE tables of
    its kind at this rank's positions, its mask (causal, the packed rows' documents, its window) and where a sparse
    layer adds its router statistics."""

    spec: LayerSpec
    cos: torch.Tensor
    sin: torch.Tensor
    mask: Mask
    stats: RouterStats | None


class ParallelTransformer(nn.Module):
    """The interface every scheme exposes (see ``torchtsp.parallelize``).

    Subclasses set ``scheme`` (a name in ``torchtsp.schemes.SCHEMES``, whose entry lists the mesh axes the
    scheme uses) and implement ``shard_batch``, ``loss_terms`` and ``_full``. They are built by
    ``parallelize``, which resolves and checks their ``Layout`` first.

    A training scheme runs the one layer loop, ``hidden_states``, and supplies what differs: the global positions
    its attention computes at (``attention_positions``), what one forward shares across layers
    (``forward_state``), one layer's ``placement`` (its attention and MLP strategies and norms) and, under full
    recompute, what must also run again (``recompute_context``); and its ``embed`` and head.
    """

    scheme = "?"
    recompute = NONE  # the activation recompute policy (recompute.POLICIES) the layer loop applies
    # A mixture-of-experts model's last loss, for metrics only: (its load-balancing loss, assignments per expert
    # over every rank's tokens), both detached. The loss itself never reads it (``LossTerms`` carries the router).
    router_load: tuple[torch.Tensor, torch.Tensor] | None = None

    layout = None  # the Layout parallelize resolved and checked (torchtsp.layout)
    # How gradients are summed over data-parallel replicas (``parallel/dp.py``'s ``AllReduceGrads``, or a
    # distributed optimizer's reduce-scatter); None: this model has no replicas.
    grad_sum = None
    # Whether forward and backward run together in one schedule (pipeline stages): no separate loss to call.
    joint_forward_backward = False

    def __init__(self, cfg, mesh):
        super().__init__()
        # parallelize and pipeline_parallelize refuse, with what to change, a mesh or a model this scheme cannot
        # take (``Layout``); what reaches a constructor has passed those checks.
        sizes = mesh_sizes(mesh)
        assert all(axis in sizes for axis in SCHEMES[self.scheme].axes), f"{self.scheme} needs the mesh axes"
        self.cfg = cfg

    def comms(self) -> dict[str, AxisComm]:
        """The mesh axes this model communicates over, by name (for counting traffic)."""
        raise NotImplementedError

    def sum_gradients_with(self, strategy) -> None:
        """Sum gradients over the data-parallel replicas with ``strategy`` from now on; None keeps the model's own.
        A model without replicas has nothing to sum."""
        if strategy is not None:
            raise ValueError(f"{type(self).__name__} has no data-parallel replicas to sum gradients over")

    def traffic_seq_rank(self) -> int | None:
        """What ``predict_comm(seq_rank=...)`` needs to count this rank's bytes: its rank on the sequence axis
        (tsp or sp) when that axis moves K/V point to point (gloo), which skips the halves causality never reads;
        None when it gathers them whole (NCCL) or the scheme has no sequence axis."""
        for name in ("tsp", "sp"):
            comm = self.comms().get(name)
            if comm is not None and comm.point_to_point:
                return comm.rank
        return None

    def traffic_args(self) -> dict:
        """``predict_comm``'s keywords that count this rank's bytes on any backend: its rank on the sequence axis
        (tsp or sp; sliding layers' K/V exchange depends on it everywhere) and whether that axis moves full layers'
        K/V point to point; {} without a sequence axis."""
        for name in ("tsp", "sp"):
            comm = self.comms().get(name)
            if comm is not None and comm.size > 1:
                return {"seq_rank": comm.rank, "point_to_point": comm.point_to_point}
        return {}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global [B, S] batch (tokens or labels)."""
        raise NotImplementedError

    def shard_documents(self, documents: Documents | None) -> Documents | None:
        """The packed documents of this rank's rows of a global batch (``shard_batch``'s rows; the whole
        sequence, which every rank of a sequence axis knows)."""
        return documents

    def loss_terms(self, tokens: torch.Tensor, labels: torch.Tensor, documents: Documents | None = None) -> LossTerms:
        """(summed cross-entropy, number of targets) over every token of the scheme's ranks, from this rank's
        share of tokens and labels, identical on those ranks (data parallelism sums both over replicas), and a
        mixture of experts' router statistics of this rank's tokens. ``documents``: ``shard_documents`` of the
        batch's ``Documents`` (packed rows), or None.

        A scheme supplies the model's three parts, each placed its own way (and a pipeline stage runs one or
        more of them): ``embed`` (its vocabulary placement), ``hidden_states`` (every layer's
        ``layers.block_forward`` with the scheme's attention / MLP / MoE strategies) and
        ``head_nll_sum_and_count`` (its head and cross-entropy)."""
        stats = RouterStats(self.cfg.n_experts) if self.cfg.moe else None
        x = self.hidden_states(self.embed(tokens), stats, documents)
        return LossTerms(*self.head_nll_sum_and_count(x, labels), stats)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens -> their embeddings, as the scheme places them."""
        raise NotImplementedError

    def hidden_states(self, x: torch.Tensor, stats: RouterStats | None = None,
                      documents: Documents | None = None) -> torch.Tensor:
        """The one training layer loop: embeddings x (this rank's share) -> the last layer's output (before the
        final norm). Per layer kind the RoPE tables of this rank's positions (within their documents), per layer
        its mask, its ``placement`` run by ``layers.block_forward``, under the recompute policy (full: each
        layer keeps its input only and backward runs its forward again, with the scheme's
        ``recompute_context``; selective: the scheme's MLP recomputes its hidden state). Sparse layers add their
        router statistics to ``stats``; ``documents``: the packed documents of these rows."""
        positions, seq_len = self.attention_positions(x)
        rope_at, length = rope_positions(positions, documents), rope_length(seq_len, documents, positions)
        tables = {}  # one pair of tables per RoPE spec: layers of one kind share them
        state = self.forward_state(documents)
        for spec in self.cfg.layer_specs:
            if spec.rope not in tables:
                tables[spec.rope] = rope_tables(rope_at, spec.rope, length)
            inputs = LayerInputs(spec, *tables[spec.rope], spec.attention.mask(documents), stats)
            x = self._run_layer(x, inputs, state)
        return x

    def _run_layer(self, x: torch.Tensor, inputs: LayerInputs, state) -> torch.Tensor:
        layer = lambda h: block_forward(h, self.placement(inputs, state))
        if self.recompute != FULL:
            return layer(x)
        return checkpoint(layer, x, use_reentrant=False, context_fn=lambda: self.recompute_context(state))

    def attention_positions(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(global positions [L] of the tokens this rank's attention computes queries and keys for, the whole
        sequence's length), for this rank's activations x."""
        raise NotImplementedError

    def forward_state(self, documents: Documents | None):
        """What one forward's layers share (TSP: its cross-layer prefetch and the summed norm weights); None."""
        return None

    def placement(self, inputs: LayerInputs, state) -> Placement:
        """Layer ``inputs.spec.index``'s strategies on this rank (``layers.Placement``)."""
        raise NotImplementedError

    def recompute_context(self, state):
        """The (forward, recompute) contexts of ``torch.utils.checkpoint``'s ``context_fn`` under full recompute
        (TSP: its prefetch knows a re-run from a first run)."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    def head_nll_sum_and_count(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output -> (summed cross-entropy, number of targets) over the scheme's ranks."""
        raise NotImplementedError

    def nll_sum_and_count(self, tokens: torch.Tensor, labels: torch.Tensor,
                          documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first two of ``loss_terms``."""
        terms = self.loss_terms(tokens, labels, documents)
        return terms.nll_sum, terms.count

    def loss_on_shard(self, tokens: torch.Tensor, labels: torch.Tensor,
                      documents: Documents | None = None) -> torch.Tensor:
        """Global mean cross-entropy from this rank's share of tokens and labels (and ``shard_documents``).

        A batch without any target is 0 with zero gradients (not 0/0 = NaN, which would poison a
        data-parallel gradient sum).
        """
        terms = self.loss_terms(tokens, labels, documents)
        loss = terms.nll_sum / terms.count.clamp_min(1)
        if self.cfg.moe:
            loss = loss + self.cfg.router_aux_loss_coef * self.aux_loss(terms.router)
        return loss

    def aux_loss(self, router: RouterStats, totals: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """The load-balancing loss of the forward whose router statistics are ``router``, from statistics summed
        over every rank's tokens (``sum_router_stats``). ``totals`` = (assignments per expert, rows) of a whole
        batch this forward is a part of (gradient accumulation), in place of this forward's own: the loss is then
        this part's share of the whole batch's. Records ``router_load`` for metrics."""
        if router is None:
            raise NotImplementedError(f"scheme {self.scheme!r} does not implement mixture-of-experts models")
        counts, probs, rows = self.sum_router_stats(router.close())
        if totals is not None:
            counts, rows = totals
        aux = load_balancing_loss(counts, probs, rows, self.cfg.n_experts)
        self.router_load = (aux.detach(), counts.detach())
        return aux

    def router_metrics(self) -> dict[str, float]:
        """The last loss's load-balancing loss and expert load: (token, slot) assignments per expert and sparse
        layer, over every rank's tokens, min and max over experts ({} for a dense model)."""
        if not self.cfg.moe or self.router_load is None:
            return {}
        aux, counts = self.router_load
        load = counts / sum(map(self.cfg.is_moe_layer, range(self.cfg.n_layers)))
        return {"aux_loss": aux.item(), "expert_load_min": load.min().item(), "expert_load_max": load.max().item()}

    def sum_router_stats(self, stats: RouterStats):
        """(assignments per expert, probability sums per expert, rows) over every token of the scheme's ranks.
        Schemes whose ranks hold different tokens sum them over those ranks (``sum_router_stats_over``)."""
        return stats.counts, stats.probs, stats.rows

    def _full(self, pick) -> dict[str, torch.Tensor]:
        """Reference-named full tensors assembled from ``pick(param)`` of every rank."""
        raise NotImplementedError

    def fsdp_blocks(self) -> list[nn.Module]:
        """Modules FSDP2 (``--zero 3``) may shard as units of their own, because only their own forward reads their
        weights. None for a scheme whose schedule reads a later layer's weights early (TSP prefetches the next
        layer's shard, sums all norm gradients at once): the whole model is then one unit."""
        return []

    def reference_parts(self, name: str, local: torch.Tensor) -> list[tuple[str, torch.Tensor, dict[str, int]]]:
        """Split a tensor shaped like parameter ``name`` (the parameter, its gradient or an optimizer
        state) into reference-named pieces: (reference name, view of ``local``, {mesh axis: dim it is
        sharded along}). An empty dict means replicated. Checkpoints and the global gradient norm use this.

        The default suits schemes whose parameters are whole reference parameters.
        """
        return [(name, local, {})]

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids=None) -> torch.Tensor:
        """Global mean cross-entropy of the GLOBAL batch (the same [B, S] tokens and labels on every rank).
        ``document_ids`` [B, S] (or ``Documents``): packed rows, each token attending within its document,
        positions counting from 0 at each document's start; None: one sequence per row."""
        self.check_inputs(tokens, labels)
        documents = as_documents(document_ids, tokens.shape)
        return self.loss_on_shard(self.shard_batch(tokens), self.shard_batch(labels), self.shard_documents(documents))

    def check_inputs(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Refuse a global batch the model cannot take: shapes, length and the layout's divisibility always (no
        device read), ids and labels outside the vocabulary when the batch is still on the host. A batch
        already on an accelerator is not read: that would stall its stream every step (the trainer checks
        the host batch before moving it, ``check_values``)."""
        if tokens.dim() != 2 or labels.shape != tokens.shape:
            raise ValueError(f"expected tokens and labels of one [batch, seq] shape, got {tuple(tokens.shape)} "
                             f"and {tuple(labels.shape)}")
        self.cfg.check_length(tokens.shape[1])
        if self.layout is not None:
            self.layout.check_batch(*tokens.shape)
        if tokens.device.type == "cpu":
            self.check_values(tokens, labels)

    def check_values(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Refuse token ids and targets outside the vocabulary (reads the values: call it on the host batch)."""
        with on_host():  # the host batch is real in a fake-tensor trace too (torchtsp.trace): its values are read
            self._check_values(tokens, labels)

    def _check_values(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}), "
                             f"got [{tokens.min().item()}, {tokens.max().item()}]")
        # A target outside the vocabulary would read a padding row (or nothing) of a sharded output layer.
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.cfg.vocab_size))
        if bad.any():
            raise ValueError(f"labels must lie in [0, {self.cfg.vocab_size}) or be the ignore index {IGNORE_INDEX}, "
                             f"got {labels[bad][0].item()}")

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids=None) -> torch.Tensor:
        """``loss(tokens, labels, document_ids)`` and its backward (gradients accumulate into ``.grad``); returns
        the loss, detached. A pipeline (``parallel/pipeline.py``) runs both in one schedule, so trainers call this."""
        loss = self.loss(tokens, labels, document_ids)
        loss.backward()
        return loss.detach()

    def shard_view(self):
        """This rank's weights as an inference engine reads them (``ShardView``, or the scheme's own typed view)."""
        raise ValueError(f"generate does not run the {self.scheme} scheme")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights by reference parameter name, on every rank."""
        return {k: v.clone() for k, v in self._full(lambda p: p.detach()).items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients by reference parameter name, on every rank (zeros where no gradient yet)."""
        return {k: v.clone() for k, v in self._full(lambda p: p.grad if p.grad is not None
                                                    else torch.zeros_like(p)).items()}


class ReplicatedTransformer(ParallelTransformer):
    """Base of schemes that keep the whole model on every rank of one axis whose ranks see different
    tokens (SP): the reference model is adopted as this rank's replica, and its gradients are summed over
    the axis."""

    axis = "?"

    def __init__(self, model, mesh, timeout_s: float, weights: WeightSource | None = None):
        super().__init__(model.cfg, mesh)
        self.comm = AxisComm.from_mesh(mesh, self.axis, timeout_s)
        materialize(model, mesh, weights)
        self.module = model  # the replica
        for p in model.parameters():
            # A hook on the gradient flowing into each weight (before accumulation into .grad), so
            # gradient accumulation over several backward passes stays exact.
            p.register_hook(self._sum_over_axis)

    def _sum_over_axis(self, grad: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(grad.clone(), label="replicated.grad")

    def comms(self):
        return {self.axis: self.comm}

    def reference_parts(self, name, local):
        return [(name.removeprefix("module."), local, {})]

    def shard_view(self) -> ShardView:
        return reference_view(self.module, self.comm)

    def _full(self, pick):
        return {name: pick(p) for name, p in self.module.named_parameters()}
