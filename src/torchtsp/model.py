"""Single-device reference Llama decoder: the ground truth for every parallel scheme.

It knows nothing about parallelism. The small functions below (``rms_norm``, ``head_norm``,
``rope_tables``, ``apply_rope``, ``swiglu``, ``expand_kv_heads``) are the model's math; parallel
schemes call the same functions on their shards so both compute identical ops.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

IGNORE_INDEX = -100
INIT_STD = 0.02
INIT_BLOCK_ROWS = 256  # initial values are drawn per block of rows, so a rank can draw just the rows it keeps


def _block_generator(seed: int, name: str, block: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + 1_000_003 * zlib.crc32(name.encode()) + block) % 2**63)


def expert_name(name: str, expert: int) -> str:
    """The name whose initial values expert ``expert``'s matrix of the stacked [E, ...] parameter ``name`` takes."""
    return f"{name}.{expert}"


def initial_value(seed: int, name: str, shape, rows: tuple[int, int] | None = None,
                  std: float = INIT_STD) -> torch.Tensor:
    """The initial value of parameter ``name`` (float32, CPU) of a model whose init seed is ``seed``,
    or of its rows [start, stop): norm weights are ones, biases zeros, every other weight normal(0, std).

    Each block of ``INIT_BLOCK_ROWS`` rows has its own generator, seeded from (seed, name, block), so any
    rows can be drawn alone, in any order, on any rank, and equal the whole tensor's rows. A stacked expert
    weight [E, r, c] draws each expert's matrix alone (``expert_name``), so a rank that keeps some experts,
    or some rows of every expert, draws only those.
    """
    start, stop = rows or (0, shape[0])
    if len(shape) == 3:
        return torch.stack([initial_value(seed, expert_name(name, e), shape[1:], std=std)
                            for e in range(start, stop)]) if stop > start else torch.empty(0, *shape[1:])
    out_shape = (stop - start, *shape[1:])
    if name.endswith("norm.weight"):
        return torch.ones(out_shape)
    if name.endswith(".bias"):
        return torch.zeros(out_shape)
    out = torch.empty(out_shape)
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, shape[0])
        values = torch.empty(hi - lo, *shape[1:]).normal_(0.0, std, generator=_block_generator(seed, name, block))
        a, b = max(start, lo), min(stop, hi)
        out[a - start:b - start] = values[a - lo:b - lo]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the scale, as Hugging Face Llama does.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's q/k norm: RMSNorm of each head of x [..., H, d] over d, with one weight [d] for all heads.

    Per head, so it needs no other head's values: a scheme holding some heads applies it to them alone.
    """
    return rms_norm(x, weight, eps)


def _rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's frequency rescaling, op for op as transformers' ``_compute_llama3_parameters``.

    Wavelengths shorter than original_max/high_freq_factor are kept, longer than original_max/low_freq_factor
    are stretched by ``factor``, and the band between is interpolated smoothly.
    """
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_context_len = cfg.rope_original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (unscaled) RoPE cos/sin tables [len(positions), head_dim] for the given (global) positions."""
    return _cos_sin(positions, _rope_inv_freq(head_dim, theta, positions.device))


def rope_tables(positions: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE cos/sin tables [len(positions), head_dim] for the given (global) positions.

    Every caller gets its tables here, so a RoPE variant of the config (``rope_scaling``) applies everywhere.
    """
    inv_freq = _rope_inv_freq(cfg.head_dim, cfg.rope_theta, positions.device)
    if cfg.rope_scaling == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, cfg)
    elif cfg.rope_scaling is not None:  # ModelConfig refuses others; a new variant must be added here
        raise ValueError(f"rope_scaling={cfg.rope_scaling!r} has no implementation in rope_tables")
    return _cos_sin(positions, inv_freq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, d] by position; the half-split ("rotate_half") convention of HF Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def route(h2: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool):
    """The router of a mixture of experts on tokens h2 [N, h]: (probabilities [N, E] in float32, top-k weights
    [N, k] in h2's dtype, top-k expert ids [N, k]), as Hugging Face Qwen2-MoE / Mixtral compute them: softmax in
    float32, ``torch.topk``, optionally renormalised so the k weights sum to one."""
    probs = torch.softmax(F.linear(h2, router_weight), dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, top.to(h2.dtype), experts


def expert_mlps(x: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert on its rows: x [R, h] holds ``counts[e]`` consecutive rows for expert e of the
    stacked weights w_gate, w_up [E, F, h] and w_down [E, h, F]. Every expert runs (also on zero rows), so
    every rank builds the same autograd graph whatever the routing."""
    # unbind, not w[e]: its backward stacks the E gradients once (indexing would add E zero-filled [E, ...] tensors).
    weights = zip(w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0))
    return torch.cat([swiglu(xe, *w) for xe, w in zip(x.split(counts), weights)])


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


def expand_kv_heads(kv: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B, H_kv, S, d] -> [B, H_kv * g, S, d]: each KV head serves g consecutive query heads."""
    return kv if group_size == 1 else kv.repeat_interleave(group_size, dim=1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * d, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * d, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.n_heads * d, cfg.dim, bias=False)
        if cfg.qkv_bias:
            # Added as zeros, not nn.Linear(bias=True), which would draw random numbers: a feature must not
            # shift the random stream, so every weight matrix is the same with or without it for one seed.
            for linear in (self.wq, self.wk, self.wv):
                linear.bias = nn.Parameter(torch.zeros(linear.out_features))
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        cfg, d = self.cfg, self.cfg.head_dim
        # Head counts come from the weights (-1), so the same code runs on head-sharded weights.
        q, k = self.wq(x).view(B, S, -1, d), self.wk(x).view(B, S, -1, d)
        if cfg.qk_norm:
            q, k = head_norm(q, self.q_norm.weight, cfg.norm_eps), head_norm(k, self.k_norm.weight, cfg.norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(B, S, -1, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Expanded K/V (not enable_gqa) keeps CPU SDPA on its flash kernel, which never builds S x S.
        k, v = expand_kv_heads(k, cfg.group_size), expand_kv_heads(v, cfg.group_size)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = cfg.ffn_dim if width is None else width
        self.w_gate = nn.Linear(cfg.dim, width, bias=False)
        self.w_up = nn.Linear(cfg.dim, width, bias=False)
        self.w_down = nn.Linear(width, cfg.dim, bias=False)

    def forward(self, x):
        # swiglu() spelled with module calls, so that hooks on the linears (e.g. DTensor TP) run.
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: w_gate, w_up [E, moe_ffn_dim, h], w_down [E, h, moe_ffn_dim]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, F_, h = cfg.n_experts, cfg.moe_ffn_dim, cfg.dim
        self.w_gate = nn.Parameter(torch.empty(E, F_, h))
        self.w_up = nn.Parameter(torch.empty(E, F_, h))
        self.w_down = nn.Parameter(torch.empty(E, h, F_))


class MoEFeedForward(nn.Module):
    """Mixture of experts (see ``ModelConfig``): router, top-k dropless experts, optional gated shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = None
        if cfg.shared_expert_ffn_dim:
            self.shared = FeedForward(cfg, cfg.shared_expert_ffn_dim)
            self.shared_gate = nn.Linear(cfg.dim, 1, bias=False)

    def forward(self, x, stats: RouterStats | None = None):
        cfg, shape = self.cfg, x.shape
        x2 = x.reshape(-1, shape[-1])
        probs, weights, experts = route(x2, self.router.weight, cfg.moe_top_k, cfg.moe_norm_topk)
        order, token, counts = sort_by_expert(experts, cfg.n_experts)
        if stats is not None:
            stats.add(probs, counts)
        w = self.experts
        out = expert_mlps(x2[token], counts.tolist(), w.w_gate, w.w_up, w.w_down)
        y = combine(x2.shape[0], out, order, token, weights)
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(x2)) * self.shared(x2)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = cfg.is_moe_layer(index)
        self.feed_forward = MoEFeedForward(cfg) if self.moe else FeedForward(cfg)

    def forward(self, x, cos, sin, stats: RouterStats | None = None):
        """``stats``: where a sparse layer adds its router statistics (for the load-balancing loss)."""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + (self.feed_forward(h, stats) if self.moe else self.feed_forward(h))


class Transformer(nn.Module):
    """``Transformer(cfg)(tokens) -> logits [B, S, V]``; ``loss(tokens, labels)`` -> mean cross-entropy.

    Construction draws one seed from the global (CPU) RNG and derives every initial value from it
    (``initial_value``), so a model built on the meta device (``device="meta"``: nothing allocated) still
    knows its weights: parallel schemes materialise just their own shards of them, identical to what
    ``Transformer(cfg)`` after the same ``torch.manual_seed`` holds.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        with torch.device("meta"):  # shapes only; values come from reset_parameters
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = INIT_STD):
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.init_seed, name, p.shape, std=std))

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens: torch.Tensor, stats: RouterStats | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, S, dim]; sparse layers add their router statistics to ``stats``."""
        S = tokens.shape[1]
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.cfg.max_seq_len}")
        positions = torch.arange(S, device=tokens.device)
        cos, sin = rope_tables(positions, self.cfg)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, stats)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, stats: RouterStats | None = None) -> torch.Tensor:
        return F.linear(self.hidden_states(tokens, stats), self.output_weight)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; ``labels[b, t]`` is the (already shifted) target of position t, -100 ignored.

        A mixture-of-experts model adds ``router_aux_loss_coef`` x the load-balancing loss over every token
        (ignored targets included), as Hugging Face's ``outputs.loss`` with ``output_router_logits=True``;
        ``self.router_stats`` then holds this forward's router statistics (for metrics).
        """
        if labels.shape != tokens.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal tokens shape {tuple(tokens.shape)}")
        stats = RouterStats(self.cfg.n_experts) if self.cfg.moe else None
        logits = self(tokens, stats)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        if stats is not None:
            self.router_stats = stats.close().detached()
            aux = load_balancing_loss(stats.counts, stats.probs, stats.rows, self.cfg.n_experts)
            loss = loss + self.cfg.router_aux_loss_coef * aux
        return loss


def reference_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the reference model, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}
