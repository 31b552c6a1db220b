"""Megatron decode: every rank computes every token with its heads and FFN slice; the cache is head-sharded.

Rank r holds KV heads [r·Hkv/T, (r+1)·Hkv/T) of every token, so its cache is 1/T of the single-device
cache only while T <= n_kv_heads; past that each rank keeps its copy of one KV head (the one its query
heads read, ``parallel/tp.py``), 1/n_kv of the single-device cache. Per layer the partial outputs of
``wo`` and ``w_down`` are all-reduced; the embedding is a vocabulary-slice lookup plus an all-reduce; the
LM head gives this rank's vocabulary slice of the logits. With a one-rank comm and the full weights this is
the single-device reference engine (reference.py).
"""

from __future__ import annotations

import torch

from ..layers import Placement, attention_output, project_heads, sinked
from ..parallel.base import ShardView
from ..parallel.moe import ffn_partial
from .cache import CacheStep
from .engine import Engine, select_last, sum_over_ranks, summed_lookup, vocab_logits


class MegatronEngine(Engine):
    """Runs a ``ShardView``: per layer the weights ``parallel.params.layer_params`` names (this rank's slices),
    this rank's vocabulary rows, and the axis the slices are split over."""

    scheme = "tp"
    kv_layout = "heads"

    def __init__(self, view: ShardView):
        self.cfg, self.comm, self.layers = view.cfg, view.comm, view.layers
        self.embedding, self.head_rows, self.norm = view.embedding, view.head, view.norm
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        self.vocab_comm, self.vocab_start = self.comm, self.comm.rank * self.embedding.shape[0]
        if self.comm.rank > 0:  # GPT-OSS's experts' down bias is whole: one rank adds it to the summed FFN slices
            self.layers = tuple({k: t for k, t in w.items() if k != "down_bias"} for w in self.layers)
        super().__init__()

    def _sum(self, partial, label):
        return sum_over_ranks(self.comm, partial, label)

    def _placement(self, w) -> Placement:
        """Layer ``w``'s block on this rank: its heads against the head-sharded cache, its FFN slice; the
        row-parallel partial outputs summed over the axis."""
        mlp = lambda h: self._sum(ffn_partial(h, w, self.cfg), "infer.tp.mlp")
        return Placement.normed(w, lambda h, step: self._attention(h, w, step), mlp, self.cfg)

    def _attention(self, h, w, step: CacheStep):
        q, k, v = project_heads(h, w, self.cfg, step.cos, step.sin)
        step.write(k, v)
        y = self._sum(attention_output(sinked(*step.attend(q), w.get("sinks")), w["wo"], self.dtype),
                      "infer.tp.attention")
        return y if "bo" not in w else y + w["bo"]  # GPT-OSS's output bias, once, after the sum

    def forward(self, ids, pos, valid):
        """Hidden states after the final norm [B, T, h] of the tokens ids [B, T]; their K/V enter the cache."""
        cache = self.cache
        x = summed_lookup(self.comm, ids, self.embedding, self.cfg)
        step = CacheStep.of(self.cfg, cache, cache.reserve(pos, valid), pos)
        return self.run_blocks(x, step, self.layers, self._placement)

    def prefill_chunk(self, ids, pos, valid, lengths, all_positions=None):
        z = self.forward(ids, pos, valid)  # replicated: every position is here
        last = select_last(z, pos, lengths)
        return last if all_positions is None else (last, z[all_positions])

    def head(self, z):
        return vocab_logits(z, self.head_rows, self.vocab_start, self.cfg.vocab_size)

    def decode(self, ids, pos):
        valid = torch.ones_like(ids, dtype=torch.bool).unsqueeze(1)
        return self.head(self.forward(ids.unsqueeze(1), pos.unsqueeze(1), valid)[:, 0])
