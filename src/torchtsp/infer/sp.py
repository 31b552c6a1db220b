"""SP inference: replicated weights, sequence-sharded KV cache (rank p: all heads of its own tokens).

Prefill: each rank runs its zigzag share of every prompt chunk with the full weights and all-gathers
the K/V of every rank's cache and chunk share per layer (the training forward of SP). Decode: the new token
is replicated, every rank computes its full q/k/v (no communication), the token's K/V is stored on rank
p mod D (p its position: cache.py), every rank attends to its own cache and the partials are merged
exactly by log-sum-exp (all-reduce form: ``wo`` is replicated, so every rank needs every head). The LM head is local.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import zigzag
from ..distributed.comm import AxisComm
from ..layers import (
    Placement,
    attend,
    attention_output,
    project_heads,
    scale_embeddings,
    sinked,
)
from ..parallel.base import ShardView
from ..parallel.moe import ffn_partial
from .cache import CacheStep, SequenceShardedPrefill, merge_partials
from .engine import Engine, gather_positions, select_last, vocab_logits


class SPEngine(Engine):
    scheme = "sp"
    kv_layout = "sequence"

    def __init__(self, view: ShardView):
        self.cfg, self.comm, self.layers = view.cfg, view.comm, view.layers
        self.embedding, self.head_rows, self.norm = view.embedding, view.head, view.norm
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        self.vocab_comm = AxisComm(None, "sp.vocab")  # every rank holds the whole vocabulary
        super().__init__()

    @property
    def token_multiple(self):
        return 2 * self.comm.size

    def _placement(self, w, attention) -> Placement:
        """Layer ``w``'s block: ``attention(h, w, step)`` against the sequence-sharded cache, the whole MLP."""
        return Placement.normed(w, lambda h, step: attention(h, w, step), lambda h: ffn_partial(h, w, self.cfg),
                                self.cfg)

    def _run(self, x, step: CacheStep, attention):
        return self.run_blocks(x, step, self.layers, lambda w: self._placement(w, attention))

    def prefill_chunk(self, ids, pos, valid, lengths, all_positions=None):
        """This rank's zigzag share of the chunk, attending to the K/V of every rank's cache, all-gathered."""
        comm = self.comm
        ids, pos, valid = (zigzag.shard(t, comm.size, comm.rank, dim=1) for t in (ids, pos, valid))
        x = scale_embeddings(F.embedding(ids, self.embedding), self.cfg)
        chunk = SequenceShardedPrefill(comm, self.cache, pos, valid, "sp.kv")
        step = CacheStep.of(self.cfg, self.cache, chunk.slots, pos)

        def attention(h, w, step):
            q, k, v = project_heads(h, w, self.cfg, step.cos, step.sin)
            kv = chunk.keys(step.layer, k, v)
            return attention_output(sinked(*attend(q, kv[0], kv[1], step.masked(chunk.mask)), w.get("sinks")),
                                    w["wo"], self.dtype, w.get("bo"))

        z = self._run(x, step, attention)
        last = select_last(z, pos, lengths)
        return last if all_positions is None else (last, gather_positions(comm, z, all_positions, "sp.prompt_hidden"))

    def finish_last(self, last):
        return self.comm.all_reduce(last, label="sp.last_hidden")  # each last token lives on one rank

    def head(self, z):
        return vocab_logits(z, self.head_rows, 0, self.cfg.vocab_size)

    def decode(self, ids, pos):
        """The replicated token against every rank's own cache; the rank the cache rule names stores its K/V; the
        partial attentions merged exactly."""
        comm, cache = self.comm, self.cache
        ids, pos = ids.unsqueeze(1), pos.unsqueeze(1)
        x = scale_embeddings(F.embedding(ids, self.embedding), self.cfg)
        slots = cache.reserve(pos, torch.ones_like(pos, dtype=torch.bool))
        cache_step = CacheStep.of(self.cfg, cache, slots, pos)

        def attention(h, w, step):
            q, k, v = project_heads(h, w, self.cfg, step.cos, step.sin)
            step.write(k, v)
            return attention_output(merge_partials(comm, *step.attend(q), sinks=w.get("sinks")), w["wo"], self.dtype,
                                    w.get("bo"))

        return self.head(self._run(x, cache_step, attention)[:, 0])
