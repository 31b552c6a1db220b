"""TSP inference with the ``heads`` KV-cache layout (n_kv % D == 0; docs/design.md, "Decode cache layouts: heads").

TSP's weights already split the attention by head group: rank j holds group j's packed q/k/v/o rows (hq query heads,
hkv = n_kv/D KV heads). Here rank j also caches group j's K/V of *every* token, so a rank's cache is 1/D of the
single-device cache, as with the ``sequence`` layout (tsp.py), but its keys are its own heads' keys.

**Decode, and prefill with the activations moving:** TP's step on TSP's weight slices. The step's tokens are
replicated; rank p projects its group's q/k/v, stores the K/V, attends its queries to its own cache and applies its
``wo`` columns; the MLP is its FFN slice (or its experts). Per layer two sums (after ``wo``, after the MLP), plus
the embedding's: exactly TP's collectives per step, against four exchanges per layer for the sequence layout.
Decode with the weights moving has no reason to exist with this layout (the keys a query needs already sit with
its group's weights; moving the weights would only add traffic): ``decode_schedules`` has this step only.

**Prefill with the weights moving** (``weights_move``; many tokens in flight): each rank holds its zigzag share of
the chunk and the packed attention shards are broadcast group by group, as in the training forward. At group j's
turn every rank projects its tokens, group j's K/V of the chunk are all-gathered (every rank's queries of group j
need them) and rank j stores all of them: the cache costs prefill no traffic. The keys of earlier chunks live on
rank j only: one broadcast from rank j brings them, the same bytes per rank as the sequence layout's gather of every
rank's share of them. Positions are all-gathered once per chunk (every rank records every token's slot).
"""

from __future__ import annotations

import torch

from ..layers import attend, attention_output, positions_mask, project_heads, sinked
from ..parallel.tsp import broadcast_each
from .cache import FAR, CacheStep, KVCache, gathered_positions
from .tsp import TSPRank


class HeadsLayout:
    """The ``heads`` cache layout's steps (module docstring), on a ``TSPRank``'s weights."""

    decode_schedules = ("activations",)

    def __init__(self, rank: TSPRank):
        self.rank = rank

    # -- replicated tokens: TP's step -------------------------------------------------------

    def activations_move(self, cache: KVCache, ids, pos, valid):
        """Replicated tokens ids [B, T] through the model with the weights in place; every rank stores its group's
        K/V of all of them. Returns the final-norm hidden states [B, T, h] (replicated)."""
        r = self.rank
        step = CacheStep.of(r.cfg, cache, cache.reserve(pos, valid), pos)
        mask = cache.mask(pos)  # the same keys in every layer

        def attention(h, layer, step):
            w = r.attention_weights(layer)
            q, k, v = project_heads(h, w, r.cfg, step.cos, step.sin)
            step.write(k, v)
            return r.sum(attention_output(sinked(*step.attend(q, mask), w["sinks"]), w["wo"], r.dtype),
                         "infer.attention")

        return r.run(r.embed(ids), step, attention, r.summed_ffn)

    def decode(self, cache: KVCache, ids, pos):
        """One token per sequence (ids, pos [B, 1]): ``activations_move``'s step. Returns [B, h]."""
        return self.activations_move(cache, ids, pos, torch.ones_like(ids, dtype=torch.bool))[:, 0]

    # -- prefill with the weights moving ----------------------------------------------------

    def weights_move(self, cache: KVCache, ids, pos, valid):
        """This rank's tokens ids [B, T] (its share of the chunk; the same T on every rank) through the model with
        the weights moving. Returns their final-norm hidden states [B, T, h]."""
        r = self.rank
        cfg, comm = r.cfg, r.comm
        chunk_pos = gathered_positions(comm, pos, valid, "infer.kv.positions")  # [B, D·T], like the gathered K/V
        step = CacheStep.of(cfg, cache, cache.reserve(chunk_pos, chunk_pos != FAR), pos)
        earlier_pos = cache.key_positions(before=True)  # the chunk's own positions are masked there
        earlier = earlier_pos.shape[1]
        key_pos = torch.cat([earlier_pos, chunk_pos], dim=1)
        mask = positions_mask(pos, key_pos, torch.ones_like(key_pos, dtype=torch.bool))

        def attention(h, layer, step):
            y = torch.zeros(h.shape, dtype=r.dtype, device=h.device)
            for j, w in broadcast_each(comm, layer.attention, "infer.attention"):
                w = r.attention_weights(layer, w)
                q, k, v = project_heads(h, w, cfg, step.cos, step.sin)
                kv = comm.all_gather(torch.stack([k, v]), label="infer.kv")  # [D, 2, B, hkv, T, d]
                kv = kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [2, B, hkv, D·T, d]
                keys = torch.cat([self._earlier_keys(cache, step.layer, earlier, j), kv], dim=3) if earlier else kv
                if j == comm.rank:
                    step.write(kv[0], kv[1])
                y += attention_output(sinked(*attend(q, keys[0], keys[1], step.masked(mask)), w["sinks"]), w["wo"],
                                      r.dtype)
            return y

        return r.run(r.embed_moving(ids), step, attention, r.weights_mlp)

    def _earlier_keys(self, cache: KVCache, layer: int, n: int, j: int) -> torch.Tensor:
        """Group j's K/V [2, B, hkv, n, d] of the earlier tokens (n slots), which rank j holds: one broadcast."""
        comm = self.rank.comm
        if j == comm.rank:
            kv = torch.stack(cache.keys(layer, before=True))
        else:
            pool = cache.pool.k[layer]
            kv = pool.new_empty(2, len(cache.lengths), pool.shape[1], n, pool.shape[3])
        return comm.broadcast(kv, src=j, label="infer.kv.earlier")
