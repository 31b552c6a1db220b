"""Analytic communication volume per layer, in elements received per rank (DESIGN.md section 5).

Symbols: B batch, S sequence, h = n_q·d model width, g = n_q / n_kv, F ffn width, D (or T, Σ) axis sizes.
The counts follow the accounting of ``torchtsp.distributed.comm`` (all-reduce = ring algorithm,
2(D-1)/D of the tensor), so a measured run must equal them exactly.
"""

from __future__ import annotations

from ..config import ModelConfig


def layer_weight_elements(cfg: ModelConfig) -> int:
    """P = (2 + 2/g + 3F/h)·h²: wq, wo (h x n_q·d), wk, wv (h x n_kv·d), and three h x F MLP matrices."""
    h, d = cfg.dim, cfg.head_dim
    return 2 * h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + 3 * h * cfg.ffn_dim


def _kv_elements(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """K and V of every token: 2·B·S·h/g."""
    return 2 * batch * seq_len * cfg.n_kv_heads * cfg.head_dim


def tsp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, world: int) -> int:
    """TSP: (P + 2·B·S·h/g)·(D-1)/D.

    Every rank receives the D-1 weight shards it does not own (broadcast for attention, ring for the
    MLP) and, per head group, the K/V of the other ranks' tokens (2·B·S·h/g in all).
    """
    return (layer_weight_elements(cfg) + _kv_elements(cfg, batch, seq_len)) * (world - 1) // world


def tp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, tp: int) -> int:
    """Megatron TP: two all-reduces of the [B, S, h] activations, 4·B·S·h·(T-1)/T.

    With sequence parallelism the all-reduces become all-gather + reduce-scatter pairs: the same volume.
    """
    return 4 * batch * seq_len * cfg.dim * (tp - 1) // tp


def sp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, sp: int) -> int:
    """Sequence (context) parallel: the K/V all-gather, 2·B·S·h/g·(Σ-1)/Σ."""
    return _kv_elements(cfg, batch, seq_len) * (sp - 1) // sp


def tp_sp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sp: int) -> int:
    """TP(T) x SP(Σ): the TP all-reduces on the B·S/Σ local tokens, plus the K/V all-gather over Σ of
    this rank's 1/T of the KV heads."""
    return (tp_layer_forward_recv_elements(cfg, batch, seq_len // sp, tp)
            + _kv_elements(cfg, batch, seq_len) // tp * (sp - 1) // sp)


def layer_forward_recv_elements(scheme: str, cfg: ModelConfig, batch: int, seq_len: int,
                                dp: int = 1, tsp: int = 1, tp: int = 1, sp: int = 1) -> int:
    """Elements one rank receives during one layer's forward under ``scheme`` (DP moves nothing forward)."""
    if scheme == "dp":
        return 0
    if scheme == "tsp":
        return tsp_layer_forward_recv_elements(cfg, batch // dp, seq_len, tsp)
    if scheme == "tp":
        return tp_layer_forward_recv_elements(cfg, batch // dp, seq_len, tp)
    if scheme == "sp":
        return sp_layer_forward_recv_elements(cfg, batch // dp, seq_len, sp)
    if scheme == "tp_sp":
        return tp_sp_layer_forward_recv_elements(cfg, batch // dp, seq_len, tp, sp)
    raise ValueError(f"no communication model for scheme {scheme!r}")
