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
step 2 reads them on the host, the one host-device synchronisation of a sparse layer.

The other schemes: ``tp`` cuts every expert (and the shared expert) along its FFN dimension, so each rank runs
every expert's slice on every token and one all-reduce sums the partial outputs; ``sp`` and ``dp`` keep whole
replicated experts and run the reference math on their tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.comm import AxisComm
from ..model import RouterStats, combine, expert_mlps, route, sort_by_expert
from .base import SumOverAxis, replicated_grad
from .shards import PackedLayout, Part

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")  # stacked [E, ...] weights under ``feed_forward.experts.``


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


def expert_parallel(h2, weights, experts, w_gate, w_up, w_down, comm: AxisComm, n_experts: int, sorted_pairs=None):
    """y [N, h] = the routed experts' weighted outputs for tokens h2 [N, h] with top-k ``weights`` and ids
    ``experts`` [N, k]; this rank holds experts [rank·E/D, (rank+1)·E/D) (w_* [E/D, ...]) and runs them on the
    rows every rank sends it."""
    D, per = comm.size, n_experts // comm.size
    order, token, counts = sorted_pairs if sorted_pairs is not None else sort_by_expert(experts, n_experts)
    received = exchange_counts(comm, counts)  # [D, per]
    send_splits = counts.view(D, per).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    x = AllToAll.apply(h2[token], comm, recv_splits, send_splits, "moe.dispatch")
    # Received rows come grouped by source rank, then by expert: regroup them by expert for the expert GEMMs.
    local_expert = torch.repeat_interleave(torch.arange(per, device=h2.device).repeat(D), received.flatten())
    by_expert = torch.argsort(local_expert, stable=True)
    out = expert_mlps(x[by_expert], received.sum(dim=0).tolist(), w_gate, w_up, w_down)
    out = out[torch.argsort(by_expert)]  # back to (source rank, expert) order
    back = AllToAll.apply(out, comm, send_splits, recv_splits, "moe.combine")
    return combine(h2.shape[0], back, order, token, weights)


def shared_layout(cfg, world: int) -> PackedLayout:
    """The packed TSP shards of the shared expert (the ring's layout, with the shared expert's width)."""
    h, width = cfg.dim, cfg.shared_expert_ffn_dim
    return PackedLayout((
        Part("feed_forward.shared.w_gate.weight", (width, h), 0),
        Part("feed_forward.shared.w_up.weight", (width, h), 0),
        Part("feed_forward.shared.w_down.weight", (h, width), 1),
    ), world)


def check_experts_split(cfg, world: int, axis: str = "tsp") -> None:
    if cfg.n_experts % world:
        raise ValueError(f"TSP places whole experts on ranks: {axis}={world} needs n_experts={cfg.n_experts} "
                         f"divisible by {world}; choose a degree that divides it")


class TSPMoE(nn.Module):
    """A sparse layer's parameters on one TSP rank, and its forward (see the module docstring).

    ``router`` [E, h] and ``shared_gate`` [1, h] replicated; ``w_gate``, ``w_up`` [E/D, F, h] and ``w_down``
    [E/D, h, F]: this rank's experts, whole; ``shared_shard``: this rank's packed shared-expert shard.
    """

    def __init__(self, cfg, comm: AxisComm, weights, prefix: str):
        super().__init__()
        check_experts_split(cfg, comm.size)
        self.cfg, self.comm = cfg, comm
        D, p = comm.size, comm.rank
        self.router = nn.Parameter(weights.get(prefix + "feed_forward.router.weight"))
        for name in EXPERT_PARAMS:
            setattr(self, name, nn.Parameter(weights.get(f"{prefix}feed_forward.experts.{name}", 0, D, p)))
        self.layout = shared_layout(cfg, D) if cfg.shared_expert_ffn_dim else None
        self.shared_shard = self.shared_gate = None
        if self.layout is not None:
            self.shared_shard = nn.Parameter(self.layout.pack(weights, prefix, p))
            self.shared_gate = nn.Parameter(weights.get(prefix + "feed_forward.shared_gate.weight"))

    def forward(self, h: torch.Tensor, stats: RouterStats, math, prefetch=None, prefetch_backward=None):
        """y for this rank's normed tokens h [B, S/D, dim]; the router statistics go to ``stats``.
        ``math``, ``prefetch*``: the TSP layer's, for the shared expert's ring (``TSPFeedForward``)."""
        from .tsp import TSPFeedForward  # tsp.py builds this class: imported here to avoid an import cycle

        cfg, comm = self.cfg, self.comm
        h2 = h.reshape(-1, h.shape[-1])
        probs, weights, experts = route(h2, replicated_grad(self.router, comm), cfg.moe_top_k,
                                        cfg.moe_norm_topk)
        pairs = sort_by_expert(experts, cfg.n_experts)
        stats.add(probs, pairs[2])
        y = expert_parallel(h2, weights, experts, self.w_gate, self.w_up, self.w_down, comm, cfg.n_experts,
                            sorted_pairs=pairs)
        if self.layout is not None:
            shared = TSPFeedForward.apply(h, self.shared_shard, math, prefetch, prefetch_backward, self.layout)
            gate = torch.sigmoid(F.linear(h2, replicated_grad(self.shared_gate, comm)))
            y = y + gate * shared.reshape(h2.shape)
        return y.view(h.shape)

    def reference_parts(self, prefix: str, name: str, local: torch.Tensor):
        """Reference-named pieces of parameter ``name`` of this module (see ``ParallelTransformer``)."""
        if name == "router":
            return [(f"{prefix}.feed_forward.router.weight", local, {})]
        if name == "shared_gate":
            return [(f"{prefix}.feed_forward.shared_gate.weight", local, {})]
        if name in EXPERT_PARAMS:
            return [(f"{prefix}.feed_forward.experts.{name}", local, {"tsp": 0})]
        return [(f"{prefix}.{part.name}", view, {"tsp": part.shard_dim})
                for part, view in zip(self.layout.parts, self.layout.unpack(local))]

    def full(self, prefix: str, pick) -> dict[str, torch.Tensor]:
        """Reference-named full tensors of ``pick(param)`` gathered from every rank."""
        gather = lambda t: self.comm.all_gather(t.contiguous(), label="gather_full")
        out = {f"{prefix}.feed_forward.router.weight": pick(self.router)}
        for name in EXPERT_PARAMS:
            out[f"{prefix}.feed_forward.experts.{name}"] = gather(pick(getattr(self, name))).flatten(0, 1)
        if self.layout is not None:
            for name, t in self.layout.unpack_gathered(gather(pick(self.shared_shard))).items():
                out[f"{prefix}.{name}"] = t
            out[f"{prefix}.feed_forward.shared_gate.weight"] = pick(self.shared_gate)
        return out


# ---------------------------------------------------------------- baselines


def tp_moe(h, layer, cfg, comm: AxisComm, stats: RouterStats):
    """A sparse layer under TP: every rank holds every token and 1/T of each expert's FFN width (``w_gate``,
    ``w_up`` [E, F/T, h], ``w_down`` [E, h, F/T]) and of the shared expert's. Each rank runs every expert's slice
    and sums the weighted partial outputs locally; one all-reduce completes them (and the shared expert's).

    The router runs replicated on every rank (identical results, nothing to sum). The hidden states and the
    top-k weights enter the sliced experts through ``ReplicatedGrad``: each rank's gradient of them is a partial
    sum over its slice, completed by an all-reduce in backward."""
    h2 = h.reshape(-1, h.shape[-1])
    probs, weights, experts = route(h2, layer.router, cfg.moe_top_k, cfg.moe_norm_topk)
    order, token, counts = sort_by_expert(experts, cfg.n_experts)
    stats.add(probs, counts)
    x = replicated_grad(h2, comm)
    out = expert_mlps(x[token], counts.tolist(), layer.w_gate, layer.w_up, layer.w_down)
    y = combine(h2.shape[0], out, order, token, replicated_grad(weights, comm))
    gate = None
    if cfg.shared_expert_ffn_dim:
        gate = torch.sigmoid(F.linear(h2, layer.shared_gate))
        # The shared gate multiplies the complete shared output: its partial is summed with the experts' first.
        y = y + F.linear(F.silu(F.linear(x, layer.shared_w_gate)) * F.linear(x, layer.shared_w_up),
                         layer.shared_w_down) * replicated_grad(gate, comm)
    return SumOverAxis.apply(y, comm).view(h.shape)


def moe_reference_layer(h, w: dict[str, torch.Tensor], cfg, stats: RouterStats):
    """The reference sparse layer on tokens h with full weights ``w`` (names inside ``feed_forward.``), for
    schemes that replicate the experts (sp, dp): the model's own functions, on this rank's tokens."""
    h2 = h.reshape(-1, h.shape[-1])
    probs, weights, experts = route(h2, w["router.weight"], cfg.moe_top_k, cfg.moe_norm_topk)
    order, token, counts = sort_by_expert(experts, cfg.n_experts)
    stats.add(probs, counts)
    out = expert_mlps(h2[token], counts.tolist(), w["experts.w_gate"], w["experts.w_up"], w["experts.w_down"])
    y = combine(h2.shape[0], out, order, token, weights)
    if cfg.shared_expert_ffn_dim:
        shared = F.linear(F.silu(F.linear(h2, w["shared.w_gate.weight"])) * F.linear(h2, w["shared.w_up.weight"]),
                          w["shared.w_down.weight"])
        y = y + torch.sigmoid(F.linear(h2, w["shared_gate.weight"])) * shared
    return y.view(h.shape)


# ---------------------------------------------------------------- inference (no autograd)


def moe_partial(h: torch.Tensor, w: dict[str, torch.Tensor], cfg, first: int = 0) -> torch.Tensor:
    """This rank's share of a sparse layer's output for tokens h [..., dim] that every rank holds: the experts
    [first, first + n) of ``w`` (``w_gate``, ``w_up`` [n, F', h], ``w_down`` [n, h, F']: whole experts, or every
    expert's FFN slice) and the shared expert's slice (``shared_w_*``, gated by ``shared_gate``). Summed over the
    ranks that split the experts, the shares are the layer's output; with every weight whole, it is the output.
    Each rank computes only its experts' rows: the tokens go to the experts, no expert weight moves."""
    h2 = h.reshape(-1, h.shape[-1])
    _, weights, experts = route(h2, w["router"], cfg.moe_top_k, cfg.moe_norm_topk)
    order, token, counts = sort_by_expert(experts, cfg.n_experts)
    n = w["w_gate"].shape[0]
    bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)])[[first, first + n]].tolist()
    rows = slice(*bounds)
    out = expert_mlps(h2[token[rows]], counts[first:first + n].tolist(), w["w_gate"], w["w_up"], w["w_down"])
    y = combine(h2.shape[0], out, order[rows], token[rows], weights)
    if "shared_gate" in w:
        shared = F.linear(F.silu(F.linear(h2, w["shared_w_gate"])) * F.linear(h2, w["shared_w_up"]),
                          w["shared_w_down"])
        y = y + torch.sigmoid(F.linear(h2, w["shared_gate"])) * shared
    return y.view(h.shape)


def tsp_inference_weights(moe: TSPMoE) -> dict[str, torch.Tensor]:
    """A TSP sparse layer's weights on this rank under ``moe_partial``'s names (its experts, its shared slice)."""
    w = {name: getattr(moe, name).detach() for name in ("router", *EXPERT_PARAMS)}
    if moe.layout is not None:
        w.update(zip(("shared_w_gate", "shared_w_up", "shared_w_down"), moe.layout.unpack(moe.shared_shard.detach())))
        w["shared_gate"] = moe.shared_gate.detach()
    return w


@torch.no_grad()
def tsp_moe_local_tokens(h: torch.Tensor, moe: TSPMoE) -> torch.Tensor:
    """A TSP sparse layer on this rank's own tokens h [B, T_p, dim] (T_p may be 0): the training schedule without
    autograd (expert all-to-alls; the shared expert's shards around the ring)."""
    from .tsp import ring_each  # tsp.py builds TSPMoE: imported here to avoid an import cycle

    cfg, comm = moe.cfg, moe.comm
    h2 = h.reshape(-1, h.shape[-1])
    _, weights, experts = route(h2, moe.router, cfg.moe_top_k, cfg.moe_norm_topk)
    y = expert_parallel(h2, weights, experts, moe.w_gate, moe.w_up, moe.w_down, comm, cfg.n_experts)
    if moe.layout is not None:
        shared = torch.zeros_like(h2)
        for _, w in ring_each(comm, moe.shared_shard.detach(), "infer.moe.shared"):
            wg, wu, wd = moe.layout.unpack(w)
            shared += F.linear(F.silu(F.linear(h2, wg)) * F.linear(h2, wu), wd)
        y = y + torch.sigmoid(F.linear(h2, moe.shared_gate)) * shared
    return y.view(h.shape)
