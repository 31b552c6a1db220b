"""Single-device reference Llama decoder: the ground truth for every parallel scheme.

It knows nothing about parallelism. Its math is the layer core (``torchtsp.layers``), which every parallel
scheme calls on its shards, so both compute identical ops; this module holds the parameters, their seeded
initial values and the forward of the whole model.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import layers
from .config import ModelConfig
from .host import on_host
from .layers import (
    CAUSAL,
    IGNORE_INDEX,
    ExpertKind,
    GatedDown,
    LossTerms,
    Mask,
    Placement,
    RouterStats,
    as_documents,
    attend_with_sinks,
    block_forward,
    gated,
    gated_shared_expert,
    layer_rope,
    load_balancing_loss,
    local_experts,
    moe_layer,
    norm,
    qkv_heads,
    rope_length,
    rope_positions,
    scale_embeddings,
)
from .recompute import FULL, NONE, SELECTIVE, recompute_policy

INIT_STD = 0.02
INIT_BLOCK_ROWS = 256  # initial values are drawn per block of rows, so a rank can draw just the rows it keeps


def _block_generator(seed: int, name: str, block: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + 1_000_003 * zlib.crc32(name.encode()) + block) % 2**63)


def expert_name(name: str, expert: int) -> str:
    """The name whose initial values expert ``expert``'s matrix of the stacked [E, ...] parameter ``name`` takes."""
    return f"{name}.{expert}"


def initial_value(seed: int, name: str, shape, rows: tuple[int, int] | None = None,
                  std: float = INIT_STD, norm_init: float = 1.0) -> torch.Tensor:
    """The initial value of parameter ``name`` (float32, CPU) of a model whose init seed is ``seed``,
    or of its rows [start, stop): norm weights are ``norm_init`` (``norm_weight_init``: ones, or zeros where
    the norm scales by 1 + w), biases zeros, every other weight normal(0, std).

    Each block of ``INIT_BLOCK_ROWS`` rows has its own generator, seeded from (seed, name, block), so any
    rows can be drawn alone, in any order, on any rank, and equal the whole tensor's rows. A stacked expert
    weight [E, r, c] draws each expert's matrix alone (``expert_name``), so a rank that keeps some experts,
    or some rows of every expert, draws only those.
    """
    start, stop = rows or (0, shape[0])
    if len(shape) == 3:
        return torch.stack([initial_value(seed, expert_name(name, e), shape[1:], std=std, norm_init=norm_init)
                            for e in range(start, stop)]) if stop > start else torch.empty(0, *shape[1:])
    out_shape = (stop - start, *shape[1:])
    if name.endswith("norm.weight"):
        return torch.full(out_shape, norm_init)
    if name.endswith((".bias", "_bias")):
        return torch.zeros(out_shape)
    out = torch.empty(out_shape)
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, shape[0])
        values = torch.empty(hi - lo, *shape[1:]).normal_(0.0, std, generator=_block_generator(seed, name, block))
        a, b = max(start, lo), min(stop, hi)
        out[a - start:b - start] = values[a - lo:b - lo]
    return out


def norm_weight_init(cfg: ModelConfig) -> float:
    """The initial norm weight: 1, or 0 where the norm scales by 1 + w (Gemma), so every norm starts as identity."""
    return 1.0 - cfg.norm_offset


class RMSNorm(nn.Module):
    def __init__(self, dim: int, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.full((dim,), norm_weight_init(cfg)))

    def forward(self, x):
        return norm(x, self.weight, self.cfg)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * d, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * d, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.n_heads * d, cfg.dim, bias=False)
        # Added as zeros, not nn.Linear(bias=True), which would draw random numbers: a feature must not
        # shift the random stream, so every weight matrix is the same with or without it for one seed.
        for linear in (self.wq, self.wk, self.wv) if cfg.qkv_bias else ():
            linear.bias = nn.Parameter(torch.zeros(linear.out_features))
        if cfg.o_bias:
            self.wo.bias = nn.Parameter(torch.zeros(cfg.dim))
        self.q_norm = RMSNorm(d, cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg) if cfg.qk_norm else None
        # GPT-OSS: one sink logit per query head (layers.apply_sinks).
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None

    def forward(self, x, cos, sin, mask: Mask = CAUSAL):
        B, S, _ = x.shape
        # Module calls, not F.linear on the weights, so that hooks on the linears (e.g. DTensor TP) run.
        norms = (self.q_norm.weight, self.k_norm.weight) if self.cfg.qk_norm else ()
        q, k, v = qkv_heads(self.wq(x), self.wk(x), self.wv(x), self.cfg, cos, sin, *norms)
        out = attend_with_sinks(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.sinks)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        self.activation = cfg.mlp_activation
        width = cfg.ffn_dim if width is None else width
        self.w_gate = nn.Linear(cfg.dim, width, bias=False)
        self.w_up = nn.Linear(cfg.dim, width, bias=False)
        self.w_down = nn.Linear(width, cfg.dim, bias=False)

    def forward(self, x, selective: bool = False):
        # swiglu() spelled with module calls, so that hooks on the linears (e.g. DTensor TP) run. ``selective``
        # (selective recompute): the hidden state is recomputed in backward from the saved gate and up.
        if selective:
            return GatedDown.apply(self.w_gate(x), self.w_up(x), self.w_down.weight, self.activation)
        return self.w_down(gated(self.w_gate(x), self.w_up(x), self.activation))


class Experts(nn.Module):
    """E gated experts as stacked weights: w_gate, w_up [E, moe_ffn_dim, h], w_down [E, h, moe_ffn_dim]; with
    ``expert_bias`` (GPT-OSS) their biases gate_bias, up_bias [E, moe_ffn_dim] and down_bias [E, h]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, F_, h = cfg.n_experts, cfg.moe_ffn_dim, cfg.dim
        self.w_gate = nn.Parameter(torch.empty(E, F_, h))
        self.w_up = nn.Parameter(torch.empty(E, F_, h))
        self.w_down = nn.Parameter(torch.empty(E, h, F_))
        biases = dict(gate_bias=(E, F_), up_bias=(E, F_), down_bias=(E, h)) if cfg.expert_bias else {}
        for name, shape in biases.items():
            setattr(self, name, nn.Parameter(torch.empty(shape)))

    def weights(self) -> layers.Experts:
        biases = [getattr(self, n, None) for n in ("gate_bias", "up_bias", "down_bias")]
        return layers.Experts(self.w_gate, self.w_up, self.w_down, *biases)


class MoEFeedForward(nn.Module):
    """Mixture of experts (see ``ModelConfig``): router, top-k dropless experts, optional gated shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        if cfg.router_bias:
            self.router.bias = nn.Parameter(torch.zeros(cfg.n_experts))
        self.experts = Experts(cfg)
        self.shared = None
        if cfg.shared_expert_ffn_dim:
            self.shared = FeedForward(cfg, cfg.shared_expert_ffn_dim)
            self.shared_gate = nn.Linear(cfg.dim, 1, bias=False)

    def forward(self, x, stats: RouterStats | None = None):
        w, shared = self.experts, None
        if self.shared is not None:
            s = self.shared
            shared = gated_shared_expert(self.shared_gate.weight, s.w_gate.weight, s.w_up.weight, s.w_down.weight)
        return moe_layer(x, self.router.weight, local_experts(w.weights(), ExpertKind.of(self.cfg)), self.cfg, stats,
                         shared, self.router.bias)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg)
        # Sandwich norms (Gemma): each sublayer's output normed before the residual add.
        self.attention_out_norm = RMSNorm(cfg.dim, cfg) if cfg.sandwich_norm else None
        self.ffn_out_norm = RMSNorm(cfg.dim, cfg) if cfg.sandwich_norm else None
        self.moe = cfg.is_moe_layer(index)
        self.feed_forward = MoEFeedForward(cfg) if self.moe else FeedForward(cfg)
        self.kind = cfg.layer_specs[index].attention

    def forward(self, x, cos, sin, stats: RouterStats | None = None, mask: Mask = CAUSAL, selective: bool = False):
        """``stats``: where a sparse layer adds its router statistics (for the load-balancing loss). ``mask``: the
        model's (causal, documents); this layer adds its own window. cos/sin: this layer type's RoPE tables.
        ``selective``: a dense MLP recomputes its hidden state in backward (``recompute.SELECTIVE``)."""
        # Module calls, not the weights, so that hooks on the submodules (DTensor TP) run.
        # (A dense MLP is called with its input alone unless selective: DTensor TP's input plan expects one.)
        mlp = ((lambda h: self.feed_forward(h, stats)) if self.moe else
               (lambda h: self.feed_forward(h, True)) if selective else self.feed_forward)
        mask = self.kind.restrict(mask)
        attention = lambda h, _cache: self.attention(h, cos, sin, mask)
        return block_forward(x, Placement(self.attention_norm, attention, self.ffn_norm, mlp, self.attention_out_norm,
                                          self.ffn_out_norm))


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
        with on_host():  # a draw of the real CPU generator, also when a trace (torchtsp.trace) fakes every tensor
            self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        with torch.device("meta"):  # shapes only; values come from reset_parameters
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg)
            self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = INIT_STD):
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.init_seed, name, p.shape, std=std, norm_init=norm_weight_init(self.cfg)))

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens: torch.Tensor, stats: RouterStats | None = None,
                      recompute: str | bool = NONE, document_ids=None) -> torch.Tensor:
        """Final-norm hidden states [B, S, dim]; sparse layers add their router statistics to ``stats``.
        ``recompute``: a ``recompute.POLICIES`` name (full: keep each layer's input only and run its forward
        again in backward; selective: recompute the MLP's hidden state from its saved gate and up). ``document_ids``
        ([B, S], or ``Documents``): packed rows, each token attending within its document only."""
        S = tokens.shape[1]
        self.cfg.check_length(S)
        documents = as_documents(document_ids, tokens.shape)
        mask = CAUSAL if documents is None else documents.mask()
        positions = torch.arange(S, device=tokens.device)
        tables = layer_rope(rope_positions(positions, documents), self.cfg, rope_length(S, documents, positions))
        x = scale_embeddings(self.tok_embeddings(tokens), self.cfg)
        policy = recompute_policy(recompute)
        for layer, (cos, sin) in zip(self.layers, tables):
            x = (checkpoint(layer, x, cos, sin, stats, mask, use_reentrant=False) if policy == FULL
                 else layer(x, cos, sin, stats, mask, policy == SELECTIVE))
        return self.norm(x)

    def loss_terms(self, tokens: torch.Tensor, labels: torch.Tensor, recompute: str | bool = NONE,
                   document_ids=None) -> LossTerms:
        """The summed cross-entropy of the targets, their number and (MoE) this forward's router statistics."""
        stats = RouterStats(self.cfg.n_experts) if self.cfg.moe else None
        logits = F.linear(self.hidden_states(tokens, stats, recompute, document_ids), self.output_weight)
        nll_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum")
        return LossTerms(nll_sum, (labels != IGNORE_INDEX).sum().to(nll_sum.dtype), stats)

    def forward(self, tokens: torch.Tensor, stats: RouterStats | None = None, document_ids=None) -> torch.Tensor:
        return F.linear(self.hidden_states(tokens, stats, document_ids=document_ids), self.output_weight)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids=None) -> torch.Tensor:
        """Mean cross-entropy; ``labels[b, t]`` is the (already shifted) target of position t, -100 ignored.
        ``document_ids`` [B, S]: packed rows of documents (see ``hidden_states``); None: one sequence per row.

        A mixture-of-experts model adds ``router_aux_loss_coef`` x the load-balancing loss over every token
        (ignored targets included), as Hugging Face's ``outputs.loss`` with ``output_router_logits=True``.
        """
        return self.loss_and_router(tokens, labels, document_ids)[0]

    def loss_and_router(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids=None):
        """``loss`` and this forward's router statistics (closed, detached; None for a dense model)."""
        if labels.shape != tokens.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal tokens shape {tuple(tokens.shape)}")
        stats = RouterStats(self.cfg.n_experts) if self.cfg.moe else None
        logits = self(tokens, stats, document_ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        if stats is None:
            return loss, None
        aux = load_balancing_loss(stats.counts, stats.probs, stats.rows, self.cfg.n_experts)
        return loss + self.cfg.router_aux_loss_coef * aux, stats.close().detached()


def reference_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the reference model, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}
