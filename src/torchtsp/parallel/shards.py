"""Packed weight shards: several weight slices of one rank in ONE flat buffer.

A packed buffer moves with a single collective, and every rank's buffer has the same
size, so buffers can be broadcast or passed around a ring and unpacked by any rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    name: str  # reference parameter name
    full_shape: tuple[int, ...]  # a matrix (out, in) or a bias (out,)
    shard_dim: int  # the dimension cut into equal slices, one per rank (or per group of ranks, see chunks)
    # Distinct slices along shard_dim (None: one per rank). Fewer than the ranks replicates each slice over
    # world/chunks consecutive ranks: KV heads when n_kv < D, so rank p holds slice p // (world/chunks).
    chunks: int | None = None


@dataclass(frozen=True)
class PackedLayout:
    parts: tuple[Part, ...]
    world: int

    def chunks(self, part: Part) -> int:
        return part.chunks or self.world

    def replicas(self, part: Part) -> int:
        """Consecutive ranks that hold the same slice of ``part`` (1: every rank holds its own)."""
        return self.world // self.chunks(part)

    def local_shape(self, part: Part) -> tuple[int, ...]:
        shape = list(part.full_shape)
        shape[part.shard_dim] //= self.chunks(part)
        return tuple(shape)

    @property
    def numel(self) -> int:
        return sum(math.prod(self.local_shape(p)) for p in self.parts)

    def offset(self, name: str) -> int:
        """Where part ``name`` starts in a flat buffer."""
        start = 0
        for p in self.parts:
            if p.name == name:
                return start
            start += math.prod(self.local_shape(p))
        raise KeyError(name)

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the parts, in order, from one rank's flat buffer."""
        shapes = [self.local_shape(p) for p in self.parts]
        pieces = flat.split([math.prod(shape) for shape in shapes])
        return [piece.view(shape) for piece, shape in zip(pieces, shapes)]

    def named(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``unpack`` by reference name."""
        return {p.name: view for p, view in zip(self.parts, self.unpack(flat))}

    def pack(self, weights, prefix: str, rank: int) -> torch.Tensor:
        """Rank's flat buffer, its parts read one at a time from ``weights`` (a ``WeightSource``) under
        ``prefix`` (e.g. ``layers.3.``): only this rank's slices and the buffer are ever alive."""
        flat, offset = None, 0
        for p in self.parts:
            piece = weights.get(prefix + p.name, p.shard_dim, self.chunks(p), rank // self.replicas(p))
            if flat is None:
                flat = torch.empty(self.numel, dtype=piece.dtype, device=piece.device)
            flat[offset:offset + piece.numel()].copy_(piece.reshape(-1))
            offset += piece.numel()
        return flat

    def unpack_gathered(self, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every rank's buffer [D, numel] -> the full weights by reference name (a replicated slice once)."""
        per_rank = [self.unpack(buf) for buf in gathered]
        return {p.name: torch.cat([parts[i] for parts in per_rank[::self.replicas(p)]], dim=p.shard_dim)
                for i, p in enumerate(self.parts)}


def vocab_shard(weights, name: str, world: int, rank: int) -> torch.Tensor:
    """Rank's rows of the [V, h] vocabulary weight ``name`` from ``weights`` (a ``WeightSource``), V padded
    with zero rows to a multiple of ``world`` (torch.chunk's split, so the real rows are those of chunk rank)."""
    rows = -(-weights.shapes[name][0] // world)
    piece = weights.get(name, 0, world, rank)
    return torch.nn.functional.pad(piece, (0, 0, 0, rows - piece.shape[0]))


def real_vocab_rows(local: torch.Tensor, vocab_size: int, rank: int) -> torch.Tensor:
    """The non-padding rows of a vocabulary shard (a view); the split is torch.chunk's split of V."""
    rows = local.shape[0]
    return local[: max(0, min(rows, vocab_size - rank * rows))]


def mask_vocab_padding_(logits: torch.Tensor, real_rows: int) -> torch.Tensor:
    """``logits`` [..., rows] against a vocabulary slice whose first ``real_rows`` rows are real ids (fewer, or
    none, in the last slices of a padded vocabulary): the padding columns set to -inf in place, so no softmax,
    sample or log-probability ever sees them. Returns ``logits``."""
    if real_rows < logits.shape[-1]:
        logits[..., max(real_rows, 0):] = float("-inf")
    return logits


def vocab_slice_index(ids: torch.Tensor, rows: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each id inside vocabulary shard ``shard`` of ``rows`` rows, clamped into range; whether it is there).

    Ids outside the shard (and ignored labels, -100) get ``hit`` False and a valid row 0..rows-1, so callers
    gather/scatter with ``where``/``index_select``/``scatter_add`` on fixed shapes: no boolean-mask indexing,
    no ``nonzero``, hence no host-device synchronisation.
    """
    local = ids - shard * rows
    hit = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), hit
