"""TSP inference with the ``grouped`` KV-cache layout (kv_layouts.py; docs/design.md, "Decode cache layouts: grouped").

With fewer KV heads than ranks (D % n_kv == 0, c = D / n_kv > 1) the c consecutive ranks g·c .. g·c + c - 1 hold
copies of KV head g's weights (``shard_math.kv_replicas`` = c). Here they also share its cache: each rank keeps
ONE KV head, its group's, for its share of the tokens, so a rank's cache is 1/D of the single-device cache
(n_kv heads x every token) where TP's copies stop at 1/n_kv. The ``c`` ranks of a group talk over
``shard_math.kv_comm``, the model's process group of the ranks sharing a KV head (made once, collectively, when
the model is built; every engine of the model reuses it).

**Which member keeps a token.** Member m (= rank mod c) of every group keeps the tokens at positions p with
p mod c == m (``kv_layouts.KVPlacement`` with R = c), whoever computed them; rank j's head is j // c
(``kv_layouts.kv_heads_of_rank``). Every group splits the tokens the same way.

**Prefill, weights moving** (``weights_move``; the packed shards broadcast head group by head group as in
the sequence layout). At turn j with j % c == 0 (the first head group reading KV head j // c; the next c - 1 turns read
the same head) every rank projects its tokens' K/V of that head and ONE all-gather over the D ranks gives every
rank the chunk's K/V of the head; the members of group j // c keep theirs. A chunk's queries also need
the head's keys of the earlier chunks, which only group j // c holds: they come from one all-gather over the D
ranks per layer of every rank's cache (its one head, up to the fullest rank's slots), made before the layer's
turns. That is today's full gather, not a within-group one, because every rank's queries read every KV head:
each rank sends its slots once per layer, the same bytes as the sequence layout's per-head gathers
(n_kv x S/D slots of one head = S/c slots), in one collective instead of n_kv; the price is that the gathered
keys of every head are held at once during the layer (n_kv x one head's, the sequence layout holds one).
The positions of the chunk travel in one small all-gather per step (the earlier slots' follow from the rule).

**Prefill, activations moving** (``activations_move``: replicated tokens). Each rank projects its query heads
and its KV head's K/V of every token, keeps its member share; its group's queries are all-gathered inside the
group, each member attends them to its own keys and ``merge_partials`` merges the members' partials for each
rank's heads inside the group; then ``wo`` and the sums over the D ranks as in the sequence layout.

**Decode** (``decode_schedules`` has this step only: the sequence layout's weights-move decode gathers caches
this layout does not hold). Per layer: each rank projects q of its hq heads and K/V of its KV
head (the member whose turn it is stores them: no K/V moves); one all-gather of q inside the group; each rank
attends the group's c·hq queries to its own tokens -> (O, LSE); ONE packed (O, LSE) all-to-all inside the group
hands each member its heads' partials, merged exactly (``cache.merge_packed``); ``wo`` partial; sum over the D
ranks; the MLP slice and its sum. Collectives per step: the embedding's sum, then per layer two inside the
group and two over the D ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_layouts import KVPlacement, kv_heads_of_rank
from ..layers import attend, attention_output, positions_mask, project_heads, project_qkv, sinked
from ..parallel.tsp import broadcast_each
from ..parallel.tsp.model import TSPLayerShards
from .cache import FAR, CacheStep, KVCache, gathered_positions, merge_packed, merge_partials
from .tsp import TSPRank


class GroupedLayout:
    """The ``grouped`` cache layout's steps (module docstring), on a ``TSPRank``'s weights."""

    decode_schedules = ("activations",)

    def __init__(self, rank: TSPRank):
        self.rank = rank
        shards, cfg, D = rank.shards, rank.cfg, rank.comm.size
        self.c = shards.kv_replicas  # ranks per KV head
        if self.c < 2 or shards.kv_heads != 1:
            raise ValueError(f"kv_layout='grouped' needs D % n_kv == 0 with D > n_kv, but the model has "
                             f"n_kv={cfg.n_kv_heads} KV heads on D={D} ranks; use kv_layout='auto'")
        self.group = shards.kv_comm
        if self.group is None or self.group.size != self.c:
            raise ValueError(f"kv_layout='grouped' needs the model's KV-head groups of {self.c} ranks "
                             f"(shard_math.kv_comm); this model has none: build it with torchtsp.parallelize")
        # The KV head each head group's weights read and caches; which member of its head's c ranks this one is.
        self.head_of = [kv_heads_of_rank("grouped", cfg.n_kv_heads, D, j)[0] for j in range(D)]
        self.member = KVPlacement.of("grouped", cfg.n_kv_heads, D).member_of_rank(rank.comm.rank)
        self._buffers = None  # decode's exchange buffers

    # -- prefill ---------------------------------------------------------------------

    def weights_move(self, cache: KVCache, ids, pos, valid):
        """This rank's tokens ids [B, T] (the same T on every rank) through the model with the weights moving.
        Returns their final-norm hidden states [B, T, h]."""
        r = self.rank
        chunk_pos = gathered_positions(r.comm, pos, valid, "infer.kv.positions")  # [B, D·T], rank-major
        slots = cache.reserve(chunk_pos, chunk_pos != FAR)  # this member's tokens of the gathered chunk
        mask, m = self._prefill_mask(cache, pos, chunk_pos)
        step = CacheStep.of(r.cfg, cache, slots, pos)
        attention = lambda h, layer, step: self._prefill_attention(cache, h, layer, step, mask, m)
        return r.run(r.embed_moving(ids), step, attention, r.weights_mlp)

    def _prefill_mask(self, cache: KVCache, pos, chunk_pos):
        """The mask of this rank's queries at ``pos`` against any KV head g's keys as ``_prefill_attention`` lays them
        out (group g's earlier slots, rank-major, then the chunk's tokens, rank-major; every group's members hold the
        same positions, so one mask serves every head); and the number of earlier slots per rank."""
        earlier = [cache.key_positions(before=True, member=r) for r in range(self.c)]  # member r's, every group's
        m = earlier[0].shape[1]
        keys = torch.cat([*earlier, chunk_pos], dim=1)
        mask = positions_mask(pos, keys, torch.ones_like(keys, dtype=torch.bool))
        return mask, m

    def _prefill_attention(self, cache: KVCache, h, layer: TSPLayerShards, step: CacheStep, mask, m: int):
        """Layer ``layer``'s attention of this rank's tokens h with the packed shards broadcast in turn."""
        r = self.rank
        comm, cfg, c, i = r.comm, r.cfg, self.c, step.layer
        y = torch.zeros(h.shape, dtype=r.dtype, device=h.device)
        past = None
        if m:  # every rank's earlier slots of its KV head: [2, B, 1, D·m, d], rank-major
            past = comm.all_gather(torch.stack(cache.keys(i, before=True)), label="infer.kv")
            past = past.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        for j, w in broadcast_each(comm, layer.attention, "infer.attention"):
            w = r.attention_weights(layer, w)
            q, k, v = project_heads(h, w, cfg, step.cos, step.sin)  # q [B, hq, T, d]; k, v [B, 1, T, d]
            g = self.head_of[j]
            if r.first_reader(j):  # the next c - 1 groups read the same KV head
                # [D, 2, B, 1, T, d] gathered -> [2, B, 1, D·T, d], rank-major (a copy: the gathered buffer is freed
                # at once, not held beside it through the head's attention)
                kv = comm.all_gather(torch.stack([k, v]), label="infer.kv").permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
                if g == self.head_of[comm.rank]:  # this rank's head: it keeps its member's tokens (step.slots)
                    step.write(kv[0], kv[1])
                if past is not None:
                    kv = torch.cat([past[:, :, :, g * c * m:(g + 1) * c * m], kv], dim=3)
            y += attention_output(sinked(*attend(q, kv[0], kv[1], step.masked(mask)), w["sinks"]), w["wo"], r.dtype)
        return y

    def activations_move(self, cache: KVCache, ids, pos, valid):
        """Replicated tokens ids [B, T] through the model with the weights in place; this rank stores the K/V of
        its member's tokens. Returns the final-norm hidden states [B, T, h] (replicated)."""
        r = self.rank
        hq, m = r.shards.q_heads, self.member
        step = CacheStep.of(r.cfg, cache, cache.reserve(pos, valid), pos)

        def attention(h, layer, step):
            w = r.attention_weights(layer)
            q, k, v = project_heads(h, w, r.cfg, step.cos, step.sin)  # q [B, hq, T, d]; k, v [B, 1, T, d]
            step.write(k, v)
            q_group = self.group.all_gather(q, label="infer.q").movedim(0, 1).flatten(1, 2)  # [B, c·hq, T, d]
            mine = merge_partials(self.group, *step.attend(q_group), heads=slice(m * hq, (m + 1) * hq),
                                  sinks=w["sinks"])
            return r.sum(attention_output(mine, w["wo"], r.dtype), "infer.attention")

        return r.run(r.embed(ids), step, attention, r.summed_ffn)

    # -- decode ----------------------------------------------------------------------

    def decode(self, cache: KVCache, ids, pos):
        """One decode step: ids, pos [B, 1] replicated; the member the cache rule names stores each token's K/V of
        its group's head. Returns the final-norm hidden states [B, h] (replicated)."""
        buffers = self._decode_buffers(ids.shape[0])
        return self.rank.decode_with(cache, ids, pos, lambda h, layer, step, mask: self._decode_attention(
            h, layer, step, mask, buffers))

    def _decode_attention(self, h, layer: TSPLayerShards, step: CacheStep, mask, buffers):
        """A decode step's attention (module docstring)."""
        r = self.rank
        B, c, hq, d = h.shape[0], self.c, r.shards.q_heads, r.cfg.head_dim
        w = r.attention_weights(layer)
        q, k, v = project_qkv(h, w, r.cfg, step.cos, step.sin)  # [B, 1, hq, d]; k, v [B, 1, 1, d]
        step.write(k.transpose(1, 2), v.transpose(1, 2))  # the spare slot where another member keeps it
        buffers["q"].copy_(q)
        q_all = self.group.all_gather(buffers["q"], label="infer.q", out=buffers["q_all"])  # [c, B, 1, hq, d]
        out, lse = step.attend(q_all[:, :, 0].transpose(0, 1).reshape(B, c * hq, 1, d), mask)
        partial = buffers["partial"]  # [c, B, hq, d + 1]: slice r holds member r's heads' (O, LSE) on my keys
        partial[..., :d] = out.view(B, c, hq, d).transpose(0, 1)
        partial[..., d] = lse.view(B, c, hq).transpose(0, 1)
        parts = self.group.all_to_all(partial, label="infer.attention.merge", out=buffers["partial_all"])
        y = F.linear(merge_packed(parts, w["sinks"]).to(r.dtype).reshape(B, 1, hq * d), w["wo"])
        return r.sum(y, "infer.attention")

    def _decode_buffers(self, batch: int) -> dict[str, torch.Tensor]:
        """The exchange buffers of a decode step (made on the first step of a generation)."""
        if self._buffers is None or self._buffers["q"].shape[0] != batch:
            r = self.rank
            c, d, hq = self.c, r.cfg.head_dim, r.shards.q_heads
            make = lambda *shape, dtype=r.dtype: torch.empty(shape, dtype=dtype, device=r.device)
            self._buffers = {"q": make(batch, 1, hq, d), "q_all": make(c, batch, 1, hq, d),
                             "partial": make(c, batch, hq, d + 1, dtype=torch.float32),
                             "partial_all": make(c, batch, hq, d + 1, dtype=torch.float32)}
        return self._buffers
