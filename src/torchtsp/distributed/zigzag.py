"""Zigzag sequence sharding: cut S into 2D chunks; rank p holds chunks p and 2D-1-p.

Under causal attention chunk c sees c+1 chunks of keys, so rank p's pair sees
(p+1) + (2D-p) = 2D+1 chunks: every rank does the same work.
"""

from __future__ import annotations

import torch


def check_divisible(seq_len: int, world: int) -> None:
    if seq_len % (2 * world):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2*D = {2 * world} for zigzag sharding over "
            f"D={world} ranks; pick a length that is a multiple of {2 * world}"
        )


def chunk_ids(rank: int, world: int) -> tuple[int, int]:
    """The two global chunk indices rank ``rank`` holds, in local order."""
    return rank, 2 * world - 1 - rank


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

    ``dim`` is the sequence dimension of the per-rank tensor (not counting the leading rank dim).
    """
    halves = gathered.chunk(2, dim=dim + 1)  # each [D, .., C, ..]: every rank's first / second chunk
    # Global chunk order: first chunks of ranks 0..D-1, then second chunks of ranks D-1..0.
    ordered = torch.cat([halves[0], halves[1].flip(0)], dim=0)  # [2D, .., C, ..]
    ordered = ordered.movedim(0, dim)  # [.., 2D, C, ..]
    return ordered.flatten(dim, dim + 1)
