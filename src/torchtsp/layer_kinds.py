"""A layer's kind, once: ``LayerSpec``, built from the config, is what every part that differs by layer reads.

Per layer it says what its attention is (``AttentionKind``: the whole causal context, or a sliding window), which
RoPE table it rotates by (``rope.RopeSpec``), whether its feed-forward is a mixture of experts, what its cache
holds and how its keys cross a sequence axis. The mask (``AttentionKind.mask``), the K/V exchange (which reads
the mask's window), the paged cache's block groups (``kv_layouts.KVGroups``, keyed by ``AttentionKind.cache``),
the RoPE tables of the layer loop and the analysis models all dispatch on it; none of them reads the config's
per-layer fields. Importing it imports no torch (``torchtsp plan`` reads it).

Adding a kind (sinks, a linear recurrent layer, latent attention) is a new kind here plus its kernel, exchange and
cache code; the callers keep calling ``spec.attention.mask(...)``, ``spec.rope`` and ``spec.attention.cache``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rope import RopeSpec

if TYPE_CHECKING:
    from .masks import Documents, Mask

# Hugging Face's names of the attention a layer runs (``layer_types``).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class KVCacheKind:
    """What a softmax-attention layer keeps per sequence: the K/V of every token (``window`` None), or of the last
    ``window`` positions only (a sliding layer; older blocks can be freed). Layers of equal kinds share a block
    group of the paged cache."""

    window: int | None = None

    def tokens_kept(self, n_tokens: int) -> int:
        """How many of a sequence's first ``n_tokens`` positions a decode step can still read."""
        return n_tokens if self.window is None else min(n_tokens, self.window)


@dataclass(frozen=True)
class AttentionKind:
    """Softmax attention over the causal context (``window`` None) or a sliding window of ``window`` positions
    (a query at i sees keys j with i - window < j <= i: the window counts the query itself, as transformers'),
    with a learned sink per head where ``sinks`` (GPT-OSS: a logit in the softmax's denominator that takes no value;
    ``layers.apply_sinks`` adds it once, to the attention merged over every key block and rank)."""

    window: int | None = None
    sinks: bool = False

    @property
    def name(self) -> str:
        """Hugging Face's ``layer_types`` entry."""
        return FULL_ATTENTION if self.window is None else SLIDING_ATTENTION

    def mask(self, documents: Documents | None = None) -> Mask:
        """What a query of the whole sequence may see in this layer: causal, within the packed rows'
        ``documents``, within the window."""
        from .masks import sequence_mask  # torch: not imported by the config (plan stays torch-free)

        return sequence_mask(documents, self.window)

    def restrict(self, mask: Mask) -> Mask:
        """``mask`` (a KV cache's positions, the same in every layer) as this layer sees it."""
        return mask.windowed(self.window)

    @property
    def cache(self) -> KVCacheKind:
        return KVCacheKind(self.window)

    @property
    def exchange(self) -> str:
        """How its keys cross a sequence axis: "gather" (every rank's, all-gathered; causally pruned point to point
        on gloo) or "window" (only the keys a rank's queries read, point to point, ``distributed/window.py``)."""
        return "gather" if self.window is None else "window"


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``index``'s kind: its attention, its RoPE table, whether its feed-forward is a mixture of experts."""

    index: int
    attention: AttentionKind
    rope: RopeSpec
    moe: bool = False


@functools.lru_cache(maxsize=256)
def layer_specs(cfg) -> tuple[LayerSpec, ...]:
    """Every layer's spec of a ``ModelConfig`` (``cfg.layer_specs``). Sliding layers use plain RoPE of base
    ``rope_local_theta`` where it is set (Gemma 3's local layers), the global table otherwise."""
    full_rope = cfg.rope
    local_rope = full_rope if cfg.rope_local_theta is None else RopeSpec(cfg.rope_local_theta, cfg.head_dim)
    specs = []
    for i in range(cfg.n_layers):
        sliding = bool(cfg.layer_types) and cfg.layer_types[i] == SLIDING_ATTENTION
        attention = AttentionKind(cfg.sliding_window if sliding else None, cfg.attention_sinks)
        specs.append(LayerSpec(i, attention, local_rope if sliding else full_rope, cfg.is_moe_layer(i)))
    return tuple(specs)


def attention_kinds(cfg) -> tuple[AttentionKind, ...]:
    """The distinct attention kinds of a model, full attention first (the analysis models' per-kind figures)."""
    kinds = {spec.attention for spec in layer_specs(cfg)}
    return tuple(sorted(kinds, key=lambda k: (k.window is not None, k.window or 0, k.sinks)))
