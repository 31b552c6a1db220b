"""TSP inference with the ``grouped`` KV-cache layout (kv_layouts.py; docs/design.md, "Decode cache layouts: grouped").

With fewer KV heads than ranks (D % n_kv == 0, c = D / n_kv > 1) the c consecutive ranks g·c .. g·c + c - 1 hold
copies of KV head g's weights (``shard_math.kv_replicas`` = c). Here they also share its cache: each rank keeps
ONE KV head, its group's, for its share of the tokens, so a rank's cache is 1/D of the single-device cache
(n_kv heads x every token) where TP's copies stop at 1/n_kv. The ``c`` ranks of a group talk over
``shard_math.kv_comm``, the model's process group of the ranks sharing a KV head (made once, collectively, when
the model is built; every engine of the model reuses it).

**Which member keeps a token.** Member m (= rank mod c) of every group keeps the prompt tokens of the zigzag
shares of ranks m, m + c, m + 2c, ... (n_kv shares: 1/c of each chunk), and decoded token t when t mod c == m
(``decode``'s step counter, the server's too). Every group splits the tokens the same way.

**Prefill, weights moving** (``weights_move``; the packed shards broadcast head group by head group as in
``TSPEngine``). At turn j with j % c == 0 (the first head group reading KV head j // c; the next c - 1 turns read
the same head) every rank projects its tokens' K/V of that head and ONE all-gather over the D ranks gives every
rank the chunk's K/V of the head; the members of group j // c keep their shares. A chunk's queries also need
the head's keys of the earlier chunks, which only group j // c holds: they come from one all-gather over the D
ranks per layer of every rank's cache (its one head, up to the fullest rank's slots), made before the layer's
turns. That is today's full gather, not a within-group one, because every rank's queries read every KV head:
each rank sends its slots once per layer, the same bytes as the sequence layout's per-head gathers
(n_kv x S/D slots of one head = S/c slots), in one collective instead of n_kv; the price is that the gathered
keys of every head are held at once during the layer (n_kv x one head's, the sequence layout holds one).
The positions of the chunk and of the earlier slots travel in one small all-gather per step.

**Prefill, activations moving** (``activations_move``: replicated tokens). Each rank projects its query heads
and its KV head's K/V of every token, keeps its member share; its group's queries are all-gathered inside the
group, each member attends them to its own keys and ``merge_partials`` merges the members' partials for each
rank's heads inside the group; then ``wo`` and the sums over the D ranks as in ``TSPEngine``.

**Decode** (always this step: the weights-move schedule of ``TSPEngine`` decodes with the sequence layout's
gathers, which this cache does not serve). Per layer: each rank projects q of its hq heads and K/V of its KV
head (the member whose turn it is stores them: no K/V moves); one all-gather of q inside the group; each rank
attends the group's c·hq queries to its own tokens -> (O, LSE); ONE packed (O, LSE) all-to-all inside the group
hands each member its heads' partials, merged exactly (``cache.merge_packed``); ``wo`` partial; sum over the D
ranks; the MLP slice and its sum. Collectives per step: the embedding's sum, then per layer two inside the
group and two over the D ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import zigzag
from ..layers import attend, attention_output, positions_mask, project_heads, project_qkv, rope_tables
from ..parallel.tsp import broadcast_each, ring_each
from ..parallel.tsp.model import TSPLayerShards, TSPShardView
from .cache import FAR, CacheStep, KVCache, gather_keys, merge_packed, merge_partials
from .engine import masked_lookup, sum_over_ranks
from .tsp import TSPEngine, _attention_weights


class TSPGroupedEngine(TSPEngine):
    kv_layout = "grouped"

    def __init__(self, view: TSPShardView):
        super().__init__(view)
        shards, D = view.shard_math, self.comm.size
        self.c = shards.kv_replicas  # ranks per KV head
        if self.c < 2 or shards.kv_heads != 1:
            raise ValueError(f"kv_layout='grouped' needs D % n_kv == 0 with D > n_kv, but the model has "
                             f"n_kv={self.cfg.n_kv_heads} KV heads on D={D} ranks; use kv_layout='auto'")
        self.group = shards.kv_comm
        if self.group is None or self.group.size != self.c:
            raise ValueError(f"kv_layout='grouped' needs the model's KV-head groups of {self.c} ranks "
                             f"(shard_math.kv_comm); this model has none: build it with torchtsp.parallelize")
        self.member, self.kv_group = self.comm.rank % self.c, self.comm.rank // self.c

    @property
    def kv_token_ranks(self):
        return self.c  # a sequence's tokens are dealt over the c ranks sharing its KV head

    def choose_schedule(self, schedule, batch, prefill_tokens):
        super().choose_schedule(schedule, batch, prefill_tokens)
        self.schedule["decode"] = "activations"  # the grouped step (see the module docstring)

    def start(self, batch, prompt_len, max_new_tokens):
        c, cfg = self.c, self.cfg
        self.fills = [0] * self.comm.size
        # prompt_len is a multiple of 2D: a member keeps 1/c of it, and every c-th decoded token.
        capacity = prompt_len // c + -(-(max_new_tokens - 1) // c)
        self.cache = KVCache(cfg.n_layers, batch, 1, capacity, cfg.head_dim, self.dtype, self.device)

    def _stored(self, counts) -> list[int]:
        """Tokens each rank stores when rank r holds counts[r] of a step's tokens: a member keeps the shares of
        the ranks with its member index."""
        c = self.c
        return [sum(counts[r] for r in range(p % c, len(counts), c)) for p in range(len(counts))]

    # -- prefill ---------------------------------------------------------------------

    def weights_move(self, ids, pos, valid, counts):
        """This rank's tokens ids [B, T_p] (T_p the same on every rank) through the model with the weights moving.
        Returns their final-norm hidden states [B, T_p, h]."""
        cfg, comm, cache, c = self.cfg, self.comm, self.cache, self.c
        B, T = ids.shape
        if len(set(counts)) != 1 or counts[0] != T:
            raise ValueError(f"the grouped layout's weights-move prefill needs the same number of tokens on every "
                             f"rank (got {list(counts)}); give each rank its zigzag share of the chunk")
        x = torch.zeros(B, T, cfg.dim, dtype=self.dtype, device=self.device)
        for s, w in ring_each(comm, self.embedding, "infer.embedding"):
            found, hit = masked_lookup(ids, w, s)
            x = torch.where(hit.unsqueeze(-1), found, x)
        m = max(self.fills)  # earlier slots of the fullest rank: every rank's are gathered up to there
        masks, chunk_pos = self._prefill_masks(pos, valid, m)
        keep = chunk_pos[:, self.member::c].flatten(1)  # [B, n_kv·T]: the shares of this member's ranks
        slots = self._reserve(keep, keep != FAR, self._stored(counts))
        step = CacheStep(cache, slots, pos, *rope_tables(pos, cfg))
        attention = lambda h, layer, step: self._prefill_attention(h, layer, step, masks, m)
        return self._run(x, step, attention, self._weights_mlp)

    def _prefill_masks(self, pos, valid, m: int):
        """Per KV head g, the mask of this rank's queries at ``pos`` against head g's keys as ``_prefill_attention``
        lays them out (group g's earlier slots, rank-major, then the chunk's tokens, rank-major); and the chunk's
        positions [B, D, T] (``FAR`` where padding). Read before this step's slots are reserved."""
        comm, cache, c = self.comm, self.cache, self.c
        here = torch.cat([torch.where(cache.valid[:, :m], cache.pos[:, :m], FAR), torch.where(valid, pos, FAR)], 1)
        every = comm.all_gather(here, label="infer.kv.positions").movedim(0, 1)  # [B, D, m + T]
        chunk_pos = every[:, :, m:]
        masks = []
        for g in range(comm.size // c):
            if m == 0 and masks:  # no earlier slots: every head's keys are the chunk's, one mask serves them all
                masks.append(masks[0])
                continue
            keys = torch.cat([every[:, g * c:(g + 1) * c, :m].flatten(1), chunk_pos.flatten(1)], dim=1)
            masks.append(positions_mask(pos, keys, torch.ones_like(keys, dtype=torch.bool)))
        return masks, chunk_pos

    def _prefill_attention(self, h, layer: TSPLayerShards, step: CacheStep, masks, m: int):
        """Layer ``layer``'s attention of this rank's tokens h with the packed shards broadcast in turn."""
        comm, cfg, c, i = self.comm, self.cfg, self.c, step.layer
        y = torch.zeros(h.shape, dtype=self.dtype, device=h.device)
        # Every rank's earlier slots of its KV head, before this layer stores the chunk's: [2, B, 1, D·m, d].
        past = gather_keys(comm, self.cache, i, m, "infer.kv") if m else None
        for j, w in broadcast_each(comm, layer.attention, "infer.attention"):
            w = _attention_weights(self.view, layer, w)
            q, k, v = project_heads(h, w, cfg, step.cos, step.sin)  # q [B, hq, T, d]; k, v [B, 1, T, d]
            g = j // c
            if j % c == 0:  # the next c - 1 groups read the same KV head
                chunk = comm.all_gather(torch.stack([k, v]), label="infer.kv")  # [D, 2, B, 1, T, d]
                chunk = chunk.permute(1, 2, 3, 0, 4, 5)  # [2, B, 1, D, T, d]
                if g == self.kv_group:
                    step.write(*chunk[:, :, :, self.member::c].flatten(3, 4))
                kv = chunk.flatten(3, 4)
                if past is not None:
                    kv = torch.cat([past[:, :, :, g * c * m:(g + 1) * c * m], kv], dim=3)
            y += attention_output(attend(q, kv[0], kv[1], masks[g])[0], w["wo"], self.dtype)
        return y

    def _member_share(self, T: int, device) -> torch.Tensor:
        """Indices into a chunk of T tokens of those this member keeps: the zigzag shares of its ranks."""
        every = torch.arange(T, device=device)
        return torch.cat([zigzag.shard(every, self.comm.size, r, dim=0)
                          for r in range(self.member, self.comm.size, self.c)])

    def activations_move(self, ids, pos, valid, keep, counts):
        """Replicated tokens ids [B, T] through the model with the weights in place; this rank stores the K/V of
        its member share of the chunk (``keep``, a rank's zigzag share, is replaced by it: ``_member_share``).
        Returns the final-norm hidden states [B, T, h] (replicated)."""
        comm, group, cache = self.comm, self.group, self.cache
        hq, m = self.view.shard_math.q_heads, self.member
        x = sum_over_ranks(comm, masked_lookup(ids, self.embedding, comm.rank)[0], "infer.embedding")
        keep = self._member_share(ids.shape[1], ids.device)
        step = CacheStep(cache, self._reserve(pos[:, keep], valid[:, keep], self._stored(counts)), pos,
                         *rope_tables(pos, self.cfg))

        def attention(h, layer, step):
            w = self._own[id(layer)][0]
            q, k, v = project_heads(h, w, self.cfg, step.cos, step.sin)  # q [B, hq, T, d]; k, v [B, 1, T, d]
            step.write(k[:, :, keep], v[:, :, keep])
            q_group = group.all_gather(q, label="infer.q").movedim(0, 1).flatten(1, 2)  # [B, c·hq, T, d]
            mine = merge_partials(group, *step.attend(q_group), heads=slice(m * hq, (m + 1) * hq))
            return sum_over_ranks(comm, attention_output(mine, w["wo"], self.dtype), "infer.attention")

        mlp = lambda h, layer: sum_over_ranks(comm, self._local_ffn(h, layer), "infer.mlp")
        return self._run(x, step, attention, mlp)

    # -- decode ----------------------------------------------------------------------

    def decode(self, ids, pos, step):
        return self.head(self.decode_activations(ids.unsqueeze(1), pos.unsqueeze(1), step % self.c))

    def decode_activations(self, ids, pos, storer: int):
        """One decode step: ids, pos [B, 1] replicated; member ``storer`` of every group stores the token's K/V
        of its group's head. Returns the final-norm hidden states [B, h] (replicated)."""
        comm, cache = self.comm, self.cache
        B, D, p = ids.shape[0], comm.size, comm.rank
        buffers = self._decode_buffers(B)
        x = sum_over_ranks(comm, masked_lookup(ids, self.embedding, p)[0], "infer.embedding", out=buffers["sum"])
        stores = self.member == storer
        mine = slice(0, 1 if stores else 0)
        slots = self._reserve(pos[:, mine], torch.ones_like(pos[:, mine], dtype=torch.bool),
                              [int(r % self.c == storer) for r in range(D)])
        _, _, k_pos, k_valid = cache.keys(0)
        mask = positions_mask(pos, k_pos, k_valid)  # the same keys in every layer
        attention = lambda h, layer, step: self._decode_attention(h, layer, step, mask, stores, buffers)
        mlp = lambda h, layer: sum_over_ranks(comm, self._local_ffn(h, layer), "infer.mlp", out=buffers["sum"])
        return self._run(x, CacheStep(cache, slots, pos, *rope_tables(pos, self.cfg)), attention, mlp)[:, 0]

    def _decode_attention(self, h, layer: TSPLayerShards, step: CacheStep, mask, stores: bool, buffers):
        """A decode step's attention (module docstring); ``stores``: this rank stores the token's K/V."""
        B, c, hq, d = h.shape[0], self.c, self.view.shard_math.q_heads, self.cfg.head_dim
        w = self._own[id(layer)][0]
        q, k, v = project_qkv(h, w, self.cfg, step.cos, step.sin)  # [B, 1, hq, d]; k, v [B, 1, 1, d]
        if stores:
            step.write(k.transpose(1, 2), v.transpose(1, 2))
        buffers["q"].copy_(q)
        q_all = self.group.all_gather(buffers["q"], label="infer.q", out=buffers["q_all"])  # [c, B, 1, hq, d]
        out, lse = step.attend(q_all[:, :, 0].transpose(0, 1).reshape(B, c * hq, 1, d), mask)
        partial = buffers["partial"]  # [c, B, hq, d + 1]: slice r holds member r's heads' (O, LSE) on my keys
        partial[..., :d] = out.view(B, c, hq, d).transpose(0, 1)
        partial[..., d] = lse.view(B, c, hq).transpose(0, 1)
        parts = self.group.all_to_all(partial, label="infer.attention.merge", out=buffers["partial_all"])
        y = F.linear(merge_packed(parts).to(self.dtype).reshape(B, 1, hq * d), w["wo"])
        return sum_over_ranks(self.comm, y, "infer.attention", out=buffers["sum"])

    def _decode_buffers(self, batch: int) -> dict[str, torch.Tensor]:
        """The exchange buffers of a decode step (made on the first step of a generation)."""
        if self._buffers is None or self._buffers["q"].shape[0] != batch:
            c, d, D, hq = self.c, self.cfg.head_dim, self.comm.size, self.view.shard_math.q_heads
            make = lambda *shape, dtype=self.dtype: torch.empty(shape, dtype=dtype, device=self.device)
            self._buffers = {"q": make(batch, 1, hq, d), "q_all": make(c, batch, 1, hq, d),
                             "partial": make(c, batch, hq, d + 1, dtype=torch.float32),
                             "partial_all": make(c, batch, hq, d + 1, dtype=torch.float32),
                             "sum": make(D, batch, 1, self.cfg.dim)}
        return self._buffers
