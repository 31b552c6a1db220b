"""TSP inference: one weight layout (1/D by head group, FFN slice and vocabulary slice), two schedules
(docs/design.md, "Inference: two schedules on one layout") and three KV-cache layouts (kv_layouts.py).

**An engine is composed, not derived** (``TSPEngine``): this rank's weights with what every schedule computes
with them (``TSPRank``: the embedding by ring or by slice sum, the FFN by ring or by own slice, the sums over
the axis, the model's body), and the steps of its cache layout: ``SequenceLayout`` (here), ``HeadsLayout``
(tsp_heads.py), ``GroupedLayout`` (tsp_grouped.py), which the scheme registry names per layout. A layout's
steps are ``weights_move`` (this rank's zigzag share of a prefill chunk, the weights moving),
``activations_move`` (replicated tokens, the weights in place) and ``decode`` (one token per sequence, the
weights in place); ``decode_schedules`` lists the decode schedules it has: only the sequence layout also
decodes with the weights moving (``decode_weights``), since only its cache is what the weights-move prefill
reads. The engine picks a schedule per phase and runs its layout's step.

**KV cache** (the ``sequence`` layout). Rank p keeps the K/V of *all* KV heads for *its own* tokens: those
at positions t with t mod D == p (``kv_layouts.KVPlacement``, whoever computed them). Its cache is 1/D of the
single-device cache whatever the number of KV heads (also with n_kv < D, where D/n_kv consecutive head groups share one
KV head: their K/V is computed, stored and gathered once, for the first of them).

Model features travel with the packed shard (q/k/v biases) or are replicated (q/k norm weights), as in
training; ``layers.project_qkv`` applies them.

**Weights move** (the training forward; many tokens in flight, e.g. a long prefill). Each rank holds
its share of the step's tokens. Per layer the packed attention shards are broadcast head group by head
group: every rank projects its tokens with group j's weights, all-gathers group j's K/V of every rank's
earlier slots and share of the chunk (``cache.SequenceShardedPrefill``: 1/D of the layer's cache each),
keeps its own tokens' and attends its queries to them; the gated MLP and the embedding take the weight
ring. Only the hidden states of each sequence's last real token are then gathered, for the
vocabulary-sharded LM head.

**Activations move, weights stay** (few tokens in flight, e.g. decode). The step's hidden states are
replicated. Rank p computes head group p's q/k/v and FFN slice p (TP-style); one all-gather gives every
rank all heads' q/k/v of the step's tokens (each rank stores its share of K/V); every rank attends all
heads' queries to its own cache and returns (O_p, LSE_p); the partials are merged exactly by
log-sum-exp for the head-group owners (a decode step: one all-to-all, ``SequenceLayout.decode``; a prefill
chunk: ``merge_partials``); the ``wo`` and ``w_down`` partial outputs are summed over the axis.
Embedding: vocabulary-slice lookup plus the same sum.

``schedule="auto"`` picks per phase: weights move when the tokens in flight per step (B x tokens per
sequence) reach ``tsp_tp_crossover_tokens(cfg)``, the paper's B·S >= P/(4h - 2h/g) at which moving the
weights costs no more traffic than moving activations. Both schedules compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import zigzag
from ..kv_layouts import KVPlacement, kv_heads_of_rank, layout_steps, resolve_kv_layout
from ..layers import (
    Placement,
    attend,
    attention_output,
    project_heads,
    project_qkv,
    scale_embeddings,
    sinked,
)
from ..parallel.moe import ffn_partial
from ..parallel.tsp import broadcast_each, ring_each
from ..parallel.tsp.model import TSPLayerShards, TSPShardView
from ..parallel.tsp.moe import tsp_inference_weights, tsp_moe_local_tokens
from ..parallel.tsp.rings import ring_mlp
from ..schemes import infer_schedule, resolve
from ..sizes import SUM_BY_GATHER_MAX_BYTES, tsp_tp_crossover_tokens
from .cache import CacheStep, KVCache, SequenceShardedPrefill, merge_packed, merge_partials
from .engine import (
    Engine,
    gather_positions,
    masked_lookup,
    run_blocks,
    select_last,
    sum_over_ranks,
    summed_lookup,
    vocab_logits,
)


def _attention_weights(view: TSPShardView, layer: TSPLayerShards, flat) -> dict:
    """``layers.project_qkv``'s weights from one packed attention shard and the layer's q/k norms."""
    a = view.shard_math.attention(flat)
    w = {"wq": a.wq, "wk": a.wk, "wv": a.wv, "wo": a.wo, "bq": a.bq, "bk": a.bk, "bv": a.bv, "sinks": a.sinks}
    if layer.q_norm is not None:
        w.update(q_norm=layer.q_norm, k_norm=layer.k_norm)
    return w


class TSPRank:
    """One rank's TSP weights and what every schedule and cache layout computes with them."""

    def __init__(self, view: TSPShardView):
        self.view, self.cfg, self.comm, self.shards = view, view.cfg, view.comm, view.shard_math
        self.mlp_layout = self.shards.mlp_layout
        self.embedding, self.norm = view.embedding, view.norm
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        D, n_kv = self.comm.size, self.cfg.n_kv_heads
        # The KV heads head group j's weights project (kv_layouts.py: its ``heads`` cache), for every j.
        self.group_kv_heads = [kv_heads_of_rank("heads", n_kv, D, j) for j in range(D)]
        # Each layer's own attention weights and dense FFN slice (None: experts), views of its packed shards made
        # once: unpacking them costs a decode step as much host time as a small layer's matmuls.
        self._own = {id(layer): (_attention_weights(view, layer, layer.attention),
                                 None if layer.moe is not None else
                                 dict(zip(("w_gate", "w_up", "w_down"), self.mlp_layout.unpack(layer.mlp))))
                     for layer in view.layers}
        self._sums = {}  # ``sum``'s gather buffers, by shape (every decode step reuses them)

    def attention_weights(self, layer: TSPLayerShards, flat=None) -> dict:
        """``layers.project_qkv``'s weights of ``layer``: this rank's own, or those of a received packed shard."""
        return self._own[id(layer)][0] if flat is None else _attention_weights(self.view, layer, flat)

    def first_reader(self, j: int) -> bool:
        """Whether head group j is the first of those whose weights read its KV heads (copies of one KV head
        over several groups are computed, gathered and stored once, at the first)."""
        return j == 0 or self.group_kv_heads[j - 1] != self.group_kv_heads[j]

    def sum(self, partial: torch.Tensor, label: str) -> torch.Tensor:
        """``sum_over_ranks``, gathering small partials (a decode step's) into buffers made once per shape."""
        out = None
        if self.comm.size > 1 and partial.numel() * partial.element_size() <= SUM_BY_GATHER_MAX_BYTES:
            out = self._sums.get(partial.shape)
            if out is None:
                out = self._sums[partial.shape] = partial.new_empty(self.comm.size, *partial.shape)
        return sum_over_ranks(self.comm, partial, label, out=out)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, T, h] of replicated tokens ids [B, T]: vocabulary-slice lookups summed over the axis."""
        return summed_lookup(self.comm, ids, self.embedding, self.cfg, "infer.embedding",
                             lambda _, partial, label: self.sum(partial, label))

    def embed_moving(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, T, h] of this rank's tokens ids [B, T] with the vocabulary slices around the ring."""
        x = torch.zeros(*ids.shape, self.cfg.dim, dtype=self.dtype, device=self.device)
        for s, w in ring_each(self.comm, self.embedding, "infer.embedding"):
            found, hit = masked_lookup(ids, w, s)
            x = torch.where(hit.unsqueeze(-1), found, x)
        return scale_embeddings(x, self.cfg)

    def summed_ffn(self, h: torch.Tensor, layer: TSPLayerShards) -> torch.Tensor:
        """The MLP of replicated tokens h with the weights in place: this rank's FFN slice, or its experts on the
        tokens routed to them, summed over the axis."""
        D, p = self.comm.size, self.comm.rank
        if layer.moe is not None:
            partial = ffn_partial(h, tsp_inference_weights(layer.moe), self.cfg, p * self.cfg.n_experts // D)
        else:
            partial = ffn_partial(h, self._own[id(layer)][1], self.cfg)
        return self.sum(partial, "infer.mlp")

    def weights_mlp(self, h: torch.Tensor, layer: TSPLayerShards) -> torch.Tensor:
        """The MLP with the weights moving: the FFN shards around the ring, or the tokens to their experts."""
        if layer.moe is not None:  # tokens travel to the experts' owners and back
            return tsp_moe_local_tokens(h, layer.moe)
        return ring_mlp(h, layer.mlp, self.mlp_layout, self.comm, "infer.mlp", self.cfg.mlp_activation)

    def run(self, x: torch.Tensor, step: CacheStep, attention, mlp) -> torch.Tensor:
        """The model's body with ``attention(h, layer, step)`` and ``mlp(h, layer)`` as every layer's strategies."""

        def placement(layer: TSPLayerShards) -> Placement:
            norms = {"attention_norm": layer.attention_norm, "ffn_norm": layer.ffn_norm, **layer.sandwich}
            # GPT-OSS's output bias, replicated: added once to the attention summed over head groups, whatever the
            # cache layout's exchange.
            biased = (lambda y: y) if layer.bo is None else (lambda y: y + layer.bo)
            return Placement.normed(norms, lambda h, step: biased(attention(h, layer, step)),
                                    lambda h: mlp(h, layer), self.cfg)

        return run_blocks(x, step, self.view.layers, placement, self.norm, self.cfg)

    def decode_with(self, cache: KVCache, ids, pos, attention) -> torch.Tensor:
        """One decode step through the model with ``attention(h, layer, step, mask)`` (a cache layout's exchange):
        every rank writes every token's K/V to ``reserve``'s slots (the spare one for the tokens it does not keep),
        the keys' mask is the same in every layer, the FFN slices are summed. Returns [B, h] (replicated)."""
        slots = cache.reserve(pos, torch.ones_like(pos, dtype=torch.bool))
        mask = cache.mask(pos)
        step = CacheStep.of(self.cfg, cache, slots, pos)
        return self.run(self.embed(ids), step, lambda h, layer, step: attention(h, layer, step, mask),
                        self.summed_ffn)[:, 0]


class SequenceLayout:
    """The ``sequence`` cache layout's steps: every rank caches every KV head of its 1/D of the tokens."""

    decode_schedules = ("activations", "weights")

    def __init__(self, rank: TSPRank):
        self.rank = rank
        self.placement = KVPlacement.of("sequence", rank.cfg.n_kv_heads, rank.comm.size)
        self._buffers = None  # decode's exchange buffers

    def weights_move(self, cache: KVCache, ids, pos, valid):
        """This rank's tokens ids [B, T] (its share of the step; the same T on every rank) through the model with the
        weights moving. Returns their final-norm hidden states [B, T, h]."""
        r = self.rank
        cfg, comm = r.cfg, r.comm
        chunk = SequenceShardedPrefill(comm, cache, pos, valid, "infer.kv")
        step = CacheStep.of(cfg, cache, chunk.slots, pos)

        def attention(h, layer, step):
            y = torch.zeros(h.shape, dtype=r.dtype, device=h.device)
            for j, w in broadcast_each(comm, layer.attention, "infer.attention"):
                w = r.attention_weights(layer, w)
                q, k, v = project_heads(h, w, cfg, step.cos, step.sin)
                if r.first_reader(j):  # the next groups reading the same KV heads use these: gathered once
                    heads = r.group_kv_heads[j]
                    kv = chunk.keys(step.layer, k, v, heads=slice(heads.start, heads.stop))  # [2, B, hkv, ·, d]
                out = sinked(*attend(q, kv[0], kv[1], step.masked(chunk.mask)), w["sinks"])
                y += attention_output(out, w["wo"], r.dtype)
            return y

        return r.run(r.embed_moving(ids), step, attention, r.weights_mlp)

    def activations_move(self, cache: KVCache, ids, pos, valid):
        """Replicated tokens ids [B, T] through the model with the weights in place; this rank stores the K/V
        of those the cache rule gives it. Returns the final-norm hidden states [B, T, h] (replicated)."""
        r = self.rank
        comm, shards = r.comm, r.shards
        hq, hkv, replicas = shards.q_heads, shards.kv_heads, shards.kv_replicas
        step = CacheStep.of(r.cfg, cache, cache.reserve(pos, valid), pos)

        def attention(h, layer, step):
            w = r.attention_weights(layer)
            q, k, v = project_qkv(h, w, r.cfg, step.cos, step.sin)  # [B, T, heads, d]
            qkv = comm.all_gather(torch.cat([q, k, v], dim=2), label="infer.qkv")  # [D, B, T, hq + 2hkv, d]
            qkv = qkv.permute(1, 2, 0, 3, 4)  # [B, T, D, hq + 2hkv, d]: head group r's heads at r
            # [B, heads, T, d] each, heads in global order; a KV head copied on several ranks is taken once.
            q_all, k_all, v_all = (qkv[:, :, ::every, a:b].flatten(2, 3).transpose(1, 2)
                                   for a, b, every in ((0, hq, 1), (hq, hq + hkv, replicas),
                                                       (hq + hkv, hq + 2 * hkv, replicas)))
            step.write(k_all, v_all)
            group = slice(comm.rank * hq, (comm.rank + 1) * hq)
            # Head group p's, over every rank's keys (with its sinks, once merged).
            mine = merge_partials(comm, *step.attend(q_all), heads=group, sinks=w["sinks"])
            return r.sum(attention_output(mine, w["wo"], r.dtype), "infer.attention")

        return r.run(r.embed(ids), step, attention, r.summed_ffn)

    def decode(self, cache: KVCache, ids, pos):
        """One decode step with the weights in place: ids, pos [B, 1] replicated; each token's K/V is stored by the
        rank the cache rule names. Returns the final-norm hidden states [B, h] (replicated).

        Per layer four exchanges, the fewest this placement allows (docs/design.md: q of group j is made on rank
        j and read by every rank's keys; the partials of group j meet ``wo``'s columns on rank j; every rank's
        FFN slice, and the next layer's projections, read the whole residual): one all-gather of every head
        group's q/k/v; one all-to-all that hands each head group's partial attention (O_p, LSE_p) of every rank
        to its owner, who merges them exactly by log-sum-exp; the sum of the ``wo`` partials; the MLP's sum
        (``TSPRank.sum``). The keys' mask is built once per step, the exchange buffers once per generation;
        every rank writes every token's K/V to ``reserve``'s slots (the spare one for the tokens it does not keep).
        """
        buffers = self._decode_buffers(ids.shape[0])
        return self.rank.decode_with(cache, ids, pos, lambda h, layer, step, mask: self._decode_attention(
            h, layer, step, mask, buffers))

    def _decode_attention(self, h, layer: TSPLayerShards, step: CacheStep, mask, buffers):
        """A decode step's attention (see ``decode``)."""
        r = self.rank
        comm, shards = r.comm, r.shards
        B, D = h.shape[0], comm.size
        hq, hkv, replicas, d = shards.q_heads, shards.kv_heads, shards.kv_replicas, r.cfg.head_dim
        w = r.attention_weights(layer)
        q, k, v = project_qkv(h, w, r.cfg, step.cos, step.sin)  # [B, 1, ·, d]
        torch.cat([q, k, v], dim=2, out=buffers["qkv"])
        qkv = comm.all_gather(buffers["qkv"], label="infer.qkv", out=buffers["qkv_all"])[:, :, 0]
        # [D, B, hq + 2hkv, d] -> queries [B, Hq, 1, d] in global head order (group r's heads at r).
        q_all = qkv[:, :, :hq].transpose(0, 1).reshape(B, D * hq, 1, d)
        # A KV head copied on several ranks is taken from the first of them.
        kv = qkv[::replicas, :, hq:].transpose(0, 1).reshape(B, D // replicas, 2, hkv, d)
        step.write(*(kv[:, :, j].reshape(B, -1, 1, d) for j in (0, 1)))
        out, lse = step.attend(q_all, mask)  # this rank's keys, every head: [B, Hq, 1, d], [B, Hq, 1]
        partial = buffers["partial"]  # [D, B, hq, d + 1]: slice r holds head group r's (O_p, LSE_p)
        partial[..., :d] = out.view(B, D, hq, d).transpose(0, 1)
        partial[..., d] = lse.view(B, D, hq).transpose(0, 1)
        parts = comm.all_to_all(partial, label="infer.attention.merge", out=buffers["partial_all"])
        merged = merge_packed(parts, w["sinks"])  # [B, hq, d]: group p's heads, over every rank's keys
        y = F.linear(merged.to(r.dtype).reshape(B, 1, hq * d), w["wo"])
        return r.sum(y, "infer.attention")

    def _decode_buffers(self, batch: int) -> dict[str, torch.Tensor]:
        """The exchange buffers of a decode step (made on the first step of a generation)."""
        if self._buffers is None or self._buffers["qkv"].shape[0] != batch:
            r = self.rank
            D, d, shards = r.comm.size, r.cfg.head_dim, r.shards
            heads = shards.q_heads + 2 * shards.kv_heads
            make = lambda *shape, dtype=r.dtype: torch.empty(shape, dtype=dtype, device=r.device)
            self._buffers = {"qkv": make(batch, 1, heads, d), "qkv_all": make(D, batch, 1, heads, d),
                             "partial": make(D, batch, shards.q_heads, d + 1, dtype=torch.float32),
                             "partial_all": make(D, batch, shards.q_heads, d + 1, dtype=torch.float32)}
        return self._buffers

    def decode_weights(self, cache: KVCache, ids, pos):
        """One decode step with the weights moving: each token runs on the rank that keeps its K/V (the others
        idle: their share of the step is empty); its final-norm hidden state is summed to every rank."""
        comm = self.rank.comm
        mine = self.placement.keeper(pos) == self.placement.member_of_rank(comm.rank)
        z = torch.where(mine.unsqueeze(-1), self.weights_move(cache, ids, pos, mine), 0.0).sum(dim=1)
        return comm.all_reduce(z, label="infer.last_hidden")


class TSPEngine(Engine):
    """A TSP rank's inference: its weights (``TSPRank``) and its cache layout's steps (the registry's class for
    ``kv_layout``), run by the schedule chosen per phase."""

    scheme = "tsp"

    def __init__(self, view: TSPShardView, kv_layout: str = "sequence"):
        # The one-line error naming n_kv and D for a layout the model does not allow, also when built here.
        self.kv_layout = resolve_kv_layout(kv_layout, view.cfg.n_kv_heads, view.comm.size)
        self.rank = TSPRank(view)
        self.view, self.cfg, self.comm = view, view.cfg, view.comm
        self.head_rows, self.norm = view.head, view.norm
        self.device, self.dtype = self.rank.device, self.rank.dtype
        self.vocab_comm, self.vocab_start = self.comm, self.comm.rank * view.embedding.shape[0]
        super().__init__()
        self.layout = resolve(layout_steps(self.scheme, self.kv_layout))(self.rank)
        self.schedule = {"prefill": "weights", "decode": "activations"}

    @property
    def token_multiple(self):
        return 2 * self.comm.size

    def choose_schedule(self, schedule, batch, prefill_tokens):
        crossover = tsp_tp_crossover_tokens(self.cfg)
        pick = lambda tokens: infer_schedule(self.scheme, tokens, crossover, schedule)
        decode = pick(batch)
        if decode not in self.layout.decode_schedules:  # the layout decodes one way only (module docstring)
            decode = self.layout.decode_schedules[0]
        self.schedule = {"prefill": pick(batch * prefill_tokens), "decode": decode}

    def prefill_chunk(self, ids, pos, valid, lengths, all_positions=None):
        D, p = self.comm.size, self.comm.rank
        if self.schedule["prefill"] == "weights":
            share = lambda t: zigzag.shard(t, D, p, dim=1)
            z = self.layout.weights_move(self.cache, share(ids), share(pos), share(valid))
            last = select_last(z, pos=share(pos), lengths=lengths)
            if all_positions is None:
                return last
            return last, gather_positions(self.comm, z, all_positions, "infer.prompt_hidden")
        z = self.layout.activations_move(self.cache, ids, pos, valid)  # replicated: every position is here
        last = select_last(z, pos, lengths)
        return last if all_positions is None else (last, z[all_positions])

    def finish_last(self, last):
        if self.schedule["prefill"] == "weights":  # each sequence's last token lives on one rank
            return self.comm.all_reduce(last, label="infer.last_hidden")
        return last

    def head(self, z):
        return vocab_logits(z, self.head_rows, self.vocab_start, self.cfg.vocab_size)

    def decode(self, ids, pos):
        ids, pos = ids.unsqueeze(1), pos.unsqueeze(1)
        if self.schedule["decode"] == "weights":
            return self.head(self.layout.decode_weights(self.cache, ids, pos))
        return self.head(self.layout.decode(self.cache, ids, pos))
