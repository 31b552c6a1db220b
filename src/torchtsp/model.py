"""Single-device reference Llama decoder: the ground truth for every parallel scheme.

It knows nothing about parallelism. The small functions below (``rms_norm``,
``rope_cos_sin``, ``apply_rope``, ``swiglu``) are the model's math; parallel
schemes call the same functions on their shards so both compute identical ops.
"""

from __future__ import annotations

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


def initial_value(seed: int, name: str, shape, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The initial value of parameter ``name`` (float32, CPU) of a model whose init seed is ``seed``,
    or of its rows [start, stop): norm weights are ones, biases zeros, every other weight normal(0, 0.02).

    Each block of ``INIT_BLOCK_ROWS`` rows has its own generator, seeded from (seed, name, block), so any
    rows can be drawn alone, in any order, on any rank, and equal the whole tensor's rows.
    """
    start, stop = rows or (0, shape[0])
    out_shape = (stop - start, *shape[1:])
    if name.endswith("norm.weight"):
        return torch.ones(out_shape)
    if name.endswith(".bias"):
        return torch.zeros(out_shape)
    out = torch.empty(out_shape)
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, shape[0])
        values = torch.empty(hi - lo, *shape[1:]).normal_(0.0, INIT_STD, generator=_block_generator(seed, name, block))
        a, b = max(start, lo), min(stop, hi)
        out[a - start:b - start] = values[a - lo:b - lo]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the scale, as Hugging Face Llama does.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), head_dim] for the given (global) token positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, d] by position; the half-split ("rotate_half") convention of HF Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


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

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        cfg, d = self.cfg, self.cfg.head_dim
        # Head counts come from the weights (-1), so the same code runs on head-sharded weights.
        q = apply_rope(self.wq(x).view(B, S, -1, d), cos, sin)
        k = apply_rope(self.wk(x).view(B, S, -1, d), cos, sin)
        v = self.wv(x).view(B, S, -1, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Expanded K/V (not enable_gqa) keeps CPU SDPA on its flash kernel, which never builds S x S.
        k, v = expand_kv_heads(k, cfg.group_size), expand_kv_heads(v, cfg.group_size)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        # swiglu() spelled with module calls, so that hooks on the linears (e.g. DTensor TP) run.
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


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
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.init_seed, name, p.shape))

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [B, S, dim]."""
        S = tokens.shape[1]
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.cfg.max_seq_len}")
        positions = torch.arange(S, device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden_states(tokens), self.output_weight)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; ``labels[b, t]`` is the (already shifted) target of position t, -100 ignored."""
        if labels.shape != tokens.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal tokens shape {tuple(tokens.shape)}")
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def reference_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the reference model, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}
