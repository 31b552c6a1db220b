"""TP x SP: the conventional 2D layout, tensor parallelism on ``tp`` (T) inside sequence parallelism on ``sp`` (Σ).

* Sequence (context) parallel across ``sp``: each sequence is zigzag-sharded over the Σ ranks of an ``sp``
  group (``distributed/zigzag.py``); RoPE uses global positions; per layer, the K/V of this rank's local
  heads are all-gathered over ``sp`` and attended by the local queries (``zigzag_causal_attention``; backward:
  reduce-scatter of dK/dV); a sliding layer's exchange moves only its window's keys (``distributed/window.py``).
* Tensor parallel inside ``tp``, exactly as ``tp.py`` without Megatron-SP: column-parallel q/k/v and
  gate/up, row-parallel o/down, vocabulary-parallel embedding, LM head and cross-entropy. The T ranks of a
  ``tp`` group see the same tokens and hold identical activations.

Gradients: weights are sharded over ``tp`` and replicated over ``sp``, whose ranks see different tokens, so
every weight is wrapped in ``ReplicatedGrad`` over ``sp`` (sum of the Σ token shards' contributions). Norm
weights are replicated over both axes; the ``tp`` ranks already compute identical norm gradients (the
column-parallel backward all-reduces dX over ``tp``), so they too are summed over ``sp`` only.

Loss: the global mean over all tokens. The per-token NLLs are identical on the ``tp`` ranks of a group, so
the sum and the token count are reduced over ``sp`` only (no double counting over ``tp``).

Per-layer forward traffic: the two TP all-reduces on the B·S/Σ local tokens, plus the K/V all-gather over
Σ of this rank's 1/T of the KV heads (``torchtsp.analysis.tp_sp_layer_forward_recv_elements``; causally
pruned on gloo, as for SP).
"""

from __future__ import annotations

import torch

from ..distributed import zigzag
from ..distributed.attention import zigzag_causal_attention
from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..model import Transformer
from .base import global_sum_and_count, replicated_grad
from .tp import TPTransformer


class TPSPTransformer(TPTransformer):
    """A reference ``Transformer`` split over ``init_mesh(tp=T, sp=Σ)``: weights over tp, tokens over sp."""

    scheme = "tp_sp"

    def __init__(self, model: Transformer, mesh, recompute: str | bool = "none", timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights=None):
        super().__init__(model, mesh, sequence_parallel=False, recompute=recompute, timeout_s=timeout_s,
                         weights=weights)
        self.sp = AxisComm.from_mesh(mesh, "sp", timeout_s)

    def comms(self):
        return {"tp": self.tp, "sp": self.sp}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This sp rank's zigzag shard [B, S/Σ] (the same on every tp rank of the group)."""
        return zigzag.shard(tokens, self.sp.size, self.sp.rank, dim=1)

    # -- the hooks of TPTransformer ---------------------------------------------------

    def _weight(self, w):
        return replicated_grad(w, self.sp)

    def _norm_weight(self, w):
        return replicated_grad(w, self.sp)

    def attention_positions(self, x):
        """This sp rank's zigzag positions (the same on every tp rank of the group)."""
        sp, seq_len = self.sp, x.shape[1] * self.sp.size
        return zigzag.positions(seq_len, sp.size, sp.rank, device=x.device), seq_len

    def _attend(self, q, k, v, mask, sinks=None):
        # k, v [B, H_kv/T, S/Σ, d] are head-major views of token-major projections: gathered token-major.
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)])
        return zigzag_causal_attention(q, kv, self.sp, mask, sinks)  # KV heads unexpanded (GQA)

    def _sum_and_count(self, nll_sum, labels):
        return global_sum_and_count(nll_sum, labels, self.sp)
