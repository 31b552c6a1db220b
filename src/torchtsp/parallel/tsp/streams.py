"""How TSP's weight shards and travelling gradients move: broadcast streams, rings, cross-layer prefetch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...distributed.comm import AxisComm

WEIGHT_TAG, GRAD_TAG = 0, 1  # distinct point-to-point tags for weights and travelling gradients
ACC = torch.float32  # partial sums of every dtype accumulate in float32


# ---------------------------------------------------------------- weight streams


def issue_broadcast(comm: AxisComm, own: torch.Tensor, src: int, label, buffer: torch.Tensor | None = None):
    """Start the broadcast of rank ``src``'s shard (``own`` there, ``buffer`` or a new buffer elsewhere)."""
    buf = own if src == comm.rank else (torch.empty_like(own) if buffer is None else buffer)
    return comm.broadcast(buf, src=src, async_op=True, label=label)


class BroadcastStream:
    """Every rank's shard in turn (j = 0..D-1), ``depth`` of them requested ahead of use.

    Shards 0..depth-1 are requested at once; shard j+depth's broadcast is issued when shard j is released,
    into the buffer shard j used. ``first``: shard 0's broadcast, already issued (cross-layer prefetch).
    """

    def __init__(self, comm: AxisComm, own: torch.Tensor, label: str, first=None, depth: int = 2):
        self.comm, self.own, self.label, self.depth = comm, own, label, depth
        self.pending = {0: first if first is not None else issue_broadcast(comm, own, 0, (label, 0))}
        for j in range(1, min(depth, comm.size)):
            self.pending[j] = issue_broadcast(comm, own, j, (label, j))

    def get(self, j: int) -> torch.Tensor:
        return self.pending[j].wait()

    def release(self, j: int) -> None:
        """Shard j is no longer used: its buffer receives shard j+depth."""
        buffer = self.pending.pop(j).wait()
        following = j + self.depth
        if following < self.comm.size:
            spare = buffer if j != self.comm.rank else None  # rank j's own shard is its parameter
            self.pending[following] = issue_broadcast(self.comm, self.own, following, (self.label, following),
                                                      spare)


def broadcast_each(comm: AxisComm, own: torch.Tensor, label: str, first=None):
    """Yield (j, rank j's shard) for j = 0..D-1; shard j+1's broadcast is in flight while j is used
    (``BroadcastStream`` in order; at most two received buffers)."""
    stream = BroadcastStream(comm, own, label, first)
    for j in range(comm.size):
        yield j, stream.get(j)
        stream.release(j)


def ring_each(comm: AxisComm, own: torch.Tensor, label: str):
    """Yield (s, shard s) around the ring: at step k rank p holds s = (p - k) mod D.

    The send to p+1 / receive from p-1 of the next step is in flight while the current shard is used.
    """
    buffers = [torch.empty_like(own) for _ in range(min(comm.size - 1, 2))]
    shard, owner = own, comm.rank
    for k in range(comm.size):
        pending = None
        if k + 1 < comm.size:
            pending = comm.ring_shift(shard, buffers[k % 2], async_op=True, tag=WEIGHT_TAG,
                                      label=(label, (owner - 1) % comm.size))
        yield owner, shard
        if pending is not None:
            shard, owner = pending.wait(), (owner - 1) % comm.size


class GradientRing:
    """The gradient accumulator of the shard passing by travels with it around the ring (in float32).

    Call ``add`` once per ring step with this rank's contribution to the current shard; after the
    last step ``result(dtype)`` is this rank's own shard's gradient, summed over every rank.
    """

    def __init__(self, comm: AxisComm, label: str):
        self.comm, self.label, self.pending, self.step = comm, label, None, 0

    def add(self, contribution: torch.Tensor) -> None:
        if self.pending is None:
            acc = contribution.to(ACC)
        else:
            acc = self.pending.wait().add_(contribution)
        home = acc if self.comm.size == 1 else None  # a ring of one rank: the accumulator is home, no copy
        self.pending = self.comm.ring_shift(acc, home, async_op=True, tag=GRAD_TAG, label=(self.label, self.step))
        self.step += 1

    def result(self, dtype) -> torch.Tensor:
        return self.pending.wait().to(dtype)


@dataclass(frozen=True)
class Prefetch:
    """A broadcast of shard 0 of layer ``layer``'s attention for its ``phase`` ("attention.forward" or
    "attention.backward"), to be started with ``issue()`` while the block before it finishes."""

    prefetcher: ShardPrefetch
    phase: str
    layer: int
    shard: torch.Tensor

    def issue(self) -> None:
        self.prefetcher.start(self)


class ShardPrefetch:
    """The cross-layer prefetches of one forward and backward pass: each is issued by the block before the
    attention that takes it (``take(phase, layer)``); every rank issues and takes them in the same order.

    ``rerunning`` is set while ``checkpoint`` runs a layer's forward again inside backward (recompute), where a
    forward prefetch would fetch a shard that nobody takes.
    """

    def __init__(self, comm: AxisComm):
        self.comm, self.pending, self.rerunning = comm, {}, False

    def request(self, phase: str, layer: int, shard: torch.Tensor) -> Prefetch:
        return Prefetch(self, phase, layer, shard.detach())

    def start(self, request: Prefetch) -> None:
        self.pending[(request.phase, request.layer)] = issue_broadcast(self.comm, request.shard, 0, (request.phase, 0))

    def take(self, phase: str, layer: int):
        return self.pending.pop((phase, layer), None)

    @contextlib.contextmanager
    def rerun(self):
        self.rerunning = True
        try:
            yield
        finally:
            self.rerunning = False


def add_mm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b in float32 (``acc`` None: the first term, no zero-filled start): in place, in one GEMM
    when the dtypes agree, else the product is added in acc's precision."""
    if acc is None:
        return (a @ b).to(ACC)
    return acc.addmm_(a, b) if acc.dtype == a.dtype else acc.add_(a @ b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, written straight into ``out`` when the dtypes agree (else computed, then cast in)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)
