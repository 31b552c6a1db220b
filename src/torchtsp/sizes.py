"""Sizes the runtime works in that the analytic models (analysis/, torch-free) predict memory and traffic from:
each is defined here once, beside the reason for its value, and imported by both sides (torch-free). Among them the
TSP/TP crossover, which the inference engine picks its schedule by and the planner reports."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig

# Keys per block of the block-wise attention kernels (kernels.py: the portable kernel and ``masked_attention``,
# which every KV-cache read goes through): bounds a score buffer to [queries, KEY_BLOCK] however long the cache,
# while a block stays large enough for one matrix product to dominate its loop step.
KEY_BLOCK = 1024

# ZeRO-2 (train/zero.py): reduce-scatters in flight before the oldest is waited for and its float32 bucket freed.
# Two keep the network busy while backward fills the next bucket; each more holds one more bucket of gradient.
ZERO_IN_FLIGHT = 2

# infer.engine.sum_over_ranks (and TSP's row sums): on a point-to-point backend, partial sums up to this many bytes
# per rank (a decode step's hidden states: B x h) are all-gathered, one exchange, and summed locally; larger ones,
# and collective backends, all-reduce. The comm model counts the same choice.
SUM_BY_GATHER_MAX_BYTES = 64 * 1024


def layer_weight_elements(cfg: ModelConfig) -> int:
    """P = (2 + 2/g + 3F/h)·h²: wq, wo (h x n_q·d), wk, wv (h x n_kv·d), and three h x F MLP matrices."""
    h, d = cfg.dim, cfg.head_dim
    return 2 * h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + 3 * h * cfg.ffn_dim


def tsp_tp_crossover_tokens(cfg: ModelConfig) -> Fraction:
    """B·S at which TSP's forward traffic per layer equals TP's (same degree D = T), as an exact Fraction.

    TSP ≤ TP ⇔ P + 2·B·S·h/g ≤ 4·B·S·h ⇔ B·S ≥ P / (4h - 2h/g). With P = (2 + 2/g + 3F/h)·h² this is
    B·S ≥ h·(2 + 2/g + 3F/h) / (4 - 2/g): 8h for the paper's model (g = 1, F = 4h).
    """
    kv_width = cfg.n_kv_heads * cfg.head_dim  # h/g
    return Fraction(layer_weight_elements(cfg), 4 * cfg.dim - 2 * kv_width)
