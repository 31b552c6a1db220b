"""What a query may see: one ``Mask`` (causal order, packed documents, a sliding layer's window, or a KV cache's
positions) and the ``Block``s of attention it keeps. Every kernel, scheme and cache reads it; none builds a mask
of its own. ``torchtsp.layers`` re-exports all of it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Documents:
    """Packed rows: each row [0, S) is cut into documents (contiguous runs of equal ``document_ids``).

    A token attends only to the earlier tokens of its own document, and its RoPE position counts from 0 at the
    document's first token. ``runs`` holds each row's documents as (start, end) host ints, so kernels pick the
    blocks the mask keeps without reading the device; ``positions`` [B, S] holds every token's position in its
    document and ``lengths`` [B, S] its document's length (what a context-dependent RoPE type reads), on the ids'
    device.
    """

    runs: tuple[tuple[tuple[int, int], ...], ...]
    positions: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor, shape: tuple[int, int] | None = None) -> Documents:
        """From ``document_ids`` [B, S] (integers; a new run of equal ids starts a new document). Reads the ids
        on the host once: give the host batch to avoid a device synchronisation."""
        if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2:
            raise ValueError("document_ids must be a [batch, seq] integer tensor")
        if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
            raise ValueError(f"document_ids must hold integers, got {document_ids.dtype}")
        if shape is not None and tuple(document_ids.shape) != tuple(shape):
            raise ValueError(f"document_ids shape {tuple(document_ids.shape)} must equal tokens shape {tuple(shape)}")
        ids = document_ids.detach().cpu()
        B, S = ids.shape
        starts = torch.ones(B, S, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        index = torch.arange(S).expand(B, S)
        first = torch.where(starts, index, 0).cummax(dim=1).values  # each token's document start
        runs = []
        lengths = torch.empty(B, S, dtype=torch.long)
        for b, row in enumerate(starts.tolist()):
            begin = [i for i, new in enumerate(row) if new]
            runs.append(tuple(zip(begin, begin[1:] + [S])))
            for start, end in runs[-1]:
                lengths[b, start:end] = end - start
        return cls(tuple(runs), (index - first).to(document_ids.device), lengths.to(document_ids.device))

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> Documents:
        """Back from ``positions`` (a document starts where its position is 0)."""
        return cls.from_ids((positions == 0).cumsum(dim=1))

    def rows(self, start: int, stop: int) -> Documents:
        """The documents of batch rows [start, stop) (a data-parallel replica's or a micro-batch's rows)."""
        return Documents(self.runs[start:stop], self.positions[start:stop], self.lengths[start:stop])

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions within their documents [B, L] of the tokens at global indices ``positions`` [L], on the
        device of ``positions`` (the ids may stay on the host, where they were read)."""
        return self.positions.to(positions.device)[:, positions]

    def lengths_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The lengths of the documents [B, L] of the tokens at global indices ``positions`` [L] (as ``at``)."""
        return self.lengths.to(positions.device)[:, positions]

    def mask(self, q_start: int = 0, k_start: int = 0, window: int | None = None) -> Mask:
        """The mask of queries whose first is global token ``q_start`` against keys from global ``k_start``."""
        return Mask(documents=self, q_start=q_start, k_start=k_start, window=window)

    def blocks(self, q_start: int, q_len: int, k_start: int, k_len: int, window: int | None = None):
        """What attention computes for queries [q_start, +q_len) against keys [k_start, +k_len), per row: the
        ``Block``s of each document that has both queries and keys here (``visible_blocks``); nothing outside a
        document (or outside the window) is ever computed."""
        return [visible_blocks(runs, q_start, q_len, k_start, k_len, window) for runs in self.runs]


class Block(NamedTuple):
    """One kernel call of attention: local query rows ``q`` against local key rows ``k``, where the query at
    local row i sees the key at local row j iff ``lo <= j - i <= hi`` (None: no bound). ``kind`` says how the
    kernel runs it: "full" (every pair visible), "causal" (square, j <= i: the fused kernel's own causal mask),
    "anticausal" (j >= i, at least as many queries as keys: a window's far edge, the fused kernel's causal mask
    on both row orders reversed; queries past the last key see none) or "masked" (any other band: an explicit
    mask, block-sized)."""

    q: slice
    k: slice
    lo: int | None
    hi: int | None

    @property
    def kind(self) -> str:
        nq, nk = self.q.stop - self.q.start, self.k.stop - self.k.start
        lo_free = self.lo is None or self.lo <= -(nq - 1)
        hi_free = self.hi is None or self.hi >= nk - 1
        if lo_free and hi_free:
            return "full"
        if lo_free and self.hi == 0 and nq == nk:
            return "causal"
        if self.lo == 0 and hi_free and nq >= nk:
            return "anticausal"
        return "masked"


# Query rows per tile of a windowed run. A tile's keys split where its first query is: the keys before it (a
# triangle at the window's far edge, "anticausal": the fused kernel on reversed rows) and its own diagonal
# block (causal when the tile is no longer than the window), so no tile needs an explicit mask unless a document
# starts inside the window; tiles of at least this size keep the number of kernel calls down for small windows.
WINDOW_TILE = 128


def visible_blocks(runs, q_start: int, q_len: int, k_start: int, k_len: int, window: int | None):
    """The ``Block``s of queries at global indices [q_start, +q_len) against keys at [k_start, +k_len) when
    the query at global index i sees the keys j of its own run (a document: ``runs`` holds (start, end) pairs)
    with i - window < j <= i (window None: j <= i). Blocks that no query sees are absent: not computed."""
    q_end, k_end = q_start + q_len, k_start + k_len
    out = []
    for u, v in runs:
        a, b = max(u, q_start), min(v, q_end)
        tile = (b - a) if window is None else max(window, WINDOW_TILE)
        for ta in range(a, b, max(tile, 1)):
            tb = min(ta + tile, b)
            ka = max(u, k_start) if window is None else max(u, k_start, ta - window + 1)
            kb = min(v, k_end, tb)  # keys after the last query are never seen
            for pa, pb in ((ka, min(kb, ta)), (max(ka, ta), kb)):  # before the tile's first query, from it on
                if pa < pb:
                    # Global j - i bounds, -(window - 1) <= j - i <= 0, in this block's local rows.
                    shift = ta - pa
                    lo = None if window is None else shift - (window - 1)
                    out.append(Block(slice(ta - q_start, tb - q_start), slice(pa - k_start, pb - k_start), lo, shift))
    return out


def as_documents(document_ids, shape: tuple[int, int]) -> Documents | None:
    """``document_ids`` as the API takes them ([B, S] ids, already built ``Documents``, or None: plain causal)."""
    if document_ids is None or isinstance(document_ids, Documents):
        if document_ids is not None and (len(document_ids.runs), document_ids.positions.shape[1]) != tuple(shape):
            raise ValueError(f"documents of a {tuple(document_ids.positions.shape)} batch given for tokens "
                             f"of shape {tuple(shape)}")
        return document_ids
    return Documents.from_ids(document_ids, shape)


def rope_length(seq_len: int, documents: Documents | None, positions: torch.Tensor):
    """The sequence length a context-dependent RoPE type (dynamic NTK, LongRoPE) reads for the tokens at global
    indices ``positions`` [L]: the whole sequence's (every rank of a sequence axis passes the global length, never
    its chunk), or in packed rows each token's document's, [B, L]: a document reads its own length, as it would
    alone, never its batch mates' (transformers' forward of packed rows reads the longest document of the batch,
    which a data-parallel replica, a micro-batch or a pipeline's microbatch would each see differently)."""
    return seq_len if documents is None else documents.lengths_at(positions)


def rope_positions(positions: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    """The RoPE positions of the tokens at global indices ``positions`` [L]: themselves ([L], every row alike)
    or, in packed rows, their positions within their documents ([B, L])."""
    return positions if documents is None else documents.at(positions)


@dataclass(frozen=True)
class Mask:
    """What a query may see: the one object every kernel, scheme and cache reads (no one builds a mask of its own).

    * ``causal`` (query i sees keys j <= i of one sequence laid out in order), or everything (``causal=False``);
    * with ``q_pos`` [B, Lq], ``k_pos`` [B, Lk] and ``k_valid`` [B, Lk], a query sees the valid keys at positions
      <= its own (a KV cache: slots in any order, padding);
    * with ``documents``, the query at global index i sees keys j of its own document with j <= i;
    * with ``window`` W (a sliding layer), a query at position i sees only keys j > i - W, on top of the above.

    Queries and keys given to ``attend`` are the global tokens from ``q_start`` and ``k_start`` on (a part of a
    sequence-sharded attention; positions are global token indices, so the window is the same on every scheme).
    """

    causal: bool = True
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    k_valid: torch.Tensor | None = None
    documents: Documents | None = None
    q_start: int = 0
    k_start: int = 0
    window: int | None = None

    @property
    def positional(self) -> bool:
        return self.k_pos is not None

    @property
    def blockwise(self) -> bool:
        """Whether ``attend`` runs this mask block by block (documents or a window), not as one fused call."""
        return self.documents is not None or self.window is not None

    def windowed(self, window: int | None) -> Mask:
        """This mask for a layer whose window is ``window`` (None: a full layer, the mask as it is)."""
        if window is None or window == self.window:
            return self
        if not self.causal:
            raise ValueError("a sliding window needs a causal mask")
        return replace(self, window=window)

    def part(self, q_start: int, k_start: int) -> Mask:
        """This mask for queries from global token ``q_start`` against keys from global token ``k_start``."""
        return replace(self, q_start=q_start, k_start=k_start)

    def blocks(self, q_len: int, k_len: int):
        """The ``Block``s ``attend`` computes for q_len queries and k_len keys: a list per batch row with
        documents, else one list for every row (``[None, blocks]``: rows alike)."""
        if self.documents is not None:
            return self.documents.blocks(self.q_start, q_len, self.k_start, k_len, self.window)
        big = self.q_start + q_len + self.k_start + k_len  # one run holding every token
        return [None, visible_blocks(((0, big),), self.q_start, q_len, self.k_start, k_len, self.window)]

    def sees_any(self, q_len: int, k_len: int) -> bool:
        """Whether any query of this part sees any key (else the part is skipped: neither computed nor merged)."""
        rows = self.blocks(q_len, k_len)
        return any(rows[1] if rows and rows[0] is None else rows)


CAUSAL, FULL = Mask(causal=True), Mask(causal=False)


def sequence_mask(documents: Documents | None = None, window: int | None = None) -> Mask:
    """The mask of a whole sequence's queries against its keys, from global token 0: causal, within the
    packed rows' ``documents`` if any, within ``window`` (a sliding layer's) if any."""
    return (CAUSAL if documents is None else documents.mask()).windowed(window)


def positions_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int | None = None) -> Mask:
    """The mask of queries at positions ``q_pos`` against cached keys at ``k_pos`` (valid where ``k_valid``)."""
    return Mask(causal=True, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, window=window)
