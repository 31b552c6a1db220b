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
from torch.utils.checkpoint import checkpoint

from ..distributed import zigzag
from ..distributed.attention import zigzag_causal_attention
from ..distributed.comm import DEFAULT_TIMEOUT_S
from ..layers import (
    CAUSAL,
    IGNORE_INDEX,
    Placement,
    block_forward,
    layer_rope,
    norm,
    project_qkv,
    rope_positions,
    scale_embeddings,
    sequence_mask,
    swiglu,
)
from ..model import Transformer
from ..recompute import FULL, NONE, SELECTIVE, recompute_policy
from .base import ReplicatedTransformer, global_sum_and_count, sum_router_stats_over
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

    def rope(self, local_len: int, device=None, documents=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin of this rank's local tokens at their global zigzag positions (within their
        documents)."""
        comm = self.comm
        positions = zigzag.positions(local_len * comm.size, comm.size, comm.rank, device=device)
        return layer_rope(rope_positions(positions, documents), self.cfg)

    def layer_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor], cos, sin, stats=None,
                      mask=CAUSAL) -> torch.Tensor:
        """One decoder block on local tokens x [B, S/Σ, h]; ``w`` maps names inside the block
        (``attention.wq.weight``, ``ffn_norm.weight``, ...) to full weights; ``mask``: the layer's
        (``layers.sequence_mask``)."""
        cfg = self.cfg
        attention = lambda h, _cache: self._attention(h, w, cos, sin, mask)
        if "feed_forward.router.weight" in w:  # a sparse layer: whole replicated experts on local tokens
            ff = {n.removeprefix("feed_forward."): t for n, t in w.items() if n.startswith("feed_forward.")}
            mlp = lambda h: moe_reference_layer(h, ff, cfg, stats)
        else:
            mlp = lambda h: swiglu(h, w["feed_forward.w_gate.weight"], w["feed_forward.w_up.weight"],
                                   w["feed_forward.w_down.weight"], cfg.mlp_activation, self.recompute == SELECTIVE)
        norms = {n.removesuffix(".weight"): t for n, t in w.items() if n.endswith("norm.weight")}
        return block_forward(x, Placement.normed(norms, attention, mlp, cfg))

    def _attention(self, h, w, cos, sin, mask) -> torch.Tensor:
        """Local q/k/v with the full weights, the K/V all-gathered over the axis (zigzag), local ``wo``."""
        q, k, v = project_qkv(h, {short: w[name] for short, name in QKV_NAMES.items() if name in w}, self.cfg,
                              cos, sin)
        kv = torch.stack([k, v])  # [2, B, S/Σ, H_kv, d]: all-gathered by the attention
        out = zigzag_causal_attention(q.transpose(1, 2), kv, self.comm, mask)  # KV heads unexpanded
        return F.linear(out.transpose(1, 2).flatten(2), w["attention.wo.weight"])

    # The three parts of the model a pipeline stage (parallel/pipeline.py) runs one or more of. The weights are
    # whole; their gradients are summed over the axis by hooks.

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Local tokens [B, S/Σ] -> their embeddings [B, S/Σ, h]."""
        return scale_embeddings(F.embedding(tokens, self.module.tok_embeddings.weight), self.cfg)

    def hidden_states(self, x: torch.Tensor, stats=None, documents=None) -> torch.Tensor:
        """Every layer on local tokens x [B, S/Σ, h] (zigzag positions); sparse layers add their router statistics
        to ``stats``; ``documents``: the packed documents of these rows (whole rows)."""
        w = dict(self.module.named_parameters())
        tables = self.rope(x.shape[1], device=x.device, documents=documents)
        for i in range(self.cfg.n_layers):
            prefix = f"layers.{i}."
            layer = {n.removeprefix(prefix): t for n, t in w.items() if n.startswith(prefix)}
            mask = sequence_mask(documents, self.cfg.window(i))
            # Recompute keeps only each layer's input; backward re-runs its forward (and its K/V gather).
            x = (checkpoint(self.layer_forward, x, layer, *tables[i], stats, mask, use_reentrant=False)
                 if self.recompute == FULL else self.layer_forward(x, layer, *tables[i], stats, mask))
        return x

    def head_nll_sum_and_count(self, x: torch.Tensor, labels: torch.Tensor):
        """Final norm, LM head and cross-entropy of local hidden states [B, S/Σ, h], summed over the axis."""
        z = norm(x, self.module.norm.weight, self.cfg)
        logits = F.linear(z, self.module.output_weight)  # local tokens only: [B, S/Σ, V]
        nll_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum")
        return global_sum_and_count(nll_sum, labels, self.comm)

    def sum_router_stats(self, stats):
        return sum_router_stats_over(self.comm, stats.counts, stats.probs, stats.rows)
