"""The decoder's math as functions: the one layer core that every placement of the model calls.

The reference model (model.py), every baseline, every inference engine and the mixture-of-experts layers
compute with these functions on whatever shard of weights and tokens they hold; a scheme only decides where
its weights come from and which collectives wrap which of these operations. TSP keeps its hand-written
backward (its schedule is the project) but calls the same forward math. The decoder block itself is written
once, ``block_forward``: a scheme, or an inference engine with its KV cache, supplies its ``Placement``.

Layouts: hidden states are [B, S, h]; heads stay token-major ([B, S, H, d]) from projection to output
projection; ``attend`` takes head-major views ([B, H, S, d], any strides).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kernels
from .compiled import compilable
from .host import balanced, counts_on_host
from .masks import (  # noqa: F401  (re-exported: the layer core's one mask)
    CAUSAL,
    FULL,
    Block,
    Documents,
    Mask,
    as_documents,
    positions_mask,
    rope_length,
    rope_positions,
    sequence_mask,
    visible_blocks,
)
from .rope import RopeSpec, rope_tables  # noqa: F401  (re-exported: the layer core's RoPE tables)

IGNORE_INDEX = -100


# ---------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by ``weight`` (offset 0: Llama's) or by ``offset + weight`` (offset
    1: Gemma's, whose weights start at zero)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        # Gemma scales in float32 and casts after, (x * (1 + w)).to(dtype), as transformers' Gemma3RMSNorm.
        return (normed * (offset + weight.float())).to(x.dtype)
    # Normalise in float32 and cast back before the scale, as Hugging Face Llama does.
    return weight * normed.to(x.dtype)


@compilable
def norm(x: torch.Tensor, weight: torch.Tensor, cfg) -> torch.Tensor:
    """The model's RMSNorm (its eps and variant) of x with ``weight``: what every norm of every scheme calls."""
    return rms_norm(x, weight, cfg.norm_eps, cfg.norm_offset)


def head_norm(x: torch.Tensor, weight: torch.Tensor, cfg) -> torch.Tensor:
    """Qwen3's / Gemma 3's q/k norm: the model's RMSNorm of each head of x [..., H, d] over d, with one weight
    [d] for all heads.

    Per head, so it needs no other head's values: a scheme holding some heads applies it to them alone.
    """
    return norm(x, weight, cfg)


# ---------------------------------------------------------------- RoPE


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (unscaled) RoPE cos/sin tables [..., head_dim] for (global) positions of any shape."""
    return rope_tables(positions, RopeSpec(theta, head_dim))


def layer_rope(positions: torch.Tensor, cfg, seq_len: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's RoPE tables (``rope.rope_tables`` of its spec's table) for the given positions, of a sequence
    of ``seq_len`` tokens (what context-dependent RoPE types read); layers of one table share one pair of
    tensors, so a hybrid model computes two tables, not one per layer."""
    tables = {}
    for spec in cfg.layer_specs:
        if spec.rope not in tables:
            tables[spec.rope] = rope_tables(positions, spec.rope, seq_len)
    return [tables[spec.rope] for spec in cfg.layer_specs]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None):
    """Rotate x [B, S, H, d] by position (cos/sin [S, d] or [B, S, d]); HF Llama's half-split convention.

    Written into ``out`` (a new tensor if None) half by half, without building the rotated copy, and rounded
    as the reference formula x·cos + rotate_half(x)·sin rounds. With -sin it is RoPE's transpose (backward).
    """
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # one table row for all heads
    x1, x2 = x[..., :half], x[..., half:]
    # Neither autograd nor a compiled graph (which writes its own output buffer) can record out= writes.
    if out is None and (torch.is_grad_enabled() and x.requires_grad or torch.compiler.is_compiling()):
        return torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]],
                         dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos[..., :half], out=out1).sub_(x2 * sin[..., :half])
    torch.mul(x2, cos[..., half:], out=out2).add_(x1 * sin[..., half:])
    return out


# ---------------------------------------------------------------- attention


def heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, S, H·d] -> token-major heads [B, S, H, d] (a view); the head count comes from the tensor, so the
    same code runs on head-sharded weights."""
    return x.view(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


@compilable
def qkv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg, cos: torch.Tensor, sin: torch.Tensor,
              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None):
    """Projections [B, S, H·d] -> token-major heads [B, S, H, d]: q/k norm (Qwen3) and RoPE on queries and keys."""
    q, k, v = (heads(t, cfg.head_dim) for t in (q, k, v))
    if cfg.qk_norm:
        q, k = head_norm(q, q_norm, cfg), head_norm(k, k_norm, cfg)
    return scale_queries(apply_rope(q, cos, sin), cfg), apply_rope(k, cos, sin), v


def scale_queries(q: torch.Tensor, cfg) -> torch.Tensor:
    """Rotated queries times ``cfg.query_scale`` (Gemma's query_pre_attn_scalar; nothing for other models), so
    that every kernel's own head_dim**-0.5 gives the model's attention scale. Its transpose is itself."""
    return q if cfg.query_scale is None else q * cfg.query_scale


def project_qkv(x: torch.Tensor, w, cfg, cos: torch.Tensor, sin: torch.Tensor):
    """Rotated queries and keys and the values of hidden states x [B, S, h], token-major [B, S, H, d].

    ``w`` maps ``wq``, ``wk``, ``wv`` (any contiguous group of heads' rows), with q/k/v bias ``bq``, ``bk``,
    ``bv``, with q/k norm ``q_norm``, ``k_norm``. S may be 0 (a rank that holds none of a step's tokens).
    """
    q, k, v = (F.linear(x, w[f"w{n}"], w.get(f"b{n}")) for n in "qkv")
    return qkv_heads(q, k, v, cfg, cos, sin, w.get("q_norm"), w.get("k_norm"))


def project_heads(x: torch.Tensor, w, cfg, cos: torch.Tensor, sin: torch.Tensor):
    """``project_qkv`` as head-major views [B, H, S, d], the layout ``attend`` and a KV cache take."""
    return tuple(t.transpose(1, 2) for t in project_qkv(x, w, cfg, cos, sin))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask = CAUSAL):
    """The one entry point to attention: (out [B, Hq, Lq, d], lse [B, Hq, Lq] float32) of queries q against
    keys and values k, v [B, Hkv, Lk, d] (head-major views, any strides; Hkv divides Hq: GQA without expanding
    K/V). Plain causal or full masks run a fused kernel (differentiable by autograd; hand-written backward
    passes call ``attend_backward``); documents or a window run it on the visible blocks only (a query that
    sees no key here gets out = 0 and lse = -inf); a positional mask runs the block-wise kernel in float32
    (no autograd: inference), where a query that sees no key gets out = 0 and lse = -inf."""
    if mask.positional:
        return kernels.masked_attention(q, k, v, mask.q_pos, mask.k_pos, mask.k_valid, mask.window)
    if mask.blockwise:
        return kernels.block_attention(q, k, v, mask.blocks(q.shape[-2], k.shape[-2]))
    return kernels.fused_attention(q, k, v, mask.causal)


def attend_backward(dout, q, k, v, out, lse, mask: Mask, dk, dv, accumulate: bool):
    """dq of ``attend`` from the (merged) output and LSE; dK/dV (float32) written to ``dk``, ``dv`` or, with
    ``accumulate``, added to them."""
    if mask.positional:
        raise NotImplementedError("positional masks are for inference: attend_backward takes causal or full")
    if mask.blockwise:
        return kernels.block_attention_backward(dout, q, k, v, out, lse, mask.blocks(q.shape[-2], k.shape[-2]), dk,
                                                dv, accumulate)
    return kernels.fused_attention_backward(dout, q, k, v, out, lse, mask.causal, dk, dv, accumulate)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Attention sinks (GPT-OSS) on a merged attention: per query head h a logit ``sinks[h]`` joins the softmax's
    denominator and takes no value, so out [B, H, T, d] scales by exp(lse - lse') with lse' = logaddexp(lse, sink)
    (= sigmoid(lse - sink)). Returns (out', lse' float32). Exact only on the attention merged over EVERY key block
    and rank: applied to a partial result, a sink would enter once per part (the known sequence-parallel bug).
    A query that saw no key (lse -inf) stays 0."""
    merged = with_sink(lse, sinks)
    return (out.float() * torch.exp(lse - merged).unsqueeze(-1)).to(out.dtype), merged


def with_sink(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The log-sum-exp lse [B, H, ...] (float32) of a merged attention with each head's sink logit added (the sink as
    one more key that takes no value); ``lse`` itself without sinks. A merge of partial attentions that divides by
    this normaliser instead of theirs applies the sinks exactly once."""
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.float().view(1, -1, *(1,) * (lse.dim() - 2)))


def sinked(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The output of a complete attention (out, lse) with ``sinks`` applied (``apply_sinks``; None: out)."""
    return out if sinks is None else apply_sinks(out, lse, sinks)[0]


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The float32 gradient [H] of the sinks from the output gradient and the post-sink output and LSE
    (``apply_sinks``' results): -sum over rows and queries of p_sink · rowsum(dout · out), p_sink = exp(sink - lse').
    The kernels' own backward, given the same post-sink (out, lse), is exact for q, k and v: their probabilities
    are those of the softmax with the sink, whose column has no value."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return -(p_sink * (dout.float() * out.float()).sum(-1)).sum(dim=(0, 2))


class SinkAttention(torch.autograd.Function):
    """``attend`` followed by ``apply_sinks``, differentiable: the fused kernels' autograd does not carry the LSE's
    gradient, so backward runs the kernels' backward from the post-sink (out, lse), exact for q, k and v, and
    ``sinks_grad`` for the sinks."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask):
        out, lse = apply_sinks(*attend(q, k, v, mask), sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask = mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        dq = attend_backward(dout.contiguous(), q, k, v, out, lse, ctx.mask, dk, dv, accumulate=False)
        return dq, dk.to(k.dtype), dv.to(v.dtype), sinks_grad(dout, out, lse, sinks).to(sinks.dtype), None


def attend_with_sinks(q, k, v, mask: Mask, sinks: torch.Tensor | None) -> torch.Tensor:
    """The attention output of ``attend`` (differentiable), with ``sinks`` [Hq] (None: no sinks) added once."""
    if sinks is None:
        return attend(q, k, v, mask)[0]
    return SinkAttention.apply(q, k, v, sinks, mask)


# ---------------------------------------------------------------- gated MLP


def activation(gate: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """The gated MLP's nonlinearity on the gate: silu (SwiGLU) or tanh-approximated gelu (Gemma's GeGLU,
    transformers' gelu_pytorch_tanh)."""
    return F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")


def activation_backward(grad: torch.Tensor, gate: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """The gradient through ``activation`` (the kernels autograd itself runs), for hand-written backward passes."""
    if kind == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh")


@compilable
def gated(gate: torch.Tensor, up: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """The gated MLP's hidden state: activation(gate) * up (SwiGLU with silu, GeGLU with gelu_tanh)."""
    return activation(gate, kind) * up


class GatedDown(torch.autograd.Function):
    """``F.linear(gated(gate, up), w_down)`` that saves gate and up only (selective recompute): backward
    recomputes the elementwise hidden state instead of keeping it, the activation and the product (two
    [tokens, ffn] tensors fewer per layer). A TP rank calls it on its FFN slice; the sum over ranks is outside."""

    @staticmethod
    def forward(ctx, gate, up, w_down, kind: str = "silu"):
        ctx.save_for_backward(gate, up, w_down)
        ctx.kind = kind
        return F.linear(gated(gate, up, kind), w_down)

    @staticmethod
    def backward(ctx, dy):
        gate, up, w_down = ctx.saved_tensors
        return *gated_down_backward(dy, gate, up, w_down, ctx.kind, ctx.needs_input_grad[:3]), None


def gated_down_backward(dy, gate, up, w_down, kind: str, needs=(True, True, True)):
    """(dgate, dup, dw_down) of ``F.linear(gated(gate, up), w_down)`` for its output gradient dy, the hidden
    state recomputed from gate and up; a gradient not needed (``needs``) is None."""
    dy_rows = dy.reshape(-1, dy.shape[-1])
    hidden, dgate, dup = gated_backward((dy_rows @ w_down).view(gate.shape), gate, up, kind)
    dw = dy_rows.t() @ hidden.reshape(-1, gate.shape[-1]) if needs[2] else None
    return (dgate if needs[0] else None), (dup if needs[1] else None), dw


@compilable
def gated_backward(dhidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: str = "silu"):
    """The transpose of ``gated`` for hand-written backward passes: from the gradient ``dhidden`` of its output,
    (the output activation(gate) * up, recomputed; the gradient of gate; the gradient of up)."""
    act = activation(gate, kind)
    return act * up, activation_backward(dhidden * up, gate, kind), dhidden * act


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
           kind: str = "silu", selective: bool = False) -> torch.Tensor:
    """The gated MLP (SwiGLU, or GeGLU with ``kind="gelu_tanh"``); ``selective``: its hidden state recomputed
    in backward (``GatedDown``)."""
    if selective:
        return GatedDown.apply(F.linear(x, w_gate), F.linear(x, w_up), w_down, kind)
    return F.linear(gated(F.linear(x, w_gate), F.linear(x, w_up), kind), w_down)


def scale_embeddings(x: torch.Tensor, cfg) -> torch.Tensor:
    """Embeddings times sqrt(dim) rounded to their dtype (Gemma), as transformers' scaled embedding; else x."""
    return x * torch.tensor(cfg.dim ** 0.5, dtype=x.dtype, device=x.device) if cfg.embed_scale else x


# ---------------------------------------------------------------- the decoder block


class Placement(NamedTuple):
    """Where one decoder block's parts run: the strategies a scheme (or an inference engine) supplies.

    ``attention(h, cache)`` and ``mlp(h)`` return the residual's addend, complete on every rank that holds the
    residual (the strategy owns its collectives: TP's row-parallel sums, SP's K/V gather, TSP's broadcasts and
    rings, an engine's cache and exchanges); ``attention_norm`` and ``ffn_norm`` map the residual to the
    sublayer's input (``norm`` with this scheme's view of the weight); with sandwich norms (Gemma),
    ``attention_out_norm`` and ``ffn_out_norm`` norm each sublayer's output before the residual add."""

    attention_norm: Callable[[torch.Tensor], torch.Tensor]
    attention: Callable[[torch.Tensor, object], torch.Tensor]
    ffn_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]
    attention_out_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    ffn_out_norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def normed(cls, weights, attention, mlp, cfg) -> Placement:
        """The strategies with the model's norms by the given norm weights (as this rank uses them): ``weights``
        maps "attention_norm", "ffn_norm" and, with sandwich norms, "attention_out_norm", "ffn_out_norm"."""
        outer = [norm_with(weights[n], cfg) for n in ("attention_out_norm", "ffn_out_norm")] if cfg.sandwich_norm \
            else [None, None]
        return cls(norm_with(weights["attention_norm"], cfg), attention, norm_with(weights["ffn_norm"], cfg), mlp,
                   *outer)


# The norm weights of one block, as the reference model names them inside ``layers.{i}``.
SANDWICH_NORMS = ("attention_out_norm", "ffn_out_norm")


def block_norm_names(cfg) -> tuple[str, ...]:
    """The names of a block's norms (besides q/k norms): two, or four with sandwich norms."""
    return ("attention_norm", "ffn_norm") + (SANDWICH_NORMS if cfg.sandwich_norm else ())


def block_forward(x: torch.Tensor, place: Placement, cache=None) -> torch.Tensor:
    """The one decoder block, pre-norm: x + attention(norm(x)), then + mlp(norm(.)); with sandwich norms each
    addend is normed as well. Training passes no ``cache``; an inference engine passes what its attention
    strategy reads and writes (its KV cache step)."""
    a = place.attention(place.attention_norm(x), cache)
    x = x + (a if place.attention_out_norm is None else place.attention_out_norm(a))
    m = place.mlp(place.ffn_norm(x))
    return x + (m if place.ffn_out_norm is None else place.ffn_out_norm(m))


def norm_with(weight: torch.Tensor, cfg) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm`` with a fixed weight, as a ``Placement`` norm."""
    return lambda x: norm(x, weight, cfg)


def attention_output(out: torch.Tensor, wo: torch.Tensor, dtype: torch.dtype, bias=None) -> torch.Tensor:
    """The output projection of attention's head-major result out [B, H, T, d] (in ``dtype``): [B, T, h], with
    GPT-OSS's output ``bias`` where this rank's result is complete (not a partial sum over heads). T may be 0 (a
    rank that holds none of a step's tokens)."""
    B, H, T, d = out.shape
    return F.linear(out.to(dtype).transpose(1, 2).reshape(B, T, H * d), wo, bias)


# ---------------------------------------------------------------- mixture of experts


def route(h2: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool, router_bias=None):
    """The router of a mixture of experts on tokens h2 [N, h]: (probabilities [N, E] in float32, top-k weights
    [N, k] in h2's dtype, top-k expert ids [N, k]), as Hugging Face Qwen2-MoE / Mixtral compute them: softmax in
    float32, ``torch.topk``, optionally renormalised so the k weights sum to one. GPT-OSS's router (a bias on the
    logits, then a softmax over the top-k logits only) is the renormalised one with ``router_bias``: the softmax of
    the k largest logits is their probabilities divided by the probabilities' sum."""
    probs = torch.softmax(F.linear(h2, router_weight, router_bias), dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, top.to(h2.dtype), experts


@dataclass(frozen=True)
class ExpertKind:
    """How an expert turns its gate and up projections into its hidden state: SwiGLU (``limit`` None), or
    GPT-OSS's clamped SwiGLU: (up + 1) · gate · sigmoid(alpha · gate), gate clamped above at ``limit`` and up to
    [-limit, limit], as transformers' ``GptOssExperts._apply_gate``."""

    limit: float | None = None
    alpha: float | None = None

    @classmethod
    def of(cls, cfg) -> ExpertKind:
        return cls(cfg.swiglu_limit, cfg.swiglu_alpha)

    def hidden(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return gated(gate, up)
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = ExpertKind()


class Experts(NamedTuple):
    """Stacked expert weights as one rank holds them: w_gate, w_up [E, F, h] and w_down [E, h, F] (whole experts,
    or every expert's FFN slice), and GPT-OSS's biases gate_bias, up_bias [E, F] and down_bias [E, h] (None
    without; down_bias None also where another rank adds it: an FFN slice's partial output)."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def expert_mlps(x: torch.Tensor, counts: list[int], experts: Experts, kind: ExpertKind = SWIGLU) -> torch.Tensor:
    """Each expert's gated MLP (``kind``) on its rows: x [R, h] holds ``counts[e]`` consecutive rows for expert e of
    the stacked ``experts``. Every expert runs (also on zero rows), so every rank builds the same autograd graph
    whatever the routing."""
    # unbind, not w[e]: its backward stacks the E gradients once (indexing would add E zero-filled [E, ...] tensors).
    none = (None,) * experts.w_gate.shape[0]
    per = [t.unbind(0) if t is not None else none for t in experts]
    outs = []
    for xe, (wg, wu, wd, bg, bu, bd) in zip(x.split(counts), zip(*per)):
        outs.append(F.linear(kind.hidden(F.linear(xe, wg, bg), F.linear(xe, wu, bu)), wd, bd))
    return torch.cat(outs)


@dataclass(frozen=True)
class Routing:
    """One forward's routing of N tokens: their top-k ``weights`` [N, k], the ``order`` of the N·k (token, slot)
    pairs grouped by expert (stable), each pair's ``token``, and ``counts`` of pairs per expert [E] (int64)."""

    weights: torch.Tensor
    order: torch.Tensor
    token: torch.Tensor
    counts: torch.Tensor


def routing_counts(routing: Routing) -> list[int]:
    """The (token, slot) pairs per expert, read on the host (the split sizes of the expert GEMMs). A fake-tensor
    trace has no routing to read: it assumes the balanced one, each expert its equal share of the pairs."""
    return counts_on_host(routing.counts, lambda: balanced(routing.order.numel(), routing.counts.shape[0]))


def sort_by_expert(experts: torch.Tensor, n_experts: int):
    """For top-k ids [N, k]: (order of the N·k (token, slot) pairs grouped by expert, stable; each pair's token;
    number of pairs per expert [E], int64, on the ids' device)."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return order, order // experts.shape[1], counts


def combine(n_tokens: int, out: torch.Tensor, order: torch.Tensor, token: torch.Tensor, weights: torch.Tensor):
    """Sum each token's expert outputs (``out`` [N·k, h], in ``order``) weighted by its top-k weights [N, k]."""
    weighted = out * weights.flatten()[order].unsqueeze(1)
    return out.new_zeros(n_tokens, out.shape[1]).index_add_(0, token, weighted)


def local_experts(experts: Experts, kind: ExpertKind = SWIGLU, first: int = 0):
    """``run_experts`` for ``moe_layer`` when this rank holds the weights of experts [first, first + n) (whole,
    or every expert's FFN slice): it computes only those experts' rows and combines them per token."""

    def run(h2: torch.Tensor, routing: Routing) -> torch.Tensor:
        n, order, token = experts.w_gate.shape[0], routing.order, routing.token
        counts = routing_counts(routing)
        if first or n != len(counts):
            start = sum(counts[:first])
            counts = counts[first:first + n]
            rows = slice(start, start + sum(counts))
            order, token = order[rows], token[rows]
        out = expert_mlps(h2[token], counts, experts, kind)
        return combine(h2.shape[0], out, order, token, routing.weights)

    return run


def moe_layer(h: torch.Tensor, router_weight: torch.Tensor, run_experts, cfg, stats=None, shared=None,
              router_bias=None):
    """A sparse layer on tokens h [..., dim]: route (with ``router_bias``, GPT-OSS's), add the router statistics to
    ``stats`` (a ``RouterStats``, or None), ``run_experts(h2, routing)`` -> the combined expert outputs [N, dim]
    (where the experts live and how tokens reach them is the scheme's), plus ``shared(h2)``, the gated shared
    expert's output, if any."""
    h2 = h.reshape(-1, h.shape[-1])
    probs, weights, experts = route(h2, router_weight, cfg.moe_top_k, cfg.moe_norm_topk, router_bias)
    routing = Routing(weights, *sort_by_expert(experts, cfg.n_experts))
    if stats is not None:
        stats.add(probs, routing.counts)
    y = run_experts(h2, routing)
    if shared is not None:
        y = y + shared(h2)
    return y.view(h.shape)


def gated_shared_expert(gate_weight, w_gate, w_up, w_down):
    """``shared`` for ``moe_layer``: Qwen2-MoE's shared expert, sigmoid(h·gate) * swiglu(h)."""
    return lambda h2: torch.sigmoid(F.linear(h2, gate_weight)) * swiglu(h2, w_gate, w_up, w_down)


class RouterStats:
    """What the load-balancing loss needs from one forward: per expert, the number of (token, slot)
    assignments and the sum of router probabilities, summed over every sparse layer, and the rows counted.

    Schemes whose ranks hold different tokens sum the three over those ranks before the loss
    (``load_balancing_loss``): the loss multiplies global sums, never per-rank products. ``close()`` ends
    collection, so a layer re-run in backward (recompute) adds nothing.
    """

    def __init__(self, n_experts: int):
        self.n_experts, self.closed = n_experts, False
        self.counts = self.probs = None
        self.rows = 0

    def add(self, probs: torch.Tensor, counts: torch.Tensor) -> None:
        if self.closed:
            return
        counts = counts.to(torch.float32)
        prob_sum = probs.sum(dim=0)
        self.counts = counts if self.counts is None else self.counts + counts
        self.probs = prob_sum if self.probs is None else self.probs + prob_sum
        self.rows += probs.shape[0]

    def close(self) -> RouterStats:
        self.closed = True
        return self

    def detached(self) -> RouterStats:
        """A closed copy without autograd history (to keep for metrics without keeping the graph alive)."""
        out = RouterStats(self.n_experts)
        out.counts, out.rows, out.closed = self.counts, self.rows, True
        out.probs = None if self.probs is None else self.probs.detach()
        return out


def load_balancing_loss(counts: torch.Tensor, prob_sums: torch.Tensor, rows, n_experts: int) -> torch.Tensor:
    """Hugging Face's load-balancing loss (Switch Transformer eq. 4-6, ``load_balancing_loss_func``) from the
    per-expert assignment counts and probability sums over every sparse layer and token, and their row count:
    E · sum_e (counts_e / rows) · (prob_sums_e / rows)."""
    return (counts / rows * (prob_sums / rows)).sum() * n_experts


class LossTerms(NamedTuple):
    """What a forward over a batch adds to a loss: the summed cross-entropy of its targets, their number and, for a
    mixture of experts, the router statistics of its sparse layers (``RouterStats``; None for a dense model).
    Returned, never kept by the model: a loss over several batches (gradient accumulation) adds them up."""

    nll_sum: torch.Tensor
    count: torch.Tensor
    router: RouterStats | None = None
