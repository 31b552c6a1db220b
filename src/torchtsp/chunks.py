"""The zigzag layout's arithmetic, without torch (the planner and the traffic model import it): which global
chunks a rank holds and, for a sliding layer, which keys each query chunk reads from which rank. The tensors
cut this way live in ``distributed.zigzag``; the exchange that moves a window's keys in ``distributed.window``.
"""

from __future__ import annotations

from typing import NamedTuple


def check_divisible(seq_len: int, world: int) -> None:
    if seq_len % (2 * world):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2*D = {2 * world} for zigzag sharding over "
            f"D={world} ranks; pick a length that is a multiple of {2 * world}"
        )


def chunk_ids(rank: int, world: int) -> tuple[int, int]:
    """The two global chunk indices rank ``rank`` holds, in local order."""
    return rank, 2 * world - 1 - rank


# ---------------------------------------------------------------- a sliding layer's keys: who needs what


class KeyPiece(NamedTuple):
    """A run of keys one query chunk reads, held by one rank: the last ``length`` tokens of rank ``owner``'s
    local chunk ``half`` (0: its global chunk ``owner``, 1: its chunk 2D-1-``owner``)."""

    owner: int
    half: int
    length: int


def window_keys(seq_len: int, world: int, rank: int, window: int) -> tuple[tuple[KeyPiece, ...], ...]:
    """THE rule of a sliding layer's K/V exchange: per local query chunk of ``rank`` (global chunks rank and
    2D-1-rank, S/2D tokens each), the keys its queries read when query i sees keys i - window < j <= i: global
    tokens [max(0, start - window + 1), end), the chunk itself and the window-1 tokens before it. They come as
    pieces in global order, one per chunk they touch: a suffix of each earlier chunk (a window reaches back
    from the chunk's first query, so it cuts an earlier chunk from the left), then the query chunk whole.

    Documents are not consulted: which keys move depends on (S, D, window, rank) alone, so traffic is known
    before the data (the mask still skips keys of other documents in the compute)."""
    check_divisible(seq_len, world)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"a sliding window must be a positive number of tokens, got {window!r}")
    chunk = seq_len // (2 * world)
    out = []
    for c in chunk_ids(rank, world):
        lo = max(0, c * chunk - window + 1)  # the earliest key the chunk's first query sees
        pieces = []
        for k in range(lo // chunk, c + 1):
            owner, half = (k, 0) if k < world else (2 * world - 1 - k, 1)
            pieces.append(KeyPiece(owner, half, (k + 1) * chunk - max(lo, k * chunk)))
        out.append(tuple(pieces))
    return tuple(out)


def window_needs(seq_len: int, world: int, rank: int, window: int) -> tuple[tuple[int, int], ...]:
    """Per rank r: (n0, n1), the number of last tokens of r's local chunks 0 and 1 whose K/V ``rank`` must
    receive from r for its two query chunks (``window_keys``; (0, 0) for ``rank`` itself, which holds them).
    Both query chunks may read one chunk's suffix: they get it once, the longer of the two."""
    need = [[0, 0] for _ in range(world)]
    for pieces in window_keys(seq_len, world, rank, window):
        for piece in pieces:
            if piece.owner != rank:
                need[piece.owner][piece.half] = max(need[piece.owner][piece.half], piece.length)
    return tuple((n0, n1) for n0, n1 in need)


def window_traffic(seq_len: int, world: int, rank: int, window: int) -> tuple[int, int]:
    """(received, sent): tokens of K/V ``rank`` receives from and sends to other ranks in a sliding layer's
    exchange. The dK/dV going back are the same tokens the other way: it then receives ``sent`` tokens."""
    received = sum(map(sum, window_needs(seq_len, world, rank, window)))
    sent = sum(sum(window_needs(seq_len, world, peer, window)[rank]) for peer in range(world) if peer != rank)
    return received, sent
