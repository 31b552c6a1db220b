"""The KV cache of one rank, attention against it, and the exact merge of per-rank partial attention.

Every scheme keeps its cache in the same shape: per layer K and V ``[B, heads, slots, d]``, plus, per
slot and sequence, the token's global position and whether the slot holds a real token. Slots are
filled in the order tokens arrive on this rank; attention never relies on slot order, only on the
positions (causality) and the validity mask (prompt padding, slots of other sequences' lengths).
That is what lets TSP and SP keep an arbitrary 1/D share of the tokens (the zigzag share of the
prompt, then decoded tokens assigned to ranks in turn) while TP keeps its heads of every token.

Each sequence (row) has its own count of used slots. ``generate`` moves every row in step, so the
counts stay equal and a step's tokens go to one slot range of every row. A server (``torchtsp.serve``)
runs rows that joined at different times: each row then writes after its own last slot, and
``rows(a, b)`` is a view of some rows (sharing the storage) that an engine can run on alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..layers import attend, positions_mask

MERGE_BY_GATHER_MAX_TOKENS = 64  # merge_partials: up to this many (tokens x ranks), one packed all-gather
FAR = torch.iinfo(torch.long).max  # the position of an empty slot: after every query, so never attended


@dataclass(frozen=True)
class CacheStep:
    """The ``cache`` argument an engine gives ``layers.block_forward``: its KV cache, the layer, the slots this
    step's tokens take (``KVCache.reserve``), their positions [B, T] and RoPE tables."""

    cache: KVCache
    slots: slice | torch.Tensor
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    layer: int = 0

    def at(self, layer: int) -> CacheStep:
        return replace(self, layer=layer)

    def write(self, k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)) -> None:
        """Store this step's k, v [B, h, T, d] (of ``heads``) in its slots of this layer."""
        self.cache.write(self.layer, self.slots, k, v, heads)

    def attend(self, q: torch.Tensor, mask=None):
        """(out, lse) of queries q [B, Hq, T, d] against this rank's cache of this layer; ``mask``: the keys' mask
        if already built, else that of this step's positions against the cached ones."""
        k, v, k_pos, k_valid = self.cache.keys(self.layer)
        return attend(q, k, v, positions_mask(self.pos, k_pos, k_valid) if mask is None else mask)


class KVCache:
    """Preallocated K/V of ``n_layers`` layers for ``heads`` KV heads and up to ``capacity`` tokens per sequence."""

    def __init__(self, n_layers: int, batch: int, heads: int, capacity: int, head_dim: int, dtype, device):
        shape = (batch, heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.pos = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.row_fill = torch.zeros(batch, dtype=torch.long)  # slots used by each row (host: read every step)
        self.capacity = capacity

    @property
    def filled(self) -> int:
        """Slots used by the fullest row: attention reads this many."""
        return int(self.row_fill.max()) if len(self.row_fill) else 0

    def rows(self, start: int, stop: int) -> KVCache:
        """The rows [start, stop) as a cache of their own, sharing this one's storage (writes go through)."""
        view = object.__new__(KVCache)
        view.k, view.v = [t[start:stop] for t in self.k], [t[start:stop] for t in self.v]
        view.pos, view.valid, view.row_fill = self.pos[start:stop], self.valid[start:stop], self.row_fill[start:stop]
        view.capacity = self.capacity
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held (the preallocated storage, every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def reserve(self, pos: torch.Tensor, valid: torch.Tensor) -> slice | torch.Tensor:
        """Claim slots for tokens at positions ``pos`` [B, T] (``valid`` [B, T]); returns where they go: one
        slot range when every row has used the same slots, else each row's slot indices [B, T].

        T may be 0 (this rank stores none of the step's tokens)."""
        T = pos.shape[1]
        low, high = (int(self.row_fill.min()), self.filled) if len(self.row_fill) else (0, 0)
        if high + T > self.capacity:
            raise ValueError(f"KV cache full: {high} + {T} tokens exceed its {self.capacity} slots")
        if low == high or T == 0:
            slots = slice(high, high + T) if T else slice(0, 0)
            self.pos[:, slots] = pos
            self.valid[:, slots] = valid
        else:  # rows of different lengths: each continues after its own last slot
            slots = (self.row_fill.unsqueeze(1) + torch.arange(T)).to(self.pos.device)
            self.pos.scatter_(1, slots, pos)
            self.valid.scatter_(1, slots, valid)
        self.row_fill += T
        return slots

    def write(self, layer: int, slots: slice | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              heads: slice = slice(None)):
        """Store k, v [B, h, T, d] of the given heads in the reserved slots."""
        if isinstance(slots, slice):
            self.k[layer][:, heads, slots] = k
            self.v[layer][:, heads, slots] = v
            return
        index = slots[:, None, :, None].expand(k.shape)
        self.k[layer][:, heads].scatter_(2, index, k)
        self.v[layer][:, heads].scatter_(2, index, v)

    def keys(self, layer: int, heads: slice = slice(None)):
        """(K, V, positions, valid) of the filled slots (views)."""
        n = self.filled
        return self.k[layer][:, heads, :n], self.v[layer][:, heads, :n], self.pos[:, :n], self.valid[:, :n]


def merge_packed(parts: torch.Tensor) -> torch.Tensor:
    """The exact merge over dim 0 of partial attentions packed as [D, ..., d + 1]: (O_r, LSE_r) of each key set r.
    A query no key set sees (every LSE -inf) gets zeros."""
    d = parts.shape[-1] - 1
    total = torch.logsumexp(parts[..., d], dim=0)
    weight = torch.exp(parts[..., d] - torch.where(torch.isfinite(total), total, 0.0))
    return (parts[..., :d] * weight.unsqueeze(-1)).sum(dim=0)


def merge_partials(comm, out, lse, heads: slice | None = None):
    """Exact softmax merge of per-rank partial attention over disjoint key sets (flash-decoding).

    out [B, Hq, T, d] and lse [B, Hq, T] (float32) from ``attend`` on this rank's keys; the merged output
    of the query heads ``heads`` (all by default), [B, h, T, d] float32, on every rank.

    Few tokens (decode): one all-gather of (out, lse) packed together, merged locally: one collective
    instead of two, and collectives of a few kB cost their latency, not their bytes. Many tokens (an
    activations-move prefill chunk): the LSEs are all-gathered (small), each rank rescales its partial
    output by exp(lse_p - lse) and one reduce-scatter sums the head groups to their owners (``heads``
    must then be this rank's group), so no rank ever holds D partial outputs.
    """
    B, Hq, T, d = out.shape
    heads = heads or slice(0, Hq)
    if T * comm.size <= MERGE_BY_GATHER_MAX_TOKENS:
        # Every rank sends all heads (an all-gather, not an all-to-all); each keeps the heads it needs.
        parts = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1),
                                label="infer.attention.merge")[:, :, heads]  # [D, B, h, T, d + 1]
        return merge_packed(parts)
    lse_all = torch.logsumexp(comm.all_gather(lse, label="infer.attention.lse"), dim=0)
    scaled = out * torch.exp(lse - torch.where(torch.isfinite(lse_all), lse_all, 0.0)).unsqueeze(-1)
    if heads == slice(0, Hq):
        return comm.all_reduce(scaled, label="infer.attention.merge")
    per_group = scaled.view(B, comm.size, Hq // comm.size, T, d).movedim(1, 0).contiguous()
    return comm.reduce_scatter(per_group, label="infer.attention.merge")


def gathered_keys_mask(comm, cache: KVCache, pos: torch.Tensor, filled: int, label: str):
    """The positional mask of queries at ``pos`` against the first ``filled`` slots of every rank's cache, rank-major
    (as ``gather_keys`` lays them out); an empty slot sits at ``FAR``, after every query."""
    key_pos = comm.all_gather(torch.where(cache.valid[:, :filled], cache.pos[:, :filled], FAR), label=label)
    key_pos = key_pos.movedim(0, 1).flatten(1)  # [B, D·m], rank-major like the K/V of gather_keys
    return positions_mask(pos, key_pos, torch.ones_like(key_pos, dtype=torch.bool))


def gather_keys(comm, cache: KVCache, layer: int, filled: int, label: str, heads: slice = slice(None)):
    """K and V [2, B, h, D·m, d] of ``heads`` in the first ``filled`` slots of every rank's cache, rank-major."""
    kv = torch.stack([cache.k[layer][:, heads, :filled], cache.v[layer][:, heads, :filled]])
    kv = comm.all_gather(kv, label=label)  # [D, 2, B, h, m, d]
    return kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
