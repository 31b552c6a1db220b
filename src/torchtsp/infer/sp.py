"""SP inference: replicated weights, sequence-sharded KV cache (rank p: all heads of its own tokens).

Prefill: each rank runs its zigzag share of every prompt chunk with the full weights and all-gathers
the K/V of every rank's cache per layer (the training forward of SP). Decode: the new token is
replicated, every rank computes its full q/k/v (no communication), the token's K/V is stored on rank
t mod D, every rank attends to its own cache and the partials are merged exactly by log-sum-exp
(all-reduce form: ``wo`` is replicated, so every rank needs every head). The LM head is local.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import zigzag
from ..distributed.comm import AxisComm
from ..layers import attend, positions_mask, project_qkv, rms_norm, rope_tables, swiglu
from ..parallel.base import ShardView
from ..parallel.moe import moe_partial
from .cache import KVCache, merge_partials
from .engine import Engine, select_last, vocab_logits

FAR = torch.iinfo(torch.long).max  # the position of an empty slot: after every query, so never attended


class SPEngine(Engine):
    scheme = "sp"

    def __init__(self, view: ShardView):
        self.cfg, self.comm, self.layers = view.cfg, view.comm, view.layers
        self.embedding, self.head_rows, self.norm = view.embedding, view.head, view.norm
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        self.vocab_comm = AxisComm(None, "sp.vocab")  # every rank holds the whole vocabulary
        super().__init__()

    @property
    def token_multiple(self):
        return 2 * self.comm.size

    def start(self, batch, prompt_len, max_new_tokens):
        D, cfg = self.comm.size, self.cfg
        capacity = prompt_len // D + -(-(max_new_tokens - 1) // D)
        self.cache = KVCache(cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim, self.dtype, self.device)

    def _rest(self, w, x, out):
        """Output projection and gated MLP (replicated weights, no communication)."""
        B, T, _ = x.shape
        x = x + F.linear(out.to(x.dtype).transpose(1, 2).reshape(B, T, -1), w["wo"])
        h = rms_norm(x, w["ffn_norm"], self.cfg.norm_eps)
        return x + (moe_partial(h, w, self.cfg) if "router" in w else swiglu(h, w["w_gate"], w["w_up"], w["w_down"]))

    def prefill_chunk(self, ids, pos, valid, lengths):
        cfg, comm, cache = self.cfg, self.comm, self.cache
        ids, pos, valid = (zigzag.shard(t, comm.size, comm.rank, dim=1) for t in (ids, pos, valid))
        x = F.embedding(ids, self.embedding)
        cos, sin = rope_tables(pos, cfg)
        slots = cache.reserve(pos, valid)
        m = cache.filled  # the same on every rank during prefill
        key_pos = comm.all_gather(torch.where(cache.valid[:, :m], cache.pos[:, :m], FAR), label="sp.kv.positions")
        key_pos = key_pos.movedim(0, 1).flatten(1)  # [B, D·m], rank-major like the K/V below
        seen = torch.ones_like(key_pos, dtype=torch.bool)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["attention_norm"], cfg.norm_eps)
            q, k, v = (t.transpose(1, 2) for t in project_qkv(h, w, cfg, cos, sin))
            cache.write(i, slots, k, v)
            kv = comm.all_gather(torch.stack([cache.k[i][:, :, :m], cache.v[i][:, :, :m]]), label="sp.kv")
            kv = kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [2, B, H, D·m, d]
            out, _ = attend(q, kv[0], kv[1], positions_mask(pos, key_pos, seen))
            x = self._rest(w, x, out)
        return select_last(rms_norm(x, self.norm, cfg.norm_eps), pos, lengths)

    def finish_last(self, last):
        return self.comm.all_reduce(last, label="sp.last_hidden")  # each last token lives on one rank

    def head(self, z):
        return vocab_logits(z, self.head_rows, 0, self.cfg.vocab_size)

    def decode(self, ids, pos, step):
        cfg, comm, cache = self.cfg, self.comm, self.cache
        ids, pos = ids.unsqueeze(1), pos.unsqueeze(1)
        keep = torch.arange(1 if step % comm.size == comm.rank else 0, device=ids.device)
        x = F.embedding(ids, self.embedding)
        cos, sin = rope_tables(pos, cfg)
        slots = cache.reserve(pos[:, keep], torch.ones_like(pos[:, keep], dtype=torch.bool))
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["attention_norm"], cfg.norm_eps)
            q, k, v = (t.transpose(1, 2) for t in project_qkv(h, w, cfg, cos, sin))
            cache.write(i, slots, k[:, :, keep], v[:, :, keep])
            k_own, v_own, k_pos, k_valid = cache.keys(i)
            out, lse = attend(q, k_own, v_own, positions_mask(pos, k_pos, k_valid))
            x = self._rest(w, x, merge_partials(comm, out, lse))
        return self.head(rms_norm(x, self.norm, cfg.norm_eps)[:, 0])
