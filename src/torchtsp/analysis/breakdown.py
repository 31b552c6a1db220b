"""What the memory models share (memory_model.py for training, infer_memory.py for inference): the breakdown they
return and the few size rules both use. Torch-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..kv_layouts import kv_heads_per_rank
from ..schemes import Scheme

FP32 = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank for one step.

    params, grads, optimizer: the full per-rank sizes (grads in the model dtype; optimizer = AdamW
    moments and master weights). activations: everything saved for backward when the forward ends.
    transient: the short-lived buffers alive at the peak. kv_cache: inference only. total: the
    predicted peak of live tensor bytes, reached during ``phase``; it counts the gradients that exist
    at that moment, so it is usually less than the sum of the components.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    kv_cache: int
    total: int
    phase: str
    # Inference only: the peak of a decode step (weights, the whole cache, one step's working set), and TSP's
    # decode cache layout (kv_layouts.py; "" for the other schemes).
    decode_peak: int = 0
    kv_layout: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(n: int, multiple: int) -> int:
    return _ceil_div(n, multiple) * multiple


def _kv_heads_held(spec: Scheme, cfg: ModelConfig, ways: int) -> int:
    """KV heads the ``ways`` weight shards hold together: n_kv, or ``ways`` when the scheme copies each of
    n_kv < ways KV heads onto ways/n_kv ranks (TSP, TP and TP x SP)."""
    if not spec.kv_replication:
        return cfg.n_kv_heads
    return ways * kv_heads_per_rank("heads", cfg.n_kv_heads, ways)  # n_kv, or one copy on each of ways > n_kv
