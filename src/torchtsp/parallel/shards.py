"""Packed weight shards: several weight slices of one rank in ONE flat buffer.

A packed buffer moves with a single collective, and every rank's buffer has the same
size, so buffers can be broadcast or passed around a ring and unpacked by any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    name: str  # reference parameter name
    full_shape: tuple[int, int]
    shard_dim: int  # the dimension cut into D equal slices, one per rank


@dataclass(frozen=True)
class PackedLayout:
    parts: tuple[Part, ...]
    world: int

    def local_shape(self, part: Part) -> tuple[int, int]:
        shape = list(part.full_shape)
        shape[part.shard_dim] //= self.world
        return tuple(shape)

    @property
    def numel(self) -> int:
        return sum(self.local_shape(p)[0] * self.local_shape(p)[1] for p in self.parts)

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the parts, in order, from one rank's flat buffer."""
        shapes = [self.local_shape(p) for p in self.parts]
        pieces = flat.split([r * c for r, c in shapes])
        return [piece.view(shape) for piece, shape in zip(pieces, shapes)]

    def pack(self, full: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
        """Rank's flat buffer cut from the full weights."""
        return torch.cat([full[p.name].chunk(self.world, p.shard_dim)[rank].reshape(-1) for p in self.parts])

    def unpack_gathered(self, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every rank's buffer [D, numel] -> the full weights by reference name."""
        per_rank = [self.unpack(buf) for buf in gathered]
        return {p.name: torch.cat([parts[i] for parts in per_rank], dim=p.shard_dim)
                for i, p in enumerate(self.parts)}


def check_splittable(cfg, world: int, scheme: str, symbol: str) -> None:
    """Raise ValueError (before any communication) unless heads, KV heads and the FFN split over ``world``."""
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) % world:
            raise ValueError(f"{scheme} over {symbol}={world} ranks needs {name}={getattr(cfg, name)} divisible by "
                             f"{world}; choose a {scheme} degree that divides it")


def vocab_shard(weight: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's rows of a [V, h] vocabulary weight, V padded with zero rows to a multiple of ``world``."""
    padded = -(-weight.shape[0] // world) * world
    return torch.nn.functional.pad(weight, (0, 0, 0, padded - weight.shape[0])).chunk(world)[rank].clone()


def real_vocab_rows(local: torch.Tensor, vocab_size: int, rank: int) -> torch.Tensor:
    """The non-padding rows of a vocabulary shard (a view); the split is torch.chunk's split of V."""
    rows = local.shape[0]
    return local[: max(0, min(rows, vocab_size - rank * rows))]


def vocab_slice_index(ids: torch.Tensor, rows: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each id inside vocabulary shard ``shard`` of ``rows`` rows, clamped into range; whether it is there).

    Ids outside the shard (and ignored labels, -100) get ``hit`` False and a valid row 0..rows-1, so callers
    gather/scatter with ``where``/``index_select``/``scatter_add`` on fixed shapes: no boolean-mask indexing,
    no ``nonzero``, hence no host-device synchronisation.
    """
    local = ids - shard * rows
    hit = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), hit
