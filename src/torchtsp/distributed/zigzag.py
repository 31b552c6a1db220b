"""Zigzag sequence sharding: cut S into 2D chunks; rank p holds chunks p and 2D-1-p.

Under causal attention chunk c sees c+1 chunks of keys, so rank p's pair sees
(p+1) + (2D-p) = 2D+1 chunks: every rank does the same work.
"""

from __future__ import annotations

import torch

from ..chunks import check_divisible, chunk_ids

__all__ = ["check_divisible", "chunk_ids", "positions", "shard", "unshard"]


def positions(seq_len: int, world: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [S/D] of rank's local tokens, in local order."""
    check_divisible(seq_len, world)
    chunk = seq_len // (2 * world)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(rank, world)])


def shard(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The local [.., S/D, ..] zigzag shard of a full-sequence tensor along ``dim``."""
    check_divisible(x.shape[dim], world)
    chunks = x.chunk(2 * world, dim=dim)
    first, second = chunk_ids(rank, world)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard(gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard`` for a stack of every rank's shard: [D, *local] -> [*full] in global order.

    ``dim`` is the sequence dimension of the per-rank tensor (not counting the leading rank dim). One pass
    over the data: every rank's first chunk lands in one strided copy, the second chunks (in reverse rank
    order) in one copy each.
    """
    world, local_len = gathered.shape[0], gathered.shape[dim + 1]
    chunk = local_len // 2
    full_shape = (*gathered.shape[1:dim + 1], world * local_len, *gathered.shape[dim + 2:])
    full = gathered.new_empty(full_shape)
    chunks = full.unflatten(dim, (2 * world, chunk))  # [.., 2D, C, ..], a view
    halves = gathered.unflatten(dim + 1, (2, chunk))  # [D, .., 2, C, ..]
    chunks.narrow(dim, 0, world).copy_(halves.select(dim + 1, 0).movedim(0, dim))
    for rank in range(world):
        chunks.select(dim, 2 * world - 1 - rank).copy_(halves[rank].select(dim, 1))
    return full
