"""Mixture of experts under the parallel schemes (see docs/design.md, "Mixture of experts").

TSP folds expert parallelism onto its own axis. Rank p of the ``tsp`` axis (size D) owns experts
[p·E/D, (p+1)·E/D) whole and 1/D of the tokens, as for every other layer. Per sparse layer:

1. every rank routes its own tokens (router weight replicated; its gradient is summed over the axis);
2. the (token, slot) pairs are sorted by expert, hence by owner; one small all-to-all tells every owner how many
   rows of each of its experts each rank sends (the splits of the next two transfers);
3. an all-to-all sends each pair's hidden state to its expert's owner, the owner runs its experts on what it
   received, and a second all-to-all returns the outputs, which each rank weights and sums per token;
4. backward runs the same two all-to-alls in reverse (``AllToAll``): the gradients of the outputs go to the
   experts' owners, the gradients of the inputs come back. No expert weight ever moves; an expert's gradient
   is complete on its owner, because every token routed to it was computed there.

A shared expert (Qwen2-MoE) is a dense gated MLP like any other: its packed shards travel the TSP weight ring
(``TSPFeedForward`` with its own layout). Routing is dropless (no capacity factor), so the split sizes are data:
step 2 reads them on the host, the one host-device synchronisation of a sparse layer (a fake-tensor trace,
which has no values, takes them from a balanced routing: ``host.counts_on_host``).

The other schemes: ``tp`` cuts every expert (and the shared expert) along its FFN dimension, so each rank runs
every expert's slice on every token and one all-reduce sums the partial outputs; ``sp`` and ``dp`` keep whole
replicated experts and run the reference math on their tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..distributed.comm import AxisComm
from ..host import counts_on_host
from ..layers import (
    ExpertKind,
    Experts,
    RouterStats,
    Routing,
    combine,
    expert_mlps,
    gated_shared_expert,
    local_experts,
    moe_layer,
    routing_counts,
    swiglu,
)
from .base import SumOverAxis, replicated_grad

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")  # stacked [E, ...] weights under ``feed_forward.experts.``
EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")  # GPT-OSS's, stacked [E, ...] like the weights


def expert_params(cfg) -> tuple[str, ...]:
    """The stacked expert parameters of ``cfg``'s sparse layers, in ``layers.Experts``' order."""
    return EXPERT_PARAMS + (EXPERT_BIASES if cfg.expert_bias else ())


def experts_of(tensors: dict) -> Experts:
    """``layers.Experts`` from tensors by ``expert_params`` name (missing biases: None)."""
    return Experts(*(tensors.get(name) for name in EXPERT_PARAMS + EXPERT_BIASES))


class AllToAll(torch.autograd.Function):
    """Rows to other ranks (``input_splits[r]`` rows to rank r), rows from them (``output_splits[r]`` from r).
    Backward: the same exchange reversed, the output gradients going back where their rows came from."""

    @staticmethod
    def forward(ctx, x, comm: AxisComm, output_splits: list[int], input_splits: list[int], label: str):
        ctx.comm, ctx.splits, ctx.label = comm, (output_splits, input_splits), label
        return comm.all_to_all_single(x, output_splits, input_splits, label=(label, "forward"))

    @staticmethod
    def backward(ctx, dy):
        output_splits, input_splits = ctx.splits
        dx = ctx.comm.all_to_all_single(dy.contiguous(), input_splits, output_splits, label=(ctx.label, "backward"))
        return dx, None, None, None, None


def exchange_counts(comm: AxisComm, counts: torch.Tensor) -> torch.Tensor:
    """This rank's assignments per expert [E] -> [D, E/D]: row s holds how many rows rank s sends to each of this
    rank's experts (the owner of expert e is e // (E/D))."""
    per = counts.shape[0] // comm.size
    return comm.all_to_all_single(counts, [per] * comm.size, [per] * comm.size, label="moe.counts").view(comm.size, per)


def expert_parallel(experts: Experts, kind: ExpertKind, comm: AxisComm, n_experts: int):
    """``run_experts`` for ``layers.moe_layer`` when this rank owns experts [rank·E/D, (rank+1)·E/D) whole
    (``experts``' tensors [E/D, ...]): every (token, slot) pair goes to its expert's owner, which runs its experts on
    the rows every rank sent it, and the outputs come back to be weighted and summed per token."""

    def run(h2: torch.Tensor, routing: Routing) -> torch.Tensor:
        D, per = comm.size, n_experts // comm.size
        received = exchange_counts(comm, routing.counts)  # [D, per]
        counts = routing_counts(routing)
        mine = slice(comm.rank * per, (comm.rank + 1) * per)
        # [D·per] read on the host; a fake-tensor trace assumes every rank routes its (equally many) tokens as
        # balanced as this one does, so each sends this rank's experts what this rank keeps for them.
        from_each = counts_on_host(received.flatten(), lambda: counts[mine] * D)
        send_splits = [sum(counts[s * per:(s + 1) * per]) for s in range(D)]
        recv_splits = [sum(from_each[s * per:(s + 1) * per]) for s in range(D)]
        x = AllToAll.apply(h2[routing.token], comm, recv_splits, send_splits, "moe.dispatch")
        # Received rows come grouped by source rank, then by expert: regroup them by expert for the expert GEMMs.
        # output_size: the length is already on the host (recv_splits), so this needs no device read.
        local_expert = torch.repeat_interleave(torch.arange(per, device=h2.device).repeat(D), received.flatten(),
                                               output_size=sum(recv_splits))
        by_expert = torch.argsort(local_expert, stable=True)
        per_expert = [sum(from_each[s * per + e] for s in range(D)) for e in range(per)]
        out = expert_mlps(x[by_expert], per_expert, experts, kind)
        out = out[torch.argsort(by_expert)]  # back to (source rank, expert) order
        back = AllToAll.apply(out, comm, send_splits, recv_splits, "moe.combine")
        return combine(h2.shape[0], back, routing.order, routing.token, routing.weights)

    return run


# ---------------------------------------------------------------- baselines


def tp_moe(h, layer, cfg, comm: AxisComm, stats: RouterStats):
    """A sparse layer under TP: every rank holds every token and 1/T of each expert's FFN width (``w_gate``,
    ``w_up`` [E, F/T, h], ``w_down`` [E, h, F/T]) and of the shared expert's. Each rank runs every expert's slice
    and sums the weighted partial outputs locally; one all-reduce completes them (and the shared expert's).

    The router runs replicated on every rank (identical results, nothing to sum). The hidden states and the
    top-k weights enter the sliced experts through ``ReplicatedGrad``: each rank's gradient of them is a partial
    sum over its slice, completed by an all-reduce in backward."""
    h2 = h.reshape(-1, h.shape[-1])
    x = replicated_grad(h2, comm)  # one node for the experts and the shared expert: one all-reduce in backward
    # GPT-OSS's down_bias [E, h] is whole on every rank while each rank's output is a partial sum over FFN slices:
    # rank 0 adds it (the others add exactly 0), and its gradient, rank 0's alone, is summed over the axis so the
    # replicas stay equal.
    down_bias = getattr(layer, "down_bias", None)
    if down_bias is not None:
        down_bias = replicated_grad(down_bias, comm) * float(comm.rank == 0)
    experts = experts_of({n: getattr(layer, n, None) for n in expert_params(cfg)})._replace(down_bias=down_bias)
    slices = local_experts(experts, ExpertKind.of(cfg))
    run = lambda _, routing: slices(x, replace(routing, weights=replicated_grad(routing.weights, comm)))
    shared = None
    if cfg.shared_expert_ffn_dim:
        # The shared gate multiplies the complete shared output: its partial is summed with the experts' first.
        shared = lambda _: swiglu(x, layer.shared_w_gate, layer.shared_w_up, layer.shared_w_down) * replicated_grad(
            torch.sigmoid(F.linear(h2, layer.shared_gate)), comm)
    y = moe_layer(h2, layer.router, run, cfg, stats, shared, getattr(layer, "router_bias", None))
    return SumOverAxis.apply(y, comm).view(h.shape)


def moe_reference_layer(h, w: dict[str, torch.Tensor], cfg, stats: RouterStats):
    """The reference sparse layer on tokens h with full weights ``w`` (names inside ``feed_forward.``), for
    schemes that replicate the experts (sp, dp): the model's own functions, on this rank's tokens."""
    shared = None
    if cfg.shared_expert_ffn_dim:
        shared = gated_shared_expert(w["shared_gate.weight"], w["shared.w_gate.weight"], w["shared.w_up.weight"],
                                     w["shared.w_down.weight"])
    run = local_experts(experts_of({n: w[f"experts.{n}"] for n in expert_params(cfg)}), ExpertKind.of(cfg))
    return moe_layer(h, w["router.weight"], run, cfg, stats, shared, w.get("router.bias"))


# ---------------------------------------------------------------- inference (no autograd)


def moe_partial(h: torch.Tensor, w: dict[str, torch.Tensor], cfg, first: int = 0) -> torch.Tensor:
    """This rank's share of a sparse layer's output for tokens h [..., dim] that every rank holds: the experts
    [first, first + n) of ``w`` (``w_gate``, ``w_up`` [n, F', h], ``w_down`` [n, h, F']: whole experts, or every
    expert's FFN slice) and the shared expert's slice (``shared_w_*``, gated by ``shared_gate``). Summed over the
    ranks that split the experts, the shares are the layer's output; with every weight whole, it is the output.
    Each rank computes only its experts' rows: the tokens go to the experts, no expert weight moves. GPT-OSS's
    ``down_bias`` is added where ``w`` holds it: give it to one rank only where the experts are FFN slices."""
    shared = None
    if "shared_gate" in w:
        shared = gated_shared_expert(w["shared_gate"], w["shared_w_gate"], w["shared_w_up"], w["shared_w_down"])
    run = local_experts(experts_of(w), ExpertKind.of(cfg), first)
    return moe_layer(h, w["router"], run, cfg, None, shared, w.get("router_bias"))


def ffn_partial(h: torch.Tensor, w: dict[str, torch.Tensor], cfg, first: int = 0) -> torch.Tensor:
    """This rank's share of a block's feed-forward output for tokens h that every rank holds: its slice of the
    gated MLP (``w_gate``, ``w_up``, ``w_down``) or, for a sparse layer (``router`` in ``w``), ``moe_partial``."""
    if "router" in w:
        return moe_partial(h, w, cfg, first)
    return swiglu(h, w["w_gate"], w["w_up"], w["w_down"], cfg.mlp_activation)  # SwiGLU, or Gemma's GeGLU
