"""TSP inference: one layout (weights 1/D by head group, FFN slice and vocabulary slice; tokens and KV cache
1/D by sequence), two schedules (docs/design.md, "Inference: two schedules on one layout").

**KV cache** (the ``sequence`` layout). Rank p keeps the K/V of *all* KV heads for *its own* tokens: those
at positions t with t mod D == p (cache.py's rule, whoever computed them). Its cache is 1/D of the
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
log-sum-exp for the head-group owners (a decode step: one all-to-all, ``decode_activations``; a prefill
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
from ..layers import (
    Placement,
    attend,
    attention_output,
    project_heads,
    project_qkv,
)
from ..parallel.moe import ffn_partial
from ..parallel.tsp import broadcast_each, ring_each
from ..parallel.tsp.model import TSPLayerShards, TSPShardView
from ..parallel.tsp.moe import tsp_inference_weights, tsp_moe_local_tokens
from ..parallel.tsp.rings import ring_mlp
from ..schemes import infer_schedule
from .cache import CacheStep, SequenceShardedPrefill, merge_packed, merge_partials
from .engine import Engine, gather_positions, masked_lookup, select_last, sum_over_ranks, vocab_logits


def _attention_weights(view: TSPShardView, layer: TSPLayerShards, flat) -> dict:
    """``layers.project_qkv``'s weights from one packed attention shard and the layer's q/k norms."""
    a = view.shard_math.attention(flat)
    w = {"wq": a.wq, "wk": a.wk, "wv": a.wv, "wo": a.wo, "bq": a.bq, "bk": a.bk, "bv": a.bv}
    if layer.q_norm is not None:
        w.update(q_norm=layer.q_norm, k_norm=layer.k_norm)
    return w


class TSPEngine(Engine):
    scheme = "tsp"

    def __init__(self, view: TSPShardView):
        self.view, self.cfg, self.comm = view, view.cfg, view.comm
        self.attention_layout, self.mlp_layout = view.shard_math.attention_layout, view.shard_math.mlp_layout
        self.embedding, self.head_rows, self.norm = view.embedding, view.head, view.norm
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        self.vocab_comm, self.vocab_start = self.comm, self.comm.rank * self.embedding.shape[0]
        super().__init__()
        self.schedule = {"prefill": "weights", "decode": "activations"}
        self._buffers = None  # decode_activations' exchange buffers
        # Each layer's own attention weights and dense FFN slice (None: experts), views of its packed shards made
        # once: unpacking them costs a decode step as much host time as a small layer's matmuls.
        self._own = {id(layer): (_attention_weights(view, layer, layer.attention),
                                 None if layer.moe is not None else
                                 dict(zip(("w_gate", "w_up", "w_down"), self.mlp_layout.unpack(layer.mlp))))
                     for layer in view.layers}

    @property
    def token_multiple(self):
        return 2 * self.comm.size

    def choose_schedule(self, schedule, batch, prefill_tokens):
        from ..analysis import tsp_tp_crossover_tokens

        crossover = tsp_tp_crossover_tokens(self.cfg)
        pick = lambda tokens: infer_schedule(self.scheme, tokens, crossover, schedule)
        self.schedule = {"prefill": pick(batch * prefill_tokens), "decode": pick(batch)}

    # -- the two schedules ---------------------------------------------------------------

    def _placement(self, layer: TSPLayerShards, attention, mlp) -> Placement:
        """Layer ``layer``'s block: ``attention(h, layer, step)`` and ``mlp(h, layer)`` of one schedule."""
        norms = {"attention_norm": layer.attention_norm, "ffn_norm": layer.ffn_norm, **layer.sandwich}
        return Placement.normed(norms, lambda h, step: attention(h, layer, step), lambda h: mlp(h, layer), self.cfg)

    def _run(self, x, step: CacheStep, attention, mlp):
        return self.run_blocks(x, step, self.view.layers, lambda layer: self._placement(layer, attention, mlp))

    def _local_ffn(self, h, layer: TSPLayerShards):
        """This rank's FFN slice or experts on replicated tokens h, summed over the axis by the caller."""
        D, p = self.comm.size, self.comm.rank
        if layer.moe is not None:  # this rank's experts on the replicated tokens routed to them
            return ffn_partial(h, tsp_inference_weights(layer.moe), self.cfg, p * self.cfg.n_experts // D)
        return ffn_partial(h, self._own[id(layer)][1], self.cfg)

    def _weights_mlp(self, h, layer: TSPLayerShards):
        """The MLP with the weights moving: the FFN shards around the ring, or the tokens to their experts."""
        if layer.moe is not None:  # tokens travel to the experts' owners and back
            return tsp_moe_local_tokens(h, layer.moe)
        return ring_mlp(h, layer.mlp, self.mlp_layout, self.comm, "infer.mlp", self.cfg.mlp_activation)

    def embed_moving(self, ids):
        """Embeddings [B, T, h] of this rank's tokens ids [B, T] with the vocabulary slices around the ring."""
        x = torch.zeros(*ids.shape, self.cfg.dim, dtype=self.dtype, device=self.device)
        for s, w in ring_each(self.comm, self.embedding, "infer.embedding"):
            found, hit = masked_lookup(ids, w, s)
            x = torch.where(hit.unsqueeze(-1), found, x)
        return x

    def weights_move(self, ids, pos, valid):
        """This rank's tokens ids [B, T] (its share of the step; the same T on every rank) through the model with the
        weights moving. Returns their final-norm hidden states [B, T, h]."""
        cfg, comm = self.cfg, self.comm
        x = self.embed_moving(ids)
        chunk = SequenceShardedPrefill(comm, self.cache, pos, valid, "infer.kv")
        step = CacheStep.of(cfg, self.cache, chunk.slots, pos)
        replicas, hkv = self.view.shard_math.kv_replicas, self.view.shard_math.kv_heads

        def attention(h, layer, step):
            y = torch.zeros(h.shape, dtype=self.dtype, device=h.device)
            for j, w in broadcast_each(comm, layer.attention, "infer.attention"):
                w = _attention_weights(self.view, layer, w)
                q, k, v = project_heads(h, w, cfg, step.cos, step.sin)
                if j % replicas == 0:  # the next replicas - 1 groups read the same KV head: gathered once
                    group = slice(j // replicas * hkv, (j // replicas + 1) * hkv)
                    kv = chunk.keys(step.layer, k, v, heads=group)  # [2, B, hkv, D·(S + T), d]
                y += attention_output(attend(q, kv[0], kv[1], step.masked(chunk.mask))[0], w["wo"], self.dtype)
            return y

        return self._run(x, step, attention, self._weights_mlp)

    def activations_move(self, ids, pos, valid):
        """Replicated tokens ids [B, T] through the model with the weights in place; this rank stores the K/V
        of those the cache rule gives it. Returns the final-norm hidden states [B, T, h] (replicated)."""
        comm, cache = self.comm, self.cache
        shards = self.view.shard_math
        hq, hkv, replicas = shards.q_heads, shards.kv_heads, shards.kv_replicas
        x = sum_over_ranks(comm, masked_lookup(ids, self.embedding, comm.rank)[0], "infer.embedding")
        step = CacheStep.of(self.cfg, cache, cache.reserve(pos, valid), pos)

        def attention(h, layer, step):
            w = self._own[id(layer)][0]
            q, k, v = project_qkv(h, w, self.cfg, step.cos, step.sin)  # [B, T, heads, d]
            qkv = comm.all_gather(torch.cat([q, k, v], dim=2), label="infer.qkv")  # [D, B, T, hq + 2hkv, d]
            qkv = qkv.permute(1, 2, 0, 3, 4)  # [B, T, D, hq + 2hkv, d]: head group r's heads at r
            # [B, heads, T, d] each, heads in global order; a KV head copied on several ranks is taken once.
            q_all, k_all, v_all = (qkv[:, :, ::every, a:b].flatten(2, 3).transpose(1, 2)
                                   for a, b, every in ((0, hq, 1), (hq, hq + hkv, replicas),
                                                       (hq + hkv, hq + 2 * hkv, replicas)))
            step.write(k_all, v_all)
            group = slice(comm.rank * hq, (comm.rank + 1) * hq)
            mine = merge_partials(comm, *step.attend(q_all), heads=group)  # head group p's, over every rank's keys
            return sum_over_ranks(comm, attention_output(mine, w["wo"], self.dtype), "infer.attention")

        mlp = lambda h, layer: sum_over_ranks(comm, self._local_ffn(h, layer), "infer.mlp")
        return self._run(x, step, attention, mlp)

    def decode_activations(self, ids, pos):
        """One decode step with the weights in place: ids, pos [B, 1] replicated; each token's K/V is stored by the
        rank the cache rule names. Returns the final-norm hidden states [B, h] (replicated).

        Per layer four exchanges, the fewest this placement allows (docs/design.md: q of group j is made on rank
        j and read by every rank's keys; the partials of group j meet ``wo``'s columns on rank j; every rank's
        FFN slice, and the next layer's projections, read the whole residual): one all-gather of every head
        group's q/k/v; one all-to-all that hands each head group's partial attention (O_p, LSE_p) of every rank
        to its owner, who merges them exactly by log-sum-exp; the sum of the ``wo`` partials; the MLP's sum
        (``sum_over_ranks``). The keys' mask is built once per step, the exchange buffers once per generation;
        every rank writes every token's K/V to ``reserve``'s slots (the spare one for the tokens it does not keep).
        """
        comm, cache = self.comm, self.cache
        B, p = ids.shape[0], comm.rank
        buffers = self._decode_buffers(B)
        x = sum_over_ranks(comm, masked_lookup(ids, self.embedding, p)[0], "infer.embedding", out=buffers["sum"])
        slots = cache.reserve(pos, torch.ones_like(pos, dtype=torch.bool))
        mask = cache.mask(pos)  # the same keys in every layer
        attention = lambda h, layer, step: self._decode_attention(h, layer, step, mask, buffers)
        mlp = lambda h, layer: sum_over_ranks(comm, self._local_ffn(h, layer), "infer.mlp", out=buffers["sum"])
        return self._run(x, CacheStep.of(self.cfg, cache, slots, pos), attention, mlp)[:, 0]

    def _decode_attention(self, h, layer: TSPLayerShards, step: CacheStep, mask, buffers):
        """A decode step's attention (see ``decode_activations``)."""
        comm = self.comm
        B, D = h.shape[0], comm.size
        shards = self.view.shard_math
        hq, hkv, replicas, d = shards.q_heads, shards.kv_heads, shards.kv_replicas, self.cfg.head_dim
        w = self._own[id(layer)][0]
        q, k, v = project_qkv(h, w, self.cfg, step.cos, step.sin)  # [B, 1, ·, d]
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
        merged = merge_packed(parts)  # [B, hq, d]: group p's heads, over every rank's keys
        y = F.linear(merged.to(self.dtype).reshape(B, 1, hq * d), w["wo"])
        return sum_over_ranks(comm, y, "infer.attention", out=buffers["sum"])

    def _decode_buffers(self, batch: int) -> dict[str, torch.Tensor]:
        """The exchange buffers of a decode step (made on the first step of a generation)."""
        if self._buffers is None or self._buffers["qkv"].shape[0] != batch:
            D, d, shards = self.comm.size, self.cfg.head_dim, self.view.shard_math
            heads = shards.q_heads + 2 * shards.kv_heads
            make = lambda *shape, dtype=self.dtype: torch.empty(shape, dtype=dtype, device=self.device)
            self._buffers = {"qkv": make(batch, 1, heads, d), "qkv_all": make(D, batch, 1, heads, d),
                             "partial": make(D, batch, shards.q_heads, d + 1, dtype=torch.float32),
                             "partial_all": make(D, batch, shards.q_heads, d + 1, dtype=torch.float32),
                             "sum": make(D, batch, 1, self.cfg.dim)}
        return self._buffers

    # -- phases --------------------------------------------------------------------------

    def prefill_chunk(self, ids, pos, valid, lengths, all_positions=None):
        D, p = self.comm.size, self.comm.rank
        if self.schedule["prefill"] == "weights":
            share = lambda t: zigzag.shard(t, D, p, dim=1)
            z = self.weights_move(share(ids), share(pos), share(valid))
            last = select_last(z, pos=share(pos), lengths=lengths)
            if all_positions is None:
                return last
            return last, gather_positions(self.comm, z, all_positions, "infer.prompt_hidden")
        z = self.activations_move(ids, pos, valid)  # replicated: every position is here
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
        if self.schedule["decode"] == "weights":  # each token on the rank that keeps its K/V; the others idle
            mine = pos % self.comm.size == self.comm.rank
            z = torch.where(mine.unsqueeze(-1), self.weights_move(ids, pos, mine), 0.0).sum(dim=1)
            return self.head(self.comm.all_reduce(z, label="infer.last_hidden"))
        return self.head(self.decode_activations(ids, pos))
