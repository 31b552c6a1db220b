"""A mixture of experts on the TSP axis: whole experts per rank, tokens dispatched by all-to-all (see
``parallel/moe.py`` for the exchange and docs/design.md, "Mixture of experts")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.comm import AxisComm
from ...layers import ExpertKind, RouterStats, moe_layer
from ..base import replicated_grad
from ..moe import expert_parallel, expert_params, experts_of
from ..shards import PackedLayout, Part
from .rings import TSPFeedForward, ring_mlp


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
        self.router_bias = nn.Parameter(weights.get(prefix + "feed_forward.router.bias")) if cfg.router_bias else None
        self.expert_names = expert_params(cfg)
        for name in self.expert_names:
            setattr(self, name, nn.Parameter(weights.get(f"{prefix}feed_forward.experts.{name}", 0, D, p)))
        self.layout = shared_layout(cfg, D) if cfg.shared_expert_ffn_dim else None
        self.shared_shard = self.shared_gate = None
        if self.layout is not None:
            self.shared_shard = nn.Parameter(self.layout.pack(weights, prefix, p))
            self.shared_gate = nn.Parameter(weights.get(prefix + "feed_forward.shared_gate.weight"))

    def forward(self, h: torch.Tensor, stats: RouterStats, shard_math, prefetch=None, prefetch_backward=None):
        """y for this rank's normed tokens h [B, S/D, dim]; the router statistics go to ``stats``.
        ``shard_math``, ``prefetch*``: the TSP layer's, for the shared expert's ring (``TSPFeedForward``)."""
        comm, shared = self.comm, None
        if self.layout is not None:
            def shared(h2):
                out = TSPFeedForward.apply(h, self.shared_shard, shard_math, prefetch, prefetch_backward, self.layout)
                return torch.sigmoid(F.linear(h2, replicated_grad(self.shared_gate, comm))) * out.reshape(h2.shape)
        run = expert_parallel(self.experts(), ExpertKind.of(self.cfg), comm, self.cfg.n_experts)
        bias = None if self.router_bias is None else replicated_grad(self.router_bias, comm)
        return moe_layer(h, replicated_grad(self.router, comm), run, self.cfg, stats, shared, bias)

    def experts(self):
        """This rank's experts (``layers.Experts``)."""
        return experts_of({name: getattr(self, name) for name in self.expert_names})

    def reference_parts(self, prefix: str, name: str, local: torch.Tensor):
        """Reference-named pieces of parameter ``name`` of this module (see ``ParallelTransformer``)."""
        if name in ("router", "router_bias"):
            return [(f"{prefix}.feed_forward.router.{'weight' if name == 'router' else 'bias'}", local, {})]
        if name == "shared_gate":
            return [(f"{prefix}.feed_forward.shared_gate.weight", local, {})]
        if name in self.expert_names:
            return [(f"{prefix}.feed_forward.experts.{name}", local, {"tsp": 0})]
        return [(f"{prefix}.{part.name}", view, {"tsp": part.shard_dim})
                for part, view in zip(self.layout.parts, self.layout.unpack(local))]

    def full(self, prefix: str, pick) -> dict[str, torch.Tensor]:
        """Reference-named full tensors of ``pick(param)`` gathered from every rank."""
        gather = lambda t: self.comm.all_gather(t.contiguous(), label="gather_full")
        out = {f"{prefix}.feed_forward.router.weight": pick(self.router)}
        if self.router_bias is not None:
            out[f"{prefix}.feed_forward.router.bias"] = pick(self.router_bias)
        for name in self.expert_names:
            out[f"{prefix}.feed_forward.experts.{name}"] = gather(pick(getattr(self, name))).flatten(0, 1)
        if self.layout is not None:
            for name, t in self.layout.unpack_gathered(gather(pick(self.shared_shard))).items():
                out[f"{prefix}.{name}"] = t
            out[f"{prefix}.feed_forward.shared_gate.weight"] = pick(self.shared_gate)
        return out


def tsp_inference_weights(moe: TSPMoE) -> dict[str, torch.Tensor]:
    """A TSP sparse layer's weights on this rank under ``moe_partial``'s names (its experts, its shared slice)."""
    w = {name: getattr(moe, name).detach() for name in ("router", *moe.expert_names)}
    if moe.router_bias is not None:
        w["router_bias"] = moe.router_bias.detach()
    if moe.layout is not None:
        w.update(zip(("shared_w_gate", "shared_w_up", "shared_w_down"), moe.layout.unpack(moe.shared_shard.detach())))
        w["shared_gate"] = moe.shared_gate.detach()
    return w


@torch.no_grad()
def tsp_moe_local_tokens(h: torch.Tensor, moe: TSPMoE) -> torch.Tensor:
    """A TSP sparse layer on this rank's own tokens h [B, T_p, dim] (T_p may be 0): the training schedule without
    autograd (expert all-to-alls; the shared expert's shards around the ring)."""
    comm, shared = moe.comm, None
    if moe.layout is not None:
        def shared(h2):
            out = ring_mlp(h2, moe.shared_shard.detach(), moe.layout, comm, "infer.moe.shared")
            return torch.sigmoid(F.linear(h2, moe.shared_gate)) * out
    run = expert_parallel(moe.experts(), ExpertKind.of(moe.cfg), comm, moe.cfg.n_experts)
    return moe_layer(h, moe.router, run, moe.cfg, None, shared, moe.router_bias)
