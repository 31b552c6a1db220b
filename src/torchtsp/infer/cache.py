"""The KV cache of one rank, attention against it, and the exact merge of per-rank partial attention.

Every scheme keeps its cache in the same shape: per layer K and V ``[B, heads, slots, d]``, plus, per
slot and sequence, the token's global position and whether the slot holds a real token. Slots are
filled in the order tokens arrive on this rank; attention never relies on slot order, only on the
positions (causality) and the validity mask (prompt padding, slots of other sequences' lengths).
That is what lets TSP and SP keep an arbitrary 1/D share of the tokens (the zigzag share of the
prompt, then decoded tokens assigned to ranks in turn) while TP keeps its heads of every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 1024  # keys per block of the attention loop: bounds its score matrix to [B, H, T, KEY_BLOCK]
MERGE_BY_GATHER_MAX_TOKENS = 64  # merge_partials: up to this many (tokens x ranks), one packed all-gather


class KVCache:
    """Preallocated K/V of ``n_layers`` layers for ``heads`` KV heads and up to ``capacity`` tokens per sequence."""

    def __init__(self, n_layers: int, batch: int, heads: int, capacity: int, head_dim: int, dtype, device):
        shape = (batch, heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.pos = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.capacity, self.filled = capacity, 0

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held (the preallocated storage, every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def reserve(self, pos: torch.Tensor, valid: torch.Tensor) -> slice:
        """Claim slots for tokens at positions ``pos`` [B, T] (``valid`` [B, T]); returns the slot range.

        T may be 0 (this rank stores none of the step's tokens)."""
        T = pos.shape[1]
        if self.filled + T > self.capacity:
            raise ValueError(f"KV cache full: {self.filled} + {T} tokens exceed its {self.capacity} slots")
        slots = slice(self.filled, self.filled + T)
        self.pos[:, slots] = pos
        self.valid[:, slots] = valid
        self.filled += T
        return slots

    def write(self, layer: int, slots: slice, k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)):
        """Store k, v [B, h, T, d] of the given heads in the reserved slots."""
        self.k[layer][:, heads, slots] = k
        self.v[layer][:, heads, slots] = v

    def keys(self, layer: int, heads: slice = slice(None)):
        """(K, V, positions, valid) of the filled slots (views)."""
        n = self.filled
        return self.k[layer][:, heads, :n], self.v[layer][:, heads, :n], self.pos[:, :n], self.valid[:, :n]


def rope_tables(positions: torch.Tensor, cfg):
    """cos/sin [B, T, 1, d] for per-sequence positions [B, T] (sequences of a batch sit at different positions)."""
    from ..model import rope_tables as tables

    cos, sin = tables(positions.reshape(-1), cfg)
    return cos.view(*positions.shape, 1, cfg.head_dim), sin.view(*positions.shape, 1, cfg.head_dim)


def project_qkv(cfg, w: dict, h: torch.Tensor, cos, sin):
    """Queries, keys and values [B, heads, T, d] of hidden states h [B, T, h] with the (possibly head-sliced)
    weights ``w`` (``wq``, ``wk``, ``wv``; ``bq``, ``bk``, ``bv`` with q/k/v bias; ``q_norm``, ``k_norm`` with
    q/k norm), rotated at the tokens' positions: the reference attention's math, on any heads (and on no
    token: T may be 0)."""
    from ..model import head_norm

    B, T, _ = h.shape
    d = cfg.head_dim
    q, k, v = (F.linear(h, w[f"w{n}"], w.get(f"b{n}")).view(B, T, w[f"w{n}"].shape[0] // d, d) for n in "qkv")
    if cfg.qk_norm:
        q, k = head_norm(q, w["q_norm"], cfg.norm_eps), head_norm(k, w["k_norm"], cfg.norm_eps)
    return apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``torchtsp.model.apply_rope`` with per-sequence tables: x [B, T, H, d], cos/sin [B, T, 1, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


def attend(q, k, v, q_pos, k_pos, k_valid):
    """Attention of queries q [B, Hq, T, d] against keys/values [B, Hkv, N, d] in float32.

    A query at position i sees the valid keys at positions <= i. Returns (out [B, Hq, T, d] float32,
    lse [B, Hq, T] float32); a query that sees no key here gets out = 0, lse = -inf, which the merge
    weighs by exp(-inf) = 0. GQA: query head j uses KV head j // g, without expanding K/V.
    """
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    qf = q.float().reshape(B, Hkv, g * T, d) * d**-0.5
    out = torch.zeros(B, Hkv, g * T, d, dtype=torch.float32, device=q.device)
    run_max = torch.full((B, Hkv, g * T), float("-inf"), dtype=torch.float32, device=q.device)
    run_sum = torch.zeros_like(run_max)
    for a in range(0, k.shape[2], KEY_BLOCK):
        b = min(a + KEY_BLOCK, k.shape[2])
        s = qf @ k[:, :, a:b].float().transpose(-1, -2)  # [B, Hkv, gT, b-a]: the one score-sized buffer
        # The mask is per (query token, key), shared by the g query heads of a KV head: [B, 1, 1, T, b-a].
        hidden = k_pos[:, None, None, None, a:b] > q_pos[:, None, None, :, None]
        hidden |= ~k_valid[:, None, None, None, a:b]  # in place: one mask-sized buffer per block
        s.view(B, Hkv, g, T, b - a).masked_fill_(hidden, float("-inf"))
        new_max = torch.maximum(run_max, s.amax(dim=-1))
        # Rows that have seen no key yet keep max = -inf; a finite stand-in avoids -inf - -inf = NaN.
        shift = torch.where(torch.isfinite(new_max), new_max, 0.0)
        p = s.sub_(shift.unsqueeze(-1)).exp_()  # in place: online softmax (flash attention)
        rescale = torch.exp(run_max - shift)
        run_sum = run_sum * rescale + p.sum(dim=-1)
        out = out * rescale.unsqueeze(-1) + p @ v[:, :, a:b].float()
        run_max = new_max
        del s, p, hidden  # before the next block's scores: never two score buffers alive
    seen_any = run_sum > 0
    out = out / torch.where(seen_any, run_sum, 1.0).unsqueeze(-1)
    lse = torch.where(seen_any, torch.where(torch.isfinite(run_max), run_max, 0.0) + run_sum.log(), float("-inf"))
    return out.view(B, Hq, T, d), lse.view(B, Hq, T)


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
        outs, lses = parts[..., :d], parts[..., d]
        total = torch.logsumexp(lses, dim=0)
        weight = torch.exp(lses - torch.where(torch.isfinite(total), total, 0.0))
        return (outs * weight.unsqueeze(-1)).sum(dim=0)
    lse_all = torch.logsumexp(comm.all_gather(lse, label="infer.attention.lse"), dim=0)
    scaled = out * torch.exp(lse - torch.where(torch.isfinite(lse_all), lse_all, 0.0)).unsqueeze(-1)
    if heads == slice(0, Hq):
        return comm.all_reduce(scaled, label="infer.attention.merge")
    per_group = scaled.view(B, comm.size, Hq // comm.size, T, d).movedim(1, 0).contiguous()
    return comm.reduce_scatter(per_group, label="infer.attention.merge")
