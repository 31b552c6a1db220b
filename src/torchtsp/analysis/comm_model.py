"""Analytic communication volume per layer, in elements received per rank (DESIGN.md section 5).

Symbols: B batch, S sequence, h = n_q·d model width, g = n_q / n_kv, F ffn width, D axis size.
"""

from __future__ import annotations

from ..config import ModelConfig


def layer_weight_elements(cfg: ModelConfig) -> int:
    """P = (2 + 2/g + 3F/h)·h²: wq, wo (h x n_q·d), wk, wv (h x n_kv·d), and three h x F MLP matrices."""
    h, d = cfg.dim, cfg.head_dim
    return 2 * h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + 3 * h * cfg.ffn_dim


def tsp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, world: int) -> int:
    """TSP forward, one layer: (P + 2·B·S·h/g)·(D-1)/D.

    Every rank receives the D-1 weight shards it does not own (broadcast for attention, ring for the
    MLP) and, per head group, the K/V of the other ranks' tokens (2·B·S·n_kv·d in all).
    """
    kv = 2 * batch * seq_len * cfg.n_kv_heads * cfg.head_dim
    return (layer_weight_elements(cfg) + kv) * (world - 1) // world
