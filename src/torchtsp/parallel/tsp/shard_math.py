"""What every TSP rank computes with one passing shard: packed layouts, projections, q/k norms, RoPE."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import compiled
from ...compiled import compilable
from ...distributed.comm import AxisComm
from ...layers import apply_rope, head_norm, scale_queries
from ..shards import PackedLayout, Part, mask_vocab_padding_


class AttentionShard(NamedTuple):
    """Views of one packed attention shard (a rank's head group): the weights and, with q/k/v bias, the
    biases (None without)."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    sinks: torch.Tensor | None = None  # GPT-OSS: the group's heads' sinks, moving with their heads


def linear_into(x2, weight, bias, out=None):
    """x2 @ weight.T (+ bias), into ``out`` if given (one GEMM either way)."""
    if out is None:
        return x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())
    if bias is None:
        return torch.mm(x2, weight.t(), out=out)
    return torch.addmm(bias, x2, weight.t(), out=out)


def rotated_heads(raw, norm, cos, sin, batch: int, cfg, out=None):
    """[B·S/D, H·d] projection -> per-head norm (if ``norm``) -> RoPE, token-major [B, S/D, H, d] (into ``out``
    if given)."""
    y = raw.view(batch, -1, raw.shape[-1] // cfg.head_dim, cfg.head_dim)
    if norm is not None:
        y = head_norm(y, norm, cfg)
    return apply_rope(y, cos, sin, out)


@compilable
def rotated_queries(raw, norm, cos, sin, batch: int, cfg):
    """The rotated, scaled queries [B, S/D, Hq/D, d] of a query projection (``rotated_heads``)."""
    return scale_queries(rotated_heads(raw, norm, cos, sin, batch, cfg), cfg)


@compilable
def stacked_kv(raw_k, v, norm, cos, sin, batch: int, cfg):
    """[2, B, S/D, Hkv/D, d]: the rotated keys (``rotated_heads``) of a key projection and its values."""
    k = rotated_heads(raw_k, norm, cos, sin, batch, cfg)
    return torch.stack([k, v.view(k.shape)])


class TSPShardMath:
    """What every rank computes with one passing shard: the packed layouts of a layer's attention and MLP
    shards, head reshapes, q/k norms, RoPE and its transpose, and the vocabulary-slice logits (no parameters).

    Attention shard of rank p: query heads p·n_q/D … and the columns of ``wo`` that read them, then the KV
    heads they read; q/k/v biases with their heads' rows, sinks (GPT-OSS) with their heads. With n_kv < D there
    are fewer KV heads than ranks: rank p holds a copy of KV head p // (D/n_kv), the one all of its query heads
    read (``kv_replicas`` ranks share it; ``kv_comm`` is their group). The K/V parts are the shard's tail, so
    their gradients are one slice.
    """

    def __init__(self, cfg, comm: AxisComm, kv_comm: AxisComm | None = None):
        D, h, d = comm.size, cfg.dim, cfg.head_dim
        self.cfg, self.comm = cfg, comm
        kv_chunks = min(cfg.n_kv_heads, D)  # distinct KV-head slices (schemes.check_model: D % n_kv == 0 if fewer)
        self.kv_replicas, self.kv_comm = D // kv_chunks, kv_comm
        self.q_heads, self.kv_heads = cfg.n_heads // D, cfg.n_kv_heads // kv_chunks
        q_rows, kv_rows = cfg.n_heads * d, cfg.n_kv_heads * d
        bias = cfg.qkv_bias
        self.attention_layout = PackedLayout((
            Part("attention.wq.weight", (q_rows, h), 0),
            Part("attention.wo.weight", (h, q_rows), 1),
            *([Part("attention.wq.bias", (q_rows,), 0)] if bias else []),
            *([Part("attention.sinks", (cfg.n_heads,), 0)] if cfg.attention_sinks else []),
            Part("attention.wk.weight", (kv_rows, h), 0, kv_chunks),
            Part("attention.wv.weight", (kv_rows, h), 0, kv_chunks),
            *([Part("attention.wk.bias", (kv_rows,), 0, kv_chunks),
               Part("attention.wv.bias", (kv_rows,), 0, kv_chunks)] if bias else []),
        ), D)
        self.kv_offset = self.attention_layout.offset("attention.wk.weight")
        self.mlp_layout = PackedLayout((
            Part("feed_forward.w_gate.weight", (cfg.ffn_dim, h), 0),
            Part("feed_forward.w_up.weight", (cfg.ffn_dim, h), 0),
            Part("feed_forward.w_down.weight", (h, cfg.ffn_dim), 1),
        ), D)

    def attention(self, flat: torch.Tensor) -> AttentionShard:
        """Views of a packed attention shard (or of a gradient buffer of the same layout)."""
        named = self.attention_layout.named(flat)
        return AttentionShard(*(named.get(f"attention.{n}") for n in ("wq.weight", "wk.weight", "wv.weight",
                                                                      "wo.weight", "wq.bias", "wk.bias", "wv.bias",
                                                                      "sinks")))

    def norm_backward(self, g2, raw2, weight, dweight):
        """Gradient through the per-head q/k norm: g2 [B·S/D, H·d] w.r.t. its output -> w.r.t. its input
        ``raw2`` (the pre-norm projection); adds the weight's gradient to ``dweight`` (float32 [d]).
        Elementwise only: the reference's own ops, differentiated by autograd on these local tokens. The weight
        takes part in float32, so its gradient (a partial sum over tokens, later summed over groups and ranks)
        is summed in float32 too."""
        d = self.cfg.head_dim
        with torch.enable_grad():
            r = raw2.detach().view(-1, d).requires_grad_()
            w = weight.detach().requires_grad_()
            out = head_norm(r, w, self.cfg)
            dr, dw = torch.autograd.grad(out, (r, w), g2.reshape(-1, d).to(out.dtype))
        dweight.add_(dw)
        return dr.view(raw2.shape)

    def project_q(self, x2, w: AttentionShard, norm, cos, sin, batch: int):
        """Local tokens' rotated queries of one head group, token-major [B, S/D, Hq/D, d], and the pre-norm
        projection (None without q norm: backward needs it only for the norm)."""
        raw = linear_into(x2, w.wq, w.bq)
        return rotated_queries(raw, norm, cos, sin, batch, self.cfg), raw if norm is not None else None

    def project_kv(self, x2, w: AttentionShard, norm, cos, sin, batch: int):
        """Local tokens' rotated keys and values of one head group, token-major [2, B, S/D, Hkv/D, d] (the
        all-gather's send buffer), and the pre-norm key projection (None without k norm).

        Eager, the keys' RoPE and the values' GEMM write into the buffer in place; compiled (``--compile``), one
        graph stacks them (a compiled region writes its own output buffers)."""
        raw = linear_into(x2, w.wk, w.bk)
        if compiled.enabled():
            return stacked_kv(raw, linear_into(x2, w.wv, w.bv), norm, cos, sin, batch, self.cfg), \
                raw if norm is not None else None
        kv = x2.new_empty(2, batch, x2.shape[0] // batch, self.kv_heads, self.cfg.head_dim)
        rotated_heads(raw, norm, cos, sin, batch, self.cfg, out=kv[0])
        linear_into(x2, w.wv, w.bv, out=kv[1].view(x2.shape[0], -1))
        return kv, raw if norm is not None else None

    def vocab_logits(self, z, w, s):
        """float32 logits [N, V/D] of local tokens against vocabulary shard s; padding rows -> -inf."""
        return mask_vocab_padding_((z @ w.t()).float(), self.cfg.vocab_size - s * w.shape[0])
