"""Analytic per-rank memory of one training step (or one prefill) for DP, TP, SP, TP x SP and TSP.

Symbols (the paper's): B batch, S sequence length, h model width (= n_q·d), L layers, g = n_q/n_kv,
F ffn width, V vocabulary, D / T / Σ the TSP / TP / SP degrees, e bytes per element of the model
dtype, n the tokens a rank holds (B·S/D for TSP, B·S/Σ for SP, B·S for TP, B/dp·S for DP).

Every term describes what OUR code keeps alive (docs/analysis.md derives each one and records the
calibration against ``torchtsp.memory.measure_peak``):

* parameters and gradients in the model dtype, AdamW state (two fp32 moments, plus an fp32 master
  copy when the model dtype is narrower than fp32), sharded as each scheme shards its weights;
* activations autograd saves for backward, per layer, exactly as our modules save them;
* transient buffers: the loss's logits, weight shards in flight, a head group's gathered
  K/V, the temporaries of one block's backward;
* the KV cache of a prefill (``mode="infer"``).

The peak is found by walking the backward pass block by block (saved activations are freed and
gradients appear as it goes) and taking the largest live total, so ``total`` is not the sum of the
components. TSP is calibrated against measurements; TP, SP and TP x SP follow the standard
(Megatron / context-parallel) accounting and are not calibrated yet.

This module imports no torch: ``torchtsp plan`` must start instantly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .. import chunks
from ..config import ModelConfig
from ..layout import Layout
from ..recompute import FULL, NONE, SELECTIVE, recompute_policy
from ..schemes import Scheme, get_scheme
from ..sizes import ZERO_IN_FLIGHT
from .breakdown import FP32, MemoryBreakdown, _ceil_div, _kv_heads_held

# ZeRO-2's float32 gradient buckets alive at once (train/zero.py): its in-flight reduce-scatters and the bucket
# backward is filling.
ZERO_BUCKETS_IN_FLIGHT = ZERO_IN_FLIGHT + 1
INDEX = 8  # int64 token ids and labels




# ---------------------------------------------------------------- parameters


def param_elements(scheme: str, cfg: ModelConfig, *, tsp: int = 1, tp: int = 1) -> dict[str, int]:
    """Parameter elements one rank holds, by part: layers (matrices), norms, embedding, head.

    Schemes that shard weights (TSP over D, TP over T) split every layer matrix and the vocabulary rows
    (padded up to a multiple of the degree); norms are replicated. DP and SP replicate everything. TSP
    with n_kv < D holds a copy of one KV head per rank.
    """
    h, d = cfg.dim, cfg.head_dim
    spec = get_scheme(scheme)
    w = spec.weight_degree({"tsp": tsp, "tp": tp})
    n_kv = _kv_heads_held(spec, cfg, w)
    attention = 2 * h * cfg.n_heads * d + 2 * h * n_kv * d
    attention += (cfg.n_heads + 2 * n_kv) * d if cfg.qkv_bias else 0  # biases shard with their heads
    sparse = sum(map(cfg.is_moe_layer, range(cfg.n_layers)))
    # A sparse layer's experts split w ways (TSP: whole experts per rank; TP: each expert's FFN width), as does
    # its shared expert; its router and shared gate are replicated.
    mlp = (cfg.n_layers - sparse) * 3 * h * cfg.ffn_dim
    mlp += sparse * 3 * h * (cfg.n_experts * cfg.moe_ffn_dim + cfg.shared_expert_ffn_dim)
    # GPT-OSS: sinks shard with their heads; the experts' gate and up biases with the experts (or their FFN width);
    # the down biases with whole experts (TSP) or replicated beside FFN slices (TP); the o and router biases replicated.
    attention += cfg.n_heads if cfg.attention_sinks else 0
    mlp += sparse * cfg.n_experts * 2 * cfg.moe_ffn_dim if cfg.expert_bias else 0
    down_bias = sparse * cfg.n_experts * h if cfg.expert_bias else 0
    whole_experts = "tsp" in spec.weight_axes
    rows = _ceil_div(cfg.vocab_size, w)
    return {
        "layers": (cfg.n_layers * attention + mlp + (down_bias if whole_experts else 0)) // w,
        "norms": (cfg.norms_per_layer * cfg.n_layers + 1) * h + (2 * cfg.n_layers * d if cfg.qk_norm else 0)
        + (cfg.n_layers * h if cfg.o_bias else 0),
        "router": sparse * (cfg.n_experts * h + (h if cfg.shared_expert_ffn_dim else 0)
                            + (cfg.n_experts if cfg.router_bias else 0)) + (0 if whole_experts else down_bias),
        "embedding": rows * h,
        "head": 0 if cfg.tie_embeddings else rows * h,
    }


def _largest_param(scheme: str, cfg: ModelConfig, *, tsp: int = 1, tp: int = 1) -> int:
    """Elements of the largest parameter tensor a rank holds (the scheme's memory model knows its packing)."""
    spec = get_scheme(scheme)
    return spec.load("memory_walk").largest_param(spec, cfg, spec.weight_degree({"tsp": tsp, "tp": tp}))


def _largest_expert(cfg: ModelConfig, w: int) -> int:
    return cfg.n_experts * cfg.moe_ffn_dim * cfg.dim // w if cfg.moe else 0  # one stacked expert weight


# ---------------------------------------------------------------- per-rank shapes


@dataclass(frozen=True)
class _Shape:
    """Per-rank sizes the activation formulas use (one replica, one rank)."""

    e: int  # bytes per element of the model dtype
    h: int
    hq: int  # query width this rank computes at once: n_q·d / (weight-sharding degree)
    hkv: int  # K/V width of the same heads, before expansion to the query heads
    ff: int  # ffn width this rank computes at once
    nq: int  # query heads of this rank
    d: int
    n: int  # tokens this rank holds in its residual stream
    s_loc: int  # sequence positions this rank holds (RoPE tables are [s_loc, d])
    v: int  # vocabulary rows whose logits this rank computes
    kv_len: int  # tokens (B·S_kv) whose K/V one attention call sees

    @property
    def norm(self) -> int:
        """RMSNorm saves x in fp32 (x itself when e = 4, else a new fp32 copy), 1/rms, and normalised x."""
        return (FP32 + self.e) * self.h + FP32

    @property
    def norm_backward(self) -> int:
        """Peak extra bytes per token of one RMSNorm backward: four fp32 [n, h] temporaries, less what it frees
        (measured: 8·h bytes in fp32, 16·h in bf16)."""
        return (8 if self.e == FP32 else 16) * self.h

    @property
    def rope_per_layer(self) -> int:
        """A narrow dtype saves per-layer casts of cos and sin for q and k (fp32 keeps the shared tables)."""
        return 0 if self.e == FP32 else 4 * self.d * self.e * self.s_loc

    @property
    def rope_tables(self) -> int:
        return 2 * FP32 * self.d * self.s_loc


def _shape(spec: Scheme, cfg: ModelConfig, batch_local: int, seq_len: int, degrees: dict[str, int], e: int) -> _Shape:
    w, tok = spec.weight_degree(degrees), spec.token_degree(degrees)
    # Every scheme's attention sees the K/V of whole sequences (gathered when tokens are split).
    hkv = _kv_heads_held(spec, cfg, w) * cfg.head_dim // w
    return _Shape(e=e, h=cfg.dim, hq=cfg.n_heads * cfg.head_dim // w, hkv=hkv,
                  ff=cfg.ffn_dim // w, nq=cfg.n_heads // w, d=cfg.head_dim, n=batch_local * seq_len // tok,
                  s_loc=seq_len // tok, v=_ceil_div(cfg.vocab_size, w), kv_len=batch_local * seq_len)


# ---------------------------------------------------------------- the backward walk


@dataclass(frozen=True)
class _Event:
    """One block of the backward pass: ``extra`` bytes peak on top of what is live before it, then
    ``freed`` saved bytes are released and ``added`` gradient bytes remain."""

    name: str
    extra: int
    freed: int = 0
    added: int = 0


def _walk(start: int, events: list[_Event]) -> tuple[int, str, int]:
    """(peak bytes, event name, transient at the peak) of live bytes ``start`` followed by ``events``."""
    best, cur = (start, "end of forward", 0), start
    for ev in events:
        if cur + ev.extra > best[0]:
            best = (cur + ev.extra, ev.name, ev.extra)
        cur += ev.added - ev.freed
    if cur > best[0]:
        best = (cur, "end of backward", 0)
    return best


def _window_kv_len(s: _Shape, tok: int, window: int) -> int:
    """Tokens (B·S_kv) whose K/V a sliding layer's zigzag kernel holds on the fullest rank of ``tok``: its own and
    the window's keys it receives (``chunks.window_traffic``, the exchange's rule), not the whole sequence."""
    seq_len, rows = s.s_loc * tok, s.n // s.s_loc
    received = max(chunks.window_traffic(seq_len, tok, r, window)[0] for r in range(tok))
    return rows * (s.s_loc + received)


def _reference_saved(s: _Shape, n_rep: int, zigzag: bool, kv_len: int | None = None,
                     selective: bool = False) -> tuple[int, int]:
    """Bytes one reference block (model.py) saves when run on shards: (attention half, MLP half).

    n_rep: tokens of the replicated part (norms and block inputs; n/T under Megatron-SP, else n).
    Attention: its norm, its input (e·h), q, K and V over the kv_len tokens it attends to, the output
    (token-major, shared with wo's input) and its fp32 log-sum-exp. SDPA (DP, TP) keeps K and V expanded
    to the query heads; the zigzag kernel of SP and TP x SP keeps the gathered K/V unexpanded.
    MLP: its norm, its input, and four [n, F] tensors (gate pre-activation, silu, up, their product); two, gate
    and up, under selective recompute (``layers.GatedDown`` recomputes the silu and the product in backward).
    ``kv_len``: the tokens of K/V kept when not the whole sequence's (a sliding layer's window exchange).
    """
    e = s.e
    kv = 2 * e * (s.hkv if zigzag else s.hq) * (s.kv_len if kv_len is None else kv_len)
    attention = (n_rep * (s.norm + e * s.h) + s.n * (2 * e * s.hq + FP32 * s.nq) + kv + s.rope_per_layer)
    mlp = n_rep * (s.norm + e * s.h) + (2 if selective else 4) * e * s.ff * s.n
    return attention, mlp


@dataclass(frozen=True)
class _Sparse:
    """One sparse (mixture-of-experts) layer's feed-forward on one rank, besides its norm and input, in expectation
    under uniform routing: every rank computes k·n (token, expert) rows, whatever the scheme (TSP receives them
    from the other ranks; the others route their own tokens). saved: bytes autograd keeps; extra: the peak of its
    backward on top; weights: its gradient bytes (experts, shared expert, router)."""

    saved: int
    extra: int
    weights: int


def _sparse(cfg, s: _Shape, w: int, tsp: bool) -> _Sparse:
    e, h, n = s.e, s.h, s.n
    rows = cfg.moe_top_k * n
    ff = cfg.moe_ffn_dim if tsp else cfg.moe_ffn_dim // w  # TSP: whole experts; TP: each expert's slice
    experts = 3 * cfg.n_experts * cfg.moe_ffn_dim * h // w * e
    shared_ff = cfg.shared_expert_ffn_dim // w
    # Gathered inputs and returned outputs [rows, h], the four [rows, F] SwiGLU tensors, the fp32 router
    # probabilities [n, E] and the sort indices (int64).
    saved = rows * (2 * e * h + 4 * e * ff + 3 * INDEX) + FP32 * n * cfg.n_experts
    # Input and output gradients of the rows, two [rows, F] gradients, and every expert's weight gradient twice
    # (per expert, then stacked).
    extra = rows * (2 * e * h + 2 * e * ff) + 2 * experts
    if shared_ff:
        # TSP saves gate and up per shard (all D of them); the reference block its four [n, F/T] tensors. Both
        # keep the shared output for the gate's product.
        saved += (2 * cfg.shared_expert_ffn_dim if tsp else 4 * shared_ff) * e * n + e * h * n
        extra += 3 * h * shared_ff * e + 2 * e * shared_ff * n
    return _Sparse(saved, extra, experts + 3 * h * shared_ff * e + cfg.n_experts * h * e)


def _reference_walk(spec: Scheme, cfg, s: _Shape, *, tp, sp, sequence_parallel, policy, base, parts):
    """Saved activations and the backward walk of DP, TP, SP and TP x SP (the reference block on shards) under
    the recompute ``policy``."""
    e, h, n, L = s.e, s.h, s.n, cfg.n_layers
    recompute, selective = policy == FULL, policy == SELECTIVE
    n_rep = n // tp if sequence_parallel and tp > 1 else n
    gathered = e * h * n if n_rep < n else 0  # Megatron-SP re-gathers a block input in backward
    zigzag = bool(spec.token_axes)  # the zigzag attention kernel (SP, TP x SP)
    _, mlp = _reference_saved(s, n_rep, zigzag, selective=selective)
    # Under SP and TP x SP a sliding layer's kernel keeps only its own and its window's K/V (the exchange of
    # distributed/window.py); DP and TP attend over whole sequences, masked.
    windows = [spec.attention.window for spec in cfg.layer_specs]
    kv_lens = [_window_kv_len(s, sp, w) if zigzag and sp > 1 and w else s.kv_len for w in windows]
    atts = [_reference_saved(s, n_rep, zigzag, kv_len)[0] for kv_len in kv_lens]
    sparse = _sparse(cfg, s, tp, tsp=False) if cfg.moe else None
    mlps = [n_rep * (s.norm + e * h) + sparse.saved if cfg.is_moe_layer(i) else mlp for i in range(L)]
    final = n_rep * s.norm + e * h * n  # final norm and the head's input
    layer_in = e * h * n_rep
    saved_layers = sum(layer_in if recompute else atts[i] + m for i, m in enumerate(mlps))
    if "tp" in spec.weight_axes:
        # Vocabulary-parallel cross-entropy saves its fp32 softmax slice [n, V/T]; backward scales it
        # into a new fp32 tensor and casts that to the model dtype.
        saved_loss = FP32 * n * s.v
        loss_extra = n * s.v * (FP32 + (e if e < FP32 else 0))
    else:
        # F.cross_entropy saves the fp32 log-softmax [n, V]; backward adds the NLL gradient and the
        # log-softmax gradient, both fp32 [n, V].
        saved_loss = FP32 * n * s.v
        loss_extra = 2 * FP32 * n * s.v
    acts = saved_layers + final + saved_loss + s.rope_tables

    head_w = (parts["head"] or parts["embedding"]) * e
    attn_w = (2 * h * s.hq + 2 * h * s.hkv) * e
    mlp_w = 3 * h * s.ff * e
    # dK/dV over the kv_len tokens attended to: SDPA's of the expanded heads; the zigzag kernel's float32
    # buffer of the gathered (unexpanded) heads, and with sp > 1 the reduce-scatter's receive buffer of the
    # same size.
    # A sliding layer's window kernel holds float32 dK/dV of its own and received tokens, then receives the
    # dK/dV of what it sent (at most as many tokens again) and one chunk's keys at a time: bounded by twice
    # its kept tokens, as the all-gathered layer's.
    kv_grads = [2 * e * s.hq * s.kv_len if not zigzag else 2 * FP32 * s.hkv * kv_len * (2 if sp > 1 else 1)
                for kv_len in kv_lens]
    events = [
        _Event("loss backward", loss_extra, freed=saved_loss),
        _Event("head backward", e * n * s.v + e * h * n + head_w, freed=e * h * n, added=head_w + e * h * n),
        _Event("final norm backward", s.norm_backward * n_rep, freed=final - e * h * n),
    ]
    for i in reversed(range(L)):
        if recompute:  # the checkpointed layer runs its forward again, saving everything
            events.append(_Event("layer recompute", atts[i] + mlps[i], added=atts[i] + mlps[i]))
        events += [
            _Event("experts backward", sparse.extra, freed=mlps[i] - n_rep * s.norm, added=sparse.weights)
            if cfg.is_moe_layer(i) else
            # w_down backward then the gate x up product backward: dW_down and two [n, F] gradients (selective:
            # with the recomputed activation and product beside them).
            _Event("mlp backward", mlp_w // 3 + (4 if selective else 2) * e * s.ff * n + gathered,
                   freed=mlp - n_rep * s.norm, added=mlp_w),
            _Event("mlp norm backward", s.norm_backward * n_rep, freed=n_rep * s.norm),
            # wo backward, then attention backward: dq and the gradient of the output (n x hq) and
            # dK, dV (kv_grad).
            _Event("attention backward", h * s.hq * e + 2 * e * s.hq * n + kv_grads[i] + gathered,
                   freed=atts[i] - n_rep * s.norm, added=attn_w),
            _Event("attention norm backward", s.norm_backward * n_rep,
                   freed=n_rep * s.norm + (layer_in if recompute else 0)),
        ]
    events.append(_Event("embedding backward", parts["embedding"] * e,
                         added=0 if cfg.tie_embeddings else parts["embedding"] * e))
    return acts, _walk(base + acts, events)


def _tsp_gathered_kv(s: _Shape, e: int, D: int, pruned_kv: bool) -> tuple[int, int]:
    """(bytes of gathered K/V attention backward holds, one head group's float32 dK/dV) under TSP."""
    many = D > 1
    K = 2 * e * s.hkv * s.kv_len  # one head group's K and V, gathered over the whole sequence
    K32 = 2 * FP32 * s.hkv * s.kv_len  # their float32 gradients
    # Attention backward holds group j's and j+1's gathered K/V, and temporaries of that size: a remainder
    # fitted to measurements at D = 2 and 4 (tiny to bench-sized models, fp32 and bf16, saved and recompute),
    # two groups' K/V at D = 2, from D = 3 on one group's in float32.
    attn_kv = 2 * K + (K32 if D > 2 else 2 * many * K)
    # A causally pruned K/V exchange (point-to-point backends, ``distributed.attention.gather_kv``): the fullest
    # rank is then rank 0. It still gathers every rank's K/V whole but keeps its own as they are (one slice fewer
    # per group), and gets only first-chunk dK/dV from the D - 1 later ranks (a reduce-scatter holds (D + 1)/2
    # float32 slices instead of D), for each of the two groups in flight.
    attn_kv -= (2 * K + (D - 1) * K32) // D if many and pruned_kv else 0
    return attn_kv, K32


def _tsp_walk(cfg, s: _Shape, *, tsp, policy, base, parts, pruned_kv=False):
    """Saved activations and the backward walk of TSP (parallel/tsp.py) under the recompute ``policy``, calibrated
    on measurements. Selective is full's MLP (its input kept, gate and up projected again in backward's ring)
    without the layer's forward again: the attention saves as without recompute."""
    e, h, n, L, D = s.e, s.h, s.n, cfg.n_layers, tsp
    recompute, mlp_again = policy == FULL, policy != NONE
    many = D > 1
    bufs = min(D - 1, 2)  # received weight-shard buffers (none at D = 1)
    # Attention backward: shard j-1 (its K/V gradients finish late), j, and j+1, j+2 in flight. Float32
    # partial weight gradients: group j-1's, and from D = 3 on group j-2's on its way to its owner, which
    # holds its own and the D - 1 it receives (point-to-point on gloo) until that reduce is waited for.
    attn_bufs, attn_partials = min(D - 1, 3), (2 + D if D > 2 else 1 + many)
    # Travelling float32 gradients alive in a ring step besides this rank's contribution: the accumulator that
    # arrived (being sent on) and the next one's receive buffer; the previous accumulator is freed when its
    # shift is waited for (at D = 1 the accumulator stays home: the contribution itself).
    flight = 2 if many else 0
    A = e * h * n  # one [n, h] tensor of local tokens
    A32 = FP32 * h * n  # its float32 accumulator (input gradients, block outputs)
    Q = e * s.hq * n  # one head group's [n, hq] tensor
    attn_kv, K32 = _tsp_gathered_kv(s, e, D, pruned_kv)
    attn_elems = 2 * h * s.hq + 2 * h * s.hkv + ((s.hq + 2 * s.hkv) if cfg.qkv_bias else 0)
    mlp_elems = 3 * h * s.ff
    attn_w, mlp_w, vocab_w = attn_elems * e, mlp_elems * e, s.v * h * e
    # Saved (policy "save"): each norm as in the reference; each block's input; per head group the queries,
    # local K/V, attention output (model dtype) and LSE (fp32), with q/k norm also the pre-norm q and k; per
    # FFN shard the gate and up projections (under recompute, projected again shard by shard in backward's ring).
    raw = Q + e * s.hkv * n if cfg.qk_norm else 0
    att = n * s.norm + A + D * (2 * Q + 2 * e * s.hkv * n + FP32 * s.nq * n + raw)
    mlp = n * s.norm + A + (0 if mlp_again else D * 2 * e * s.ff * n)
    sparse = _sparse(cfg, s, D, tsp=True) if cfg.moe else None
    mlps = [n * s.norm + A + sparse.saved if cfg.is_moe_layer(i) else mlp for i in range(L)]
    final = n * (s.norm + FP32 + 2 * INDEX) + A  # final norm, the head's input z, LSE, token ids and labels
    saved_layers = sum(A if recompute else att + m for m in mlps)
    acts = saved_layers + final + s.rope_tables

    events = [
        # Head: dz (fp32), shard buffers, float32 travelling gradients, and per vocabulary shard two fp32 logit
        # slices (logits, then exp) next to the scaled slice in the model dtype.
        _Event("head backward",
               A32 + bufs * vocab_w + flight * s.v * h * FP32
               + n * s.v * (2 * FP32 + (e if e < FP32 else 0) + (e if many else 0)),
               freed=final - n * s.norm, added=vocab_w + A),
        _Event("final norm backward", s.norm_backward * n, freed=n * s.norm),
    ]
    for i in reversed(range(L)):
        if recompute:
            events.append(_Event("layer recompute", att + mlps[i], added=att + mlps[i]))
        events += [
            # Experts: the sparse terms plus the all-to-all buffers of the returning gradients [k·n, h].
            _Event("experts backward", sparse.extra + cfg.moe_top_k * A, freed=mlps[i] - n * s.norm,
                   added=sparse.weights)
            if cfg.is_moe_layer(i) else
            # One ring step: dx (fp32), a GEMM output, [n, F/D] temporaries (silu, product, their gradients:
            # four, and one more from D = 2 on, where the previous step's are still bound when the next step's
            # are made; two more, gate and up, under recompute), shard buffers, the shard's float32 gradient
            # and the travelling ones; at D = 1 in bf16 the gradient's cast while its float32 sum lives.
            _Event("mlp backward", A32 + A + (4 + many + 2 * mlp_again) * e * s.ff * n + bufs * mlp_w
                   + (1 + flight) * FP32 * mlp_elems + (mlp_w if e < FP32 and not many else 0),
                   freed=mlp - n * s.norm, added=mlp_w),
            _Event("mlp norm backward", s.norm_backward * n, freed=n * s.norm),
            # One head group: dx (fp32), dY·Wo, the group's gathered K/V (and the next group's in flight), the
            # output gradient and dq, float32 dK/dV (kernel output, stacked, per owner), shard buffers and the
            # float32 partial weight gradients being reduced.
            _Event("attention backward", A32 + A + 3 * Q + attn_kv + 3 * K32
                   + attn_bufs * attn_w + attn_partials * FP32 * attn_elems,
                   freed=att - n * s.norm, added=attn_w),
            _Event("attention norm backward", s.norm_backward * n,
                   freed=n * s.norm + (A if recompute else 0)),
        ]
    # The embedding's gradient travels the ring (float32): a contribution, the accumulator and its receive buffer.
    events.append(_Event("embedding backward", (1 + flight) * s.v * h * FP32,
                         added=0 if cfg.tie_embeddings else vocab_w))
    return acts, _walk(base + acts, events)


class ReferenceWalk:
    """The memory model of schemes that run the reference block on shards (DP, TP, SP, TP x SP)."""

    @staticmethod
    def walk(spec: Scheme, cfg, s: _Shape, degrees: dict[str, int], *, sequence_parallel, policy, base, parts,
             pruned_kv):
        """(saved activations, (peak, phase, transient)); ``policy``: the recompute policy; ``pruned_kv`` changes
        nothing: the zigzag kernels keep the whole gathered K/V."""
        return _reference_walk(spec, cfg, s, tp=degrees.get("tp", 1), sp=degrees.get("sp", 1),
                               sequence_parallel=sequence_parallel, policy=policy, base=base, parts=parts)

    @staticmethod
    def largest_param(spec: Scheme, cfg: ModelConfig, w: int) -> int:
        """Vocabulary rows (split w ways, or whole), one FFN or attention matrix, or the stacked experts."""
        h = cfg.dim
        rows = _ceil_div(cfg.vocab_size, w) * h if w > 1 else cfg.vocab_size * h
        return max(rows, cfg.ffn_dim * h // w, cfg.n_heads * cfg.head_dim * h // w, _largest_expert(cfg, w))


class TSPWalk:
    """The memory model of TSP (parallel/tsp/): its own backward walk, and each block's shards packed into one
    parameter."""

    @staticmethod
    def walk(spec: Scheme, cfg, s: _Shape, degrees: dict[str, int], *, sequence_parallel, policy, base, parts,
             pruned_kv):
        return _tsp_walk(cfg, s, tsp=degrees.get("tsp", 1), policy=policy, base=base, parts=parts,
                         pruned_kv=pruned_kv)

    @staticmethod
    def largest_param(spec: Scheme, cfg: ModelConfig, w: int) -> int:
        h, d = cfg.dim, cfg.head_dim
        n_kv = _kv_heads_held(spec, cfg, w)
        attention = (2 * cfg.n_heads * d + 2 * n_kv * d) * h + ((cfg.n_heads + 2 * n_kv) * d if cfg.qkv_bias else 0)
        return max(_ceil_div(cfg.vocab_size, w) * h, attention // w, 3 * cfg.ffn_dim * h // w, _largest_expert(cfg, w),
                   3 * cfg.shared_expert_ffn_dim * h // w)


# The registry's names for them (torchtsp.schemes: ``memory_walk``).
REFERENCE_WALK, TSP_WALK = ReferenceWalk(), TSPWalk()


# ---------------------------------------------------------------- public entry point


def predict_memory(scheme: str, cfg: ModelConfig, batch: int, seq_len: int, *, dp: int = 1, tsp: int = 1,
                   tp: int = 1, sp: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 4,
                   optimizer: str | None = "adamw", master_weights: bool | None = None, foreach: bool = True,
                   recompute: str | bool = False, mode: str = "train", new_tokens: int = 0, schedule: str = "auto",
                   prefill_chunk: int | None = None, pruned_kv: bool = False, zero: int = 0,
                   zero_bucket_mb: float = 32.0, kv_layout: str = "auto") -> MemoryBreakdown:
    """Predicted per-rank memory of one step of ``scheme`` (bytes).

    ``batch`` is the global batch B (each of the ``dp`` replicas gets B/dp rows). ``sequence_parallel``
    is Megatron's SP inside TP (norm and residual activations split over T). ``recompute``: the policy
    (``recompute.POLICIES``; True is "full"): "full" is activation checkpointing of every layer: only each
    layer's input is saved and backward runs one layer's forward again; "selective" keeps the GEMM outputs and
    recomputes the MLP's elementwise hidden state (TSP: its MLP keeps its input only, as under full). ``optimizer``:
    "adamw" or None (a bare forward + backward, as
    ``measure_peak`` of ``loss.backward()`` sees it). ``master_weights`` (fp32 copies holding the
    optimizer, as train/optim.py's MasterWeights) defaults to dtype_bytes < 4. ``foreach``: AdamW's
    multi-tensor path (PyTorch's default on CUDA) allocates sqrt(v) for every parameter at once; the
    per-tensor loop (the default on CPU) two temporaries of the largest tensor.
    ``mode="infer"``: ``generate`` of a ``seq_len``-token prompt per sequence then ``new_tokens`` more (no
    gradients or optimizer; the KV cache at full capacity; TSP's ``schedule`` picked as generate picks it;
    ``prefill_chunk`` as generate's). Prompts need not divide evenly: generate pads them. ``kv_layout`` (tsp):
    the decode cache layout, "auto" (heads, else grouped, else sequence), "heads", "grouped" or "sequence"
    (ValueError for one the model does not allow; the other schemes take only "auto").
    ``pruned_kv``: the K/V exchange is causally pruned, as on point-to-point backends (gloo; a model's
    ``traffic_seq_rank()`` is not None there), which leaves TSP's fullest rank less to hold in attention
    backward. False (the default) for collective backends (NCCL), which gather everything.
    ``zero``: the distributed optimizer over dp (``train/zero.py``, effective when dp > 1): 1 and 2 keep AdamW
    moments and fp32 masters of 1/dp of each local tensor; 1 keeps a float32 buffer of the whole local gradient,
    2 the owned 1/dp of it plus the float32 buckets in flight (of ``zero_bucket_mb``). The backward walk still
    counts each gradient as it is produced, an upper bound for ZeRO-2, which frees them bucket by bucket.
    3 is FSDP2 (``train/fsdp.py``): the float32 weights (the masters), their gradients and AdamW moments are 1/dp of
    each local tensor between steps; the scheme's whole local model is gathered (in the compute dtype) while a
    forward or backward runs, and the whole local gradient lives until backward ends, with its float32 copy for
    the reduce-scatter (an upper bound for the dp scheme, whose blocks are gathered one at a time).
    """
    spec = get_scheme(scheme)
    degrees = {"dp": dp, "tsp": tsp, "tp": tp, "sp": sp}
    _check_inputs(spec, cfg, batch, seq_len, degrees, sequence_parallel, mode, optimizer, dtype_bytes, zero)
    e, policy = dtype_bytes, recompute_policy(recompute)
    parts = param_elements(scheme, cfg, tsp=tsp, tp=tp)
    n_params = sum(parts.values())
    if mode == "infer":
        from .infer_memory import predict_infer

        return predict_infer(spec, cfg, batch, seq_len, degrees, e=e, params=n_params * e, new_tokens=new_tokens,
                              schedule=schedule, prefill_chunk=prefill_chunk, kv_layout=kv_layout)
    s = _shape(spec, cfg, batch // dp, seq_len, degrees, e)
    walk = functools.partial(spec.load("memory_walk").walk, spec, cfg, s, degrees,
                             sequence_parallel=sequence_parallel, policy=policy, parts=parts, pruned_kv=pruned_kv)
    master = (e < FP32) if master_weights is None else master_weights
    if zero == 3 and dp > 1:
        return _fsdp_memory(spec, cfg, degrees, n_params, e, master, optimizer, foreach, walk)
    state = _model_state(spec, cfg, degrees, n_params, e, master, optimizer, foreach, zero, zero_bucket_mb)
    acts, (peak, phase, transient) = walk(base=state.base)
    if optimizer == "adamw" and state.base + state.grads + state.step_extra > peak:
        peak, phase, transient = state.base + state.grads + state.step_extra, "optimizer step", state.step_extra
    return MemoryBreakdown(params=state.params, grads=state.grads, optimizer=state.opt, activations=acts,
                           transient=transient, kv_cache=0, total=peak, phase=phase)


def _check_inputs(spec: Scheme, cfg, batch, seq_len, degrees, sequence_parallel, mode, optimizer, dtype_bytes,
                  zero) -> None:
    """``predict_memory``'s arguments checked, the layout through the one resolution train, bench, generate and
    serve use (layout.py), with its errors. Inference pads prompts and gives replicas unequal rows: only the
    model must split, not the batch."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    train = mode != "infer"
    Layout.of_degrees(spec.name, cfg, batch if train else None, seq_len if train else None, **degrees,
                      sequence_parallel=sequence_parallel)
    if spec.memory_walk is None:
        raise ValueError(f"no memory model for scheme {spec.name!r}")
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")
    if optimizer not in ("adamw", None):
        raise ValueError(f"optimizer must be 'adamw' or None, got {optimizer!r}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")


@dataclass(frozen=True)
class _State:
    """Model state between steps without FSDP: ``params``, ``grads`` (what the step holds of them), ``opt``
    (AdamW state), ``base`` (what lives through forward and backward) and ``step_extra`` (the step's
    temporaries)."""

    params: int
    grads: int
    opt: int
    base: int
    step_extra: int


def _model_state(spec: Scheme, cfg, degrees, n_params, e, master, optimizer, foreach, zero,
                 zero_bucket_mb) -> _State:
    dp = degrees["dp"]
    params = grads = n_params * e
    opt = step_extra = 0
    if optimizer == "adamw":
        # With the distributed optimizer a rank updates its 1/dp chunk of every local tensor (padding aside).
        owned = _ceil_div(n_params, dp) if zero and dp > 1 else n_params
        opt = owned * (2 * FP32 + (FP32 if master else 0))
        # AdamW's sqrt(v) temporaries; mixed precision keeps fp32 copies of the gradients for the masters;
        largest = _largest_param(spec.name, cfg, **_model_degrees(degrees))
        step_extra = FP32 * (owned if foreach else 2 * _ceil_div(largest, dp if owned < n_params else 1))
        step_extra += owned * FP32 if master else 0
        if owned < n_params:
            in_flight = min(n_params, ZERO_BUCKETS_IN_FLIGHT * int(zero_bucket_mb * 2**20) // FP32)
            grads = owned * e + (n_params * FP32 if zero == 1 else in_flight * FP32)
    # ZeRO-1's float32 gradient buffers live from step to step, beside the weights and optimizer state.
    base = params + opt + (n_params * FP32 if optimizer == "adamw" and zero == 1 and dp > 1 else 0)
    return _State(params, grads, opt, base, step_extra)


def _fsdp_memory(spec, cfg, degrees, n_params, e, master, optimizer, foreach, walk) -> MemoryBreakdown:
    """``predict_memory`` under FSDP2 over dp (``zero=3``): the shards at rest, the gathered local model and its
    gradient during the step (see ``predict_memory``); ``walk(base=...)``: the scheme's backward walk."""
    owned = _ceil_div(n_params, degrees["dp"])
    weight_bytes = FP32 if master else e  # the sharded parameters are the float32 masters under mixed precision
    params = owned * weight_bytes
    opt = owned * 2 * FP32 if optimizer == "adamw" else 0
    # Forward and backward hold the gathered local model beside the shards; the walk adds the gradients.
    base = params + opt + n_params * e
    acts, (peak, phase, transient) = walk(base=base)
    # The end of backward: the whole local gradient and its float32 copy for the reduce-scatter.
    end = base + n_params * (e + FP32) + owned * FP32
    if end > peak:
        peak, phase, transient = end, "gradient reduce-scatter", n_params * FP32
    grads = owned * FP32
    if optimizer == "adamw":
        step_extra = FP32 * (owned if foreach else 2 * _ceil_div(_largest_param(spec.name, cfg, **_model_degrees(
            degrees)), degrees["dp"]))
        if params + opt + grads + step_extra > peak:
            peak, phase, transient = params + opt + grads + step_extra, "optimizer step", step_extra
    return MemoryBreakdown(params=params, grads=grads, optimizer=opt, activations=acts, transient=transient,
                           kv_cache=0, total=peak, phase=phase)


def _model_degrees(degrees: dict) -> dict:
    return {"tsp": degrees.get("tsp", 1), "tp": degrees.get("tp", 1)}
