"""A sliding layer's K/V exchange on the zigzag layout: each rank receives only the keys its queries read.

Query chunk c (S/2D tokens) of a sliding layer with window W reads its own keys and the W-1 before it
(``chunks.window_keys``, the one rule): a suffix of chunk c-1, and of chunks further back when W > S/2D. So
instead of all-gathering every rank's K/V, each rank sends every other rank the last tokens of its two chunks
that rank reads (``chunks.window_needs``: both sides derive the same lists, nothing about them travels), point
to point in one batch, and backward sends their dK/dV back the same way, summed at the owners.

The maths is pure functions of one rank's tensors (``window_sends``, ``WindowKV``, ``window_attention_forward`` /
``_backward``, ``add_returned``); ``exchange_window_kv`` and ``return_window_grad`` only move what they return,
so a single process can check the whole exchange by handing the tensors over itself (tests/test_window.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import chunks
from ..layers import Mask, attend, attend_backward

# AxisComm.exchange channels: the K/V and their gradients may be in flight at once between the same peers
# (TSP's backward gathers group j+2 while group j's gradients go back), each pairs up in its own channel.
KV_CHANNEL, GRAD_CHANNEL = 0, 1


def _tails(kv: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
    """The last n0 tokens of local chunk 0 and the last n1 of chunk 1 of ``kv`` [2, B, S/D, H, d], one
    contiguous [2, B, n0 + n1, H, d] tensor (what one peer receives)."""
    chunk = kv.shape[2] // 2
    return torch.cat([kv[:, :, chunk - n0:chunk], kv[:, :, 2 * chunk - n1:]], dim=2)


def _sent(seq_len: int, world: int, rank: int, window: int) -> list[tuple[int, int]]:
    """Per peer, (n0, n1) of ``rank``'s chunks that the peer's queries read ((0, 0) for ``rank`` itself)."""
    return [chunks.window_needs(seq_len, world, peer, window)[rank] if peer != rank else (0, 0)
            for peer in range(world)]


def window_sends(kv: torch.Tensor, rank: int, world: int, window: int) -> list[torch.Tensor | None]:
    """What ``rank`` sends each rank from its local K/V ``kv`` [2, B, S/D, H, d] in a sliding layer's exchange:
    per peer the suffixes of its two chunks that peer's queries read (``chunks.window_needs`` of the peer), None
    where it reads nothing (and for ``rank`` itself)."""
    return [_tails(kv, n0, n1) if n0 + n1 else None for n0, n1 in _sent(kv.shape[2] * world, world, rank, window)]


@dataclass
class WindowKV:
    """A sliding layer's keys and values as a rank holds them after the exchange: its own ``local`` K/V
    [2, B, S/D, H, d] and, per rank, what that rank sent (``window_sends``; None: nothing, and for itself)."""

    local: torch.Tensor
    received: list[torch.Tensor | None]
    rank: int
    window: int

    @property
    def world(self) -> int:
        return len(self.received)

    @property
    def chunk(self) -> int:
        return self.local.shape[2] // 2

    def _runs(self, c: int):
        """(owner, first row, end row) per piece of the keys of local query chunk ``c``, in global order: rows of
        ``local`` (owner: this rank) or of what ``owner`` sent (its chunk-0 suffix, then its chunk-1 suffix)."""
        seq_len, C = self.local.shape[2] * self.world, self.chunk
        needs = chunks.window_needs(seq_len, self.world, self.rank, self.window)
        for piece in chunks.window_keys(seq_len, self.world, self.rank, self.window)[c]:
            if piece.owner == self.rank:
                end = (piece.half + 1) * C
            else:
                n0, n1 = needs[piece.owner]
                end = n0 if piece.half == 0 else n0 + n1  # a piece is a suffix of its chunk's suffix
            yield piece.owner, end - piece.length, end

    def keys(self, c: int) -> torch.Tensor:
        """K/V [2, B, L, H, d] of every key local query chunk ``c`` reads, in global order (one contiguous copy
        of the window's tokens and the chunk's own)."""
        own = lambda owner: self.local if owner == self.rank else self.received[owner]
        return torch.cat([own(owner)[:, :, a:b] for owner, a, b in self._runs(c)], dim=2)

    def add_grad(self, c: int, dkeys: torch.Tensor, local: torch.Tensor, back: list) -> None:
        """Add dK/dV ``dkeys`` of the keys of chunk ``c`` (laid out as ``keys(c)``) to ``local`` (own tokens) and
        to ``back`` (per rank, laid out as what it sent): the adjoint of ``keys``."""
        at = 0
        for owner, a, b in self._runs(c):
            (local if owner == self.rank else back[owner])[:, :, a:b] += dkeys[:, :, at:at + b - a]
            at += b - a

    def saved(self) -> tuple[list[torch.Tensor], tuple]:
        """(tensors, layout): what an autograd Function saves for backward (the tensors through
        ``save_for_backward``, the layout, which holds none, on its ctx); ``restore`` undoes it."""
        return [self.local, *(t for t in self.received if t is not None)], \
            (self.rank, self.window, [t is not None for t in self.received])

    @staticmethod
    def restore(tensors, layout) -> WindowKV:
        rank, window, present = layout
        it = iter(tensors[1:])
        return WindowKV(tensors[0], [next(it) if p else None for p in present], rank, window)


@dataclass
class WindowGrad:
    """dK/dV (float32) of a sliding layer's keys from this rank's queries: of its own tokens (``local``) and of
    what each rank sent it (``back``, per rank: returned to it by ``return_window_grad``)."""

    local: torch.Tensor
    back: list[torch.Tensor | None]
    window: int


def _check(kv: WindowKV, mask: Mask) -> None:
    if mask.window != kv.window:
        raise ValueError(f"K/V exchanged for a window of {kv.window} tokens, attended with a mask of window "
                         f"{mask.window}")


def window_attention_forward(q, kv: WindowKV, mask: Mask):
    """(out, lse float32) of local zigzag queries q [B, Hq, S/D, d] (any strides) against the keys they read
    under ``mask`` (the whole sequence's, with the layer's window): per query chunk, one blockwise attention
    of the chunk against its window's keys in global order."""
    _check(kv, mask)
    C, world = kv.chunk, kv.world
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for c, chunk in enumerate(chunks.chunk_ids(kv.rank, world)):
        keys = kv.keys(c)
        rows = slice(c * C, (c + 1) * C)
        part = mask.part(chunk * C, (chunk + 1) * C - keys.shape[2])  # the keys end with the chunk itself
        out[..., rows, :], lse[..., rows] = attend(q[..., rows, :], *keys.transpose(2, 3).unbind(0), part)
    return out, lse


def window_attention_backward(dout, q, kv: WindowKV, out, lse, mask: Mask):
    """(dq, ``WindowGrad``) of ``window_attention_forward`` from its output and LSE."""
    _check(kv, mask)
    C, world = kv.chunk, kv.world
    dq = torch.empty_like(q)
    f32 = dict(dtype=torch.float32, device=q.device)
    local = torch.zeros(kv.local.shape, **f32)
    back = [None if t is None else torch.zeros(t.shape, **f32) for t in kv.received]
    for c, chunk in enumerate(chunks.chunk_ids(kv.rank, world)):
        keys = kv.keys(c)
        rows = slice(c * C, (c + 1) * C)
        part = mask.part(chunk * C, (chunk + 1) * C - keys.shape[2])
        dkeys = torch.empty(keys.shape, **f32)
        dq[..., rows, :] = attend_backward(dout[..., rows, :], q[..., rows, :], *keys.transpose(2, 3).unbind(0),
                                           out[..., rows, :], lse[..., rows], part,
                                           *dkeys.transpose(2, 3).unbind(0), accumulate=False)
        kv.add_grad(c, dkeys, local, back)
    return dq, WindowGrad(local, back, kv.window)


def add_returned(local: torch.Tensor, returned: list[torch.Tensor | None], rank: int, window: int) -> torch.Tensor:
    """``local`` dK/dV [2, B, S/D, H, d] plus what every rank returned (``returned[r]``: the gradient of what this
    rank sent r, laid out as ``window_sends``), added in place at the tokens they belong to."""
    world, C = len(returned), local.shape[2] // 2
    for peer, grad in enumerate(returned):
        if grad is not None:
            n0, n1 = chunks.window_needs(local.shape[2] * world, world, peer, window)[rank]
            local[:, :, C - n0:C] += grad[:, :, :n0]
            local[:, :, 2 * C - n1:] += grad[:, :, n0:]
    return local


# ---------------------------------------------------------------- the moves (AxisComm.exchange)


def exchange_window_kv(comm, kv: torch.Tensor, window: int, label=None):
    """Start the exchange of a sliding layer's K/V ``kv`` [2, B, S/D, H, d] over ``comm``; returns a function
    that waits and returns the ``WindowKV``."""
    rank, world = comm.rank, comm.size
    seq_len = kv.shape[2] * world
    sends = [(t, peer) for peer, t in enumerate(window_sends(kv, rank, world, window)) if t is not None]
    needs = chunks.window_needs(seq_len, world, rank, window)
    received = [kv.new_empty(kv.shape[0], kv.shape[1], n0 + n1, *kv.shape[3:]) if n0 + n1 else None
                for n0, n1 in needs]
    recvs = [(t, peer) for peer, t in enumerate(received) if t is not None]
    pending = comm.exchange(sends, recvs, async_op=True, label=label, channel=KV_CHANNEL,
                            finish=lambda _: WindowKV(kv, received, rank, window))
    return pending.wait


def return_window_grad(comm, grad: WindowGrad, async_op: bool = False, label=None):
    """Send every rank the dK/dV of what it sent this one and sum what comes back into this rank's own tokens:
    the [2, B, S/D, H, d] float32 gradient of its K/V from every rank's queries (a ``Pending`` with
    ``async_op``)."""
    rank, world, local = comm.rank, comm.size, grad.local
    sends = [(t, peer) for peer, t in enumerate(grad.back) if t is not None]
    # What comes back from a peer is shaped like what this rank sent it.
    returned = [local.new_empty(local.shape[0], local.shape[1], n0 + n1, *local.shape[3:]) if n0 + n1 else None
                for n0, n1 in _sent(local.shape[2] * world, world, rank, grad.window)]
    recvs = [(t, peer) for peer, t in enumerate(returned) if t is not None]
    pending = comm.exchange(sends, recvs, async_op=True, label=label, channel=GRAD_CHANNEL,
                            finish=lambda _: add_returned(local, returned, rank, grad.window))
    return pending if async_op else pending.wait()
