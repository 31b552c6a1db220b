"""SP: sequence (context) parallelism over the ``sp`` mesh axis (size Σ).

Every rank holds the whole model (the replica) and 1/Σ of every sequence in the zigzag layout of
docs/design.md, "Tokens: zigzag" (chunks p and 2Σ-1-p), so causal attention work is balanced. Per layer:

* RMSNorm, the Q/K/V projections (with RoPE at each local token's *global* position), the output
  projection and the gated MLP run on local tokens with the full, replicated weights;
* the local K/V are all-gathered over the axis and attended by the local zigzag queries
  (``zigzag_causal_attention``: 2·B·S·h/g·(Σ-1)/Σ elements received per layer on NCCL, less on gloo, where
  a rank skips the chunks causality never reads; the only forward traffic of a layer; its backward
  reduce-scatters dK/dV to the tokens' owners). A sliding layer receives only its window's keys, point to point
  (``distributed/window.py``), and sends their dK/dV back the same way.

The LM head and cross-entropy run on local tokens; the loss is the global mean over every token.
Replicated weights see only local tokens, so their gradients are summed over the axis (a gradient hook).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import zigzag
from ..distributed.attention import zigzag_causal_attention
from ..distributed.comm import DEFAULT_TIMEOUT_S
from ..layers import IGNORE_INDEX, Placement, norm, project_qkv, scale_embeddings, swiglu
from ..model import Transformer
from ..recompute import NONE, SELECTIVE, recompute_policy
from .base import LayerInputs, ReplicatedTransformer, global_sum_and_count, sum_router_stats_over
from .moe import moe_reference_layer

# ``layers.project_qkv``'s names for the reference parameters of a block (those the model has).
QKV_NAMES = {**{f"w{n}": f"attention.w{n}.weight" for n in "qkv"}, **{f"b{n}": f"attention.w{n}.bias" for n in "qkv"},
             "q_norm": "attention.q_norm.weight", "k_norm": "attention.k_norm.weight"}


class SPTransformer(ReplicatedTransformer):
    """A reference ``Transformer`` replicated over the ``sp`` mesh axis, its tokens zigzag-sharded."""

    scheme = "sp"
    axis = "sp"

    def __init__(self, model: Transformer, mesh, recompute: str | bool = NONE, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights=None):
        super().__init__(model, mesh, timeout_s, weights)
        self.recompute = recompute_policy(recompute)

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag shard [B, S/Σ] of a global [B, S] batch (ValueError unless 2Σ divides S)."""
        return zigzag.shard(tokens, self.comm.size, self.comm.rank, dim=1)

    def attention_positions(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's local tokens' global zigzag positions, and the whole sequence's length."""
        comm, seq_len = self.comm, x.shape[1] * self.comm.size
        return zigzag.positions(seq_len, comm.size, comm.rank, device=x.device), seq_len

    def forward_state(self, documents=None) -> dict[str, torch.Tensor]:
        """The replica's parameters by name (read through the module, so that its gradient hooks run)."""
        return dict(self.module.named_parameters())

    def placement(self, inputs: LayerInputs, params: dict[str, torch.Tensor]) -> Placement:
        """One decoder block on local tokens [B, S/Σ, h] with the full weights: local q/k/v, the K/V exchange over
        the axis, local ``wo``; the MLP (or whole replicated experts) on local tokens."""
        cfg, prefix = self.cfg, f"layers.{inputs.spec.index}."
        w = {n.removeprefix(prefix): t for n, t in params.items() if n.startswith(prefix)}
        attention = lambda h, _cache: self._attention(h, w, inputs.cos, inputs.sin, inputs.mask)
        if inputs.spec.moe:  # a sparse layer: whole replicated experts on local tokens
            ff = {n.removeprefix("feed_forward."): t for n, t in w.items() if n.startswith("feed_forward.")}
            mlp = lambda h: moe_reference_layer(h, ff, cfg, inputs.stats)
        else:
            mlp = lambda h: swiglu(h, w["feed_forward.w_gate.weight"], w["feed_forward.w_up.weight"],
                                   w["feed_forward.w_down.weight"], cfg.mlp_activation, self.recompute == SELECTIVE)
        norms = {n.removesuffix(".weight"): t for n, t in w.items() if n.endswith("norm.weight")}
        return Placement.normed(norms, attention, mlp, cfg)

    def _attention(self, h, w, cos, sin, mask) -> torch.Tensor:
        """Local q/k/v with the full weights, the K/V all-gathered over the axis (zigzag), local ``wo``."""
        q, k, v = project_qkv(h, {short: w[name] for short, name in QKV_NAMES.items() if name in w}, self.cfg,
                              cos, sin)
        kv = torch.stack([k, v])  # [2, B, S/Σ, H_kv, d]: all-gathered by the attention
        out = zigzag_causal_attention(q.transpose(1, 2), kv, self.comm, mask, w.get("attention.sinks"))  # GQA kept
        return F.linear(out.transpose(1, 2).flatten(2), w["attention.wo.weight"], w.get("attention.wo.bias"))

    # The three parts of the model a pipeline stage (parallel/pipeline.py) runs one or more of. The weights are
    # whole; their gradients are summed over the axis by hooks.

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Local tokens [B, S/Σ] -> their embeddings [B, S/Σ, h]."""
        return scale_embeddings(F.embedding(tokens, self.module.tok_embeddings.weight), self.cfg)

    def head_nll_sum_and_count(self, x: torch.Tensor, labels: torch.Tensor):
        """Final norm, LM head and cross-entropy of local hidden states [B, S/Σ, h], summed over the axis."""
        z = norm(x, self.module.norm.weight, self.cfg)
        logits = F.linear(z, self.module.output_weight)  # local tokens only: [B, S/Σ, V]
        nll_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum")
        return global_sum_and_count(nll_sum, labels, self.comm)

    def sum_router_stats(self, stats):
        return sum_router_stats_over(self.comm, stats.counts, stats.probs, stats.rows)
