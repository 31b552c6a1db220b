"""``AxisComm``: the operations over one mesh axis (broadcast, all-gather, reduce-scatter, reduce, all-reduce,
ring shifts, all-to-all), each with a timeout, counted (``accounting``), and on gloo run as point-to-point
transfers where that is cheaper. ``Pending`` is an issued transfer."""

from __future__ import annotations

import contextlib
import datetime
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .accounting import CommStats, Transfer
from .groups import DEFAULT_TIMEOUT_S, block_group, moves_point_to_point, sibling_group, world_size


def _cut(t: torch.Tensor, prefix: tuple[int, int] | None) -> torch.Tensor:
    """The first ``prefix`` = (dim, length) entries of ``t`` along dim (all of ``t`` for None)."""
    return t if prefix is None else t.narrow(prefix[0], 0, prefix[1])


class Pending:
    """An issued transfer; ``wait()`` blocks (with the axis timeout) and returns its result tensor."""

    def __init__(self, comm: AxisComm, works, result, op: str, label, records=(), finish=None, on_cpu=None):
        self._comm, self._works, self._result, self._op, self._label = comm, works, result, op, label
        self._records = records  # (stats, Transfer) of every counting() block open at issue time
        self._then = finish  # local work on the received tensor once it has arrived (None: none)
        if on_cpu is None:  # where the result lives (a list's first tensor), unless the caller says
            on_cpu = (result if isinstance(result, torch.Tensor) else result[0]).device.type == "cpu"
        self._on_cpu = on_cpu
        self._done = False

    def wait(self) -> torch.Tensor | list[torch.Tensor]:
        if not self._done:
            start = time.perf_counter()
            for work in self._works:
                if not self._on_cpu:
                    # NCCL: a wait with a timeout would block the host until the kernel ends; a plain wait
                    # only orders the streams, and NCCL's watchdog enforces the group's timeout.
                    work.wait()
                elif not work.wait(self._comm.timeout):
                    raise TimeoutError(f"{self._op} ({self._label}) on axis {self._comm.name!r} timed out")
            blocked = time.perf_counter() - start
            for stats, transfer in self._records:
                stats.wait_s += blocked
                transfer.waited = len(stats.events)
            self._comm._record("wait", self._op, self._label)
            self._done = True
            if self._then is not None:
                self._result = self._then(self._result)
            # What the transfer held (send tensors, receive buffers) is free once it is done, even while the
            # caller keeps this handle around.
            self._works, self._then = [], None
        return self._result


class AxisComm:
    """Collectives over one named axis of a device mesh (a process group of size D)."""

    def __init__(self, group=None, name: str = "axis", timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 weight_group=None, stream: str | None = None, point_to_point: bool | None = None,
                 _active: list | None = None):
        self.group = group
        self.name = name
        self.stream = stream or name  # the process group's name in ``CommStats.issue_order``
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # Collectives as point-to-point transfers (see ``_exchange``): on gloo unless ``point_to_point`` says.
        if point_to_point is None:
            point_to_point = group is not None and moves_point_to_point(group)
        self._point_to_point = self.size > 1 and point_to_point
        self._active: list[CommStats] = [] if _active is None else _active
        # Weight traffic: a sibling over a second process group of the same ranks (sharing this axis's
        # counting()), or this comm itself when no second group was asked for.
        self.weights = self
        if weight_group is not None:
            self.weights = AxisComm(weight_group, name, timeout_s, stream=f"{name}.weights", _active=self._active)

    @property
    def point_to_point(self) -> bool:
        """Whether this axis runs broadcast, all-gather, reduce-scatter and reduce as point-to-point transfers."""
        return self._point_to_point

    @classmethod
    def world(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> AxisComm:
        """Every rank of the job (for decisions all ranks must share, e.g. stopping)."""
        return cls(dist.group.WORLD if world_size() > 1 else None, "world", timeout_s)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh | None, name: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  weight_stream: bool = False) -> AxisComm:
        """The comm of mesh axis ``name``; a trivial one-rank comm if the mesh lacks that axis.

        ``weight_stream=True`` adds ``.weights``: the same ranks over a second process group (created
        once, collectively, by ``sibling_group``), so weight transfers run on their own NCCL stream.
        """
        if mesh is None or name not in (mesh.mesh_dim_names or ()):
            return cls(None, name, timeout_s)
        group = mesh.get_group(name)
        weights = None
        if weight_stream and mesh.size(mesh.mesh_dim_names.index(name)) > 1:
            weights = sibling_group(mesh, name, "weights", timeout_s)
        return cls(group, name, timeout_s, weight_group=weights)

    def blocks(self, mesh: DeviceMesh, block: int, purpose: str) -> AxisComm:
        """The comm of this rank's block of ``block`` consecutive ranks of the axis (e.g. the ranks sharing a
        replicated KV head), counted in this axis's ``counting()``; a one-rank comm for blocks of one."""
        if block == 1 or mesh is None:
            return AxisComm(None, self.name, self.timeout.total_seconds(), _active=self._active)
        group = block_group(mesh, self.name, block, purpose, self.timeout.total_seconds())
        return AxisComm(group, self.name, self.timeout.total_seconds(), stream=f"{self.name}.{purpose}",
                        _active=self._active)

    # -- accounting ---------------------------------------------------------

    @contextlib.contextmanager
    def counting(self):
        """``with comm.counting() as stats:`` counts this rank's traffic on this axis inside the block."""
        stats = CommStats()
        self._active.append(stats)
        try:
            yield stats
        finally:
            self._active.remove(stats)

    def mark(self, label) -> None:
        """Record a compute step in the event log, to show what was in flight when it started."""
        self._record("mark", "compute", label)

    def _record(self, event, op, label, sent=0, recv=0) -> None:
        for stats in self._active:
            stats.events.append((event, op, label))
            if event == "issue":
                stats.calls[op] += 1
                stats.bytes_sent[op] += sent
                stats.bytes_recv[op] += recv

    def count_p2p(self, ops: list, label=None) -> list:
        """Count point-to-point ops that a library issues itself (``dist.P2POp``: the pipeline stages' sends
        and receives of activations and their gradients); returns ``ops`` unchanged."""
        for op in ops:
            n = self._nbytes(op.tensor)
            sending = op.op in (dist.isend, dist.send)
            self._record("issue", "pipeline_p2p", label, n if sending else 0, 0 if sending else n)
        return ops

    def _issue(self, op, label, sent, recv, launch, result, finish=None, on_cpu=None) -> Pending:
        records = [(stats, Transfer(self.stream, op, label, len(stats.events))) for stats in self._active]
        for stats, transfer in records:
            stats.transfers.append(transfer)
        self._record("issue", op, label, sent, recv)
        works = launch() if self.size > 1 else []
        return Pending(self, [w for w in works if w is not None], result, op, label, records, finish, on_cpu)

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @staticmethod
    def _finish(pending: Pending, async_op: bool):
        return pending if async_op else pending.wait()

    # -- operations ---------------------------------------------------------

    # On gloo (CPU), broadcast, all-gather, reduce-scatter and reduce run as point-to-point transfers, plus a local
    # sum where they reduce: gloo's own versions of them cost several times the CPU time per rank at TSP's sizes
    # (benchmarks/gloo_collectives.py measures it), and ranks sharing a host's cores pay for it in step time.
    # all_reduce keeps gloo's ring, the fastest there for large tensors. Each kind has its own tag; every rank issues
    # the same transfers in the same order, so sends and receives between two ranks pair up in order.
    _P2P_TAGS = {"broadcast": 10, "all_gather": 11, "reduce_scatter": 12, "reduce": 13, "all_to_all": 14}

    def _exchange(self, op: str, sends, recvs) -> list:
        """Start the point-to-point transfers of one operation: isend each (tensor, peer), irecv each (tensor, peer)."""
        return self._send_recv(sends, recvs, self._P2P_TAGS[op])

    def _send_recv(self, sends, recvs, tag: int) -> list:
        """Start sends and receives of (tensor, axis rank) pairs. On gloo straight through the process group (which
        takes its own ranks): a step issues hundreds of them, and ``batch_isend_irecv``'s checks per op cost a
        third of the host time of each. Elsewhere as one batch, which NCCL needs to pair them without deadlock."""
        if not sends and not recvs:  # nothing to move (batch_isend_irecv refuses an empty batch)
            return []
        if self._point_to_point:
            return ([self.group.send([t], peer, tag) for t, peer in sends]
                    + [self.group.recv([t], peer, tag) for t, peer in recvs])
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=peer, tag=tag) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=peer, tag=tag) for t, peer in recvs]
        return dist.batch_isend_irecv(ops)

    def _peers(self, receiving: bool = False) -> list[int]:
        """The other axis ranks: rank+1, rank+2, ... to send to; rank-1, rank-2, ... to receive from (so the k-th
        send of every rank meets the k-th receive of its peer)."""
        step = -1 if receiving else 1
        return [(self.rank + step * k) % self.size for k in range(1, self.size)]

    def broadcast(self, tensor: torch.Tensor, src: int, async_op=False, label=None):
        """Overwrite ``tensor`` on every rank with the source rank's copy (``src`` is an axis rank)."""
        n, D = self._nbytes(tensor), self.size
        sent, recv = ((D - 1) * n, 0) if self.rank == src else (0, n)
        if not self._point_to_point:
            launch = lambda: [dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)]
        elif self.rank == src:
            launch = lambda: self._exchange("broadcast", [(tensor, peer) for peer in self._peers()], [])
        else:
            launch = lambda: self._exchange("broadcast", [], [(tensor, src)])
        return self._finish(self._issue("broadcast", label, sent, recv, launch, tensor), async_op)

    def all_gather(self, tensor: torch.Tensor, async_op=False, label=None, out: torch.Tensor | None = None):
        """[*shape] on each rank -> [D, *shape] on every rank, in axis-rank order (into ``out``, a contiguous
        [D, *shape] buffer of the same dtype, if given: a decode step reuses its buffers)."""
        return self._finish(self._gather(tensor, label, out=out), async_op)

    def _gather(self, tensor: torch.Tensor, label, finish=None, out: torch.Tensor | None = None) -> Pending:
        if out is None:
            out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        n = (self.size - 1) * self._nbytes(tensor)
        if self.size == 1 or self._point_to_point:
            out[self.rank] = tensor
            src = tensor.contiguous()
            launch = lambda: self._exchange("all_gather", [(src, peer) for peer in self._peers()],
                                            [(out[peer], peer) for peer in self._peers(receiving=True)])
        else:
            launch = lambda: [dist.all_gather_single(out.view(-1), tensor.reshape(-1), group=self.group,
                                                     async_op=True)]
        return self._issue("all_gather", label, n, n, launch, out, finish)

    def all_gather_prefixes(self, tensor: torch.Tensor, prefix: tuple[int, int], async_op=False, label=None):
        """``all_gather`` for a rank that needs only the first part of every earlier rank's tensor: a list of D
        tensors, rank by rank, those of ranks before this one cut to ``prefix`` = (dim, length) entries along
        ``dim`` (zigzag attention: a query chunk never sees a later chunk's keys). Point-to-point backends
        move only those parts, and this rank's own entry is ``tensor`` itself when it is contiguous; collective
        ones gather everything and return views of the whole gathered slices (this rank's a copy)."""
        if not self._point_to_point:
            return self._finish(self._gather(tensor, label, finish=lambda out: list(out.unbind(0))), async_op)
        src = tensor.contiguous()
        # This rank's first part, for the ranks after it (the last rank has none to send it to).
        head = _cut(src, prefix).contiguous() if self.rank < self.size - 1 else None
        head_shape = _cut(src, prefix).shape
        parts = [src.new_empty(head_shape) if peer < self.rank else torch.empty_like(src) for peer in range(self.size)]
        parts[self.rank] = src
        sends = [(head if peer > self.rank else src, peer) for peer in self._peers()]
        recvs = [(parts[peer], peer) for peer in self._peers(receiving=True)]
        sent, recv = (sum(self._nbytes(t) for t, _ in transfers) for transfers in (sends, recvs))
        launch = lambda: self._exchange("all_gather", sends, recvs)
        return self._finish(self._issue("all_gather", label, sent, recv, launch, parts), async_op)

    def reduce_scatter(self, tensor, async_op=False, label=None, prefix: tuple[int, int] | None = None):
        """[D, *shape] on each rank -> the sum over ranks of slice [rank], [*shape] (at D = 1: ``tensor[0]``).

        On gloo the slices are summed here, in rank order and in the input's dtype (float32 for TSP's gradients).

        The adjoint of ``all_gather_prefixes``: with ``prefix`` = (dim, length), this rank's slices for the ranks
        before it must be zero past the prefix (a gradient of keys those ranks' queries never saw). ``tensor``
        may then be a list of D slices, those for earlier ranks cut to the prefix. Point-to-point backends move
        only the first parts and never read the rest; collective ones move (and sum) whole slices, zero-padded
        where cut, so the contract is what makes both agree. A rank adds the first parts it receives from
        later ranks to the first part of its own slice.
        """
        if isinstance(tensor, (list, tuple)) and not self._point_to_point:
            tensor = self._padded(tensor, prefix)
        if len(tensor) != self.size:
            raise ValueError(f"reduce_scatter input needs {self.size} slices, got {len(tensor)}")
        if self._point_to_point:
            slices = tensor if isinstance(tensor, (list, tuple)) else tensor.contiguous()
            own = slices[self.rank]
            # With a prefix, earlier ranks (and this one) contribute whole slices, later ones the first part.
            received = own.new_empty(self.rank + 1 if prefix else self.size, *own.shape)
            received[self.rank] = own
            heads = [own.new_empty(_cut(own, prefix).shape) for _ in range(self.rank + 1, self.size)] if prefix else []
            sends = [(_cut(slices[peer], prefix if peer < self.rank else None).contiguous(), peer)
                     for peer in self._peers()]
            recvs = [(received[peer] if peer < len(received) else heads[peer - self.rank - 1], peer)
                     for peer in self._peers(receiving=True)]
            sent, recv = (sum(self._nbytes(t) for t, _ in transfers) for transfers in (sends, recvs))

            def finish(_):
                total = received.sum(0)
                for head in heads:
                    _cut(total, prefix).add_(head)
                return total
            launch = lambda: self._exchange("reduce_scatter", sends, recvs)
            return self._finish(self._issue("reduce_scatter", label, sent, recv, launch, received, finish), async_op)
        n = (self.size - 1) * self._nbytes(tensor[0])
        out = tensor[0] if self.size == 1 else torch.empty_like(tensor[0])
        launch = lambda: [dist.reduce_scatter_single(out.view(-1), tensor.reshape(-1), group=self.group, async_op=True)]
        return self._finish(self._issue("reduce_scatter", label, n, n, launch, out), async_op)

    def _padded(self, slices, prefix) -> torch.Tensor:
        """Slices, some cut to ``prefix``, as one [D, *shape] tensor (zero past a cut slice's prefix)."""
        full = max(slices, key=lambda t: t.numel())
        if prefix is None and any(t.shape != full.shape for t in slices):
            raise ValueError("reduce_scatter of slices of different shapes needs the prefix they were cut to; got "
                             f"shapes {[tuple(t.shape) for t in slices]} and prefix=None")
        out = full.new_zeros(len(slices), *full.shape)
        for whole, part in zip(out, slices):
            _cut(whole, prefix if part.shape != full.shape else None).copy_(part)
        return out

    def reduce(self, tensor: torch.Tensor, dst: int, async_op=False, label=None):
        """Sum ``tensor`` over ranks into the destination's copy (others' copies are left undefined).

        On gloo the destination receives every rank's copy (D-1 buffers of ``tensor``'s size) and sums them in
        rank order.
        """
        n, D = self._nbytes(tensor), self.size
        sent, recv = (0, (D - 1) * n) if self.rank == dst else (n, 0)
        finish = None
        if not self._point_to_point:
            launch = lambda: [dist.reduce(tensor, group=self.group, group_dst=dst, async_op=True)]
        elif self.rank == dst:
            received = tensor.new_empty(D, *tensor.shape)
            received[self.rank] = tensor
            launch = lambda: self._exchange("reduce", [], [(received[peer], peer) for peer in self._peers(True)])
            finish = lambda t: torch.sum(received, dim=0, out=t)
        else:
            launch = lambda: self._exchange("reduce", [(tensor, dst)], [])
        return self._finish(self._issue("reduce", label, sent, recv, launch, tensor, finish), async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op=False, label=None):
        """Sum ``tensor`` over ranks, in place."""
        n = 2 * (self.size - 1) * self._nbytes(tensor) // self.size
        launch = lambda: [dist.all_reduce(tensor, group=self.group, async_op=True)]
        return self._finish(self._issue("all_reduce", label, n, n, launch, tensor), async_op)

    def ring_shift(self, send: torch.Tensor, recv: torch.Tensor | None = None, async_op=False, label=None, tag=0):
        """Send ``send`` to axis rank+1 and receive the same-shaped tensor from rank-1 into ``recv``.

        Independent rings between the same peers (weights, travelling gradients) use distinct tags.
        """
        if recv is None:
            recv = torch.empty_like(send)
        if self.size == 1:
            recv.copy_(send)
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        n = self._nbytes(send) if self.size > 1 else 0
        launch = lambda: self._send_recv([(send, nxt)], [(recv, prv)], tag)
        return self._finish(self._issue("ring_shift", label, n, n, launch, recv), async_op)


    # Tags of ``exchange``'s channels, apart from every other kind's (0.. for rings, 10..14 above).
    _EXCHANGE_TAG = 20

    def exchange(self, sends, recvs, async_op=False, label=None, channel: int = 0, finish=None):
        """Point-to-point transfers of one step: send each (tensor, peer) of ``sends`` and receive into each
        (buffer, peer) of ``recvs`` (axis ranks other than this one, each at most once per list); returns the
        receive buffers in the order given, or what ``finish`` makes of that list once they have arrived.

        Every pair of ranks must agree on what moves between them (the sender's tensor and the receiver's buffer
        of one shape): callers derive both lists from one rule that all ranks evaluate alike (a sliding layer's
        K/V, ``distributed.window``), so nothing about sizes travels. Empty tensors are not moved. Runs as one
        batch (``batch_isend_irecv`` on collective backends, which NCCL needs to pair the transfers without
        deadlock; on gloo straight through the group, like the other point-to-point paths). Counted as op
        "exchange", the bytes of the tensors sent and received. ``channel``: exchanges in flight at once between
        the same peers in different roles (a layer's K/V and its gradients) each pair up, in issue order, in
        their own channel.
        """
        for name, pairs in (("sends", sends), ("recvs", recvs)):
            peers = [peer for _, peer in pairs]
            if len(set(peers)) != len(peers) or any(p == self.rank or not 0 <= p < self.size for p in peers):
                raise ValueError(f"exchange {name} on axis {self.name!r} (rank {self.rank} of {self.size}) need "
                                 f"distinct other ranks, got {peers}")
        sends = [(t.contiguous(), peer) for t, peer in sends if t.numel()]
        moving = [(t, peer) for t, peer in recvs if t.numel()]
        if any(not t.is_contiguous() for t, _ in moving):
            raise ValueError("exchange receives into contiguous buffers only")
        sent, recv = (sum(self._nbytes(t) for t, _ in pairs) for pairs in (sends, moving))
        launch = lambda: self._send_recv(sends, moving, self._EXCHANGE_TAG + channel)

        def then(out, _reading=sends):  # the send tensors stay referenced until the wait: the transfers read them
            return finish(out) if finish is not None else out
        tensors = [t for t, _ in (*recvs, *sends)]
        on_cpu = not tensors or tensors[0].device.type == "cpu"
        return self._finish(self._issue("exchange", label, sent, recv, launch, [t for t, _ in recvs], then, on_cpu),
                            async_op)

    def all_to_all(self, tensor: torch.Tensor, async_op=False, label=None, out: torch.Tensor | None = None):
        """[D, *shape] on each rank, slice r for rank r -> [D, *shape], slice r from rank r (into ``out`` if given).

        On gloo a direct exchange of point-to-point transfers, like the all-gather (one latency: gloo's own
        all-to-all costs more at the few-kB sizes of a decode step)."""
        if len(tensor) != self.size:
            raise ValueError(f"all_to_all input needs {self.size} slices, got {len(tensor)}")
        src = tensor.contiguous()
        if out is None:
            out = torch.empty_like(src)
        n = (self.size - 1) * self._nbytes(src[0])
        if self.size == 1 or self._point_to_point:
            out[self.rank] = src[self.rank]
            launch = lambda: self._exchange("all_to_all", [(src[peer], peer) for peer in self._peers()],
                                            [(out[peer], peer) for peer in self._peers(receiving=True)])
        else:
            launch = lambda: [dist.all_to_all_single(out.view(self.size, -1), src.view(self.size, -1),
                                                     group=self.group, async_op=True)]
        return self._finish(self._issue("all_to_all", label, n, n, launch, out), async_op)

    def all_to_all_single(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                          async_op=False, label=None):
        """Rows of ``tensor`` [sum(input_splits), ...] in axis-rank order: ``input_splits[r]`` rows go to rank r;
        returns [sum(output_splits), ...] holding ``output_splits[r]`` rows from rank r, in rank order.

        The splits are host integers every pair of ranks agrees on (exchange them first if they are data).
        Only rows that cross ranks are counted: a rank's rows to itself stay in its memory.
        """
        D = self.size
        if len(output_splits) != D or len(input_splits) != D or sum(input_splits) != tensor.shape[0]:
            raise ValueError(f"all_to_all_single needs {D} output and input splits, the input ones summing to "
                             f"{tensor.shape[0]} rows; got {list(output_splits)} and {list(input_splits)}")
        out = tensor.new_empty(sum(output_splits), *tensor.shape[1:])
        if D == 1:
            out.copy_(tensor)
        row = tensor.element_size() * math.prod(tensor.shape[1:])
        sent = (sum(input_splits) - input_splits[self.rank]) * row
        recv = (sum(output_splits) - output_splits[self.rank]) * row
        src = tensor.contiguous()
        launch = lambda: [dist.all_to_all_single(out, src, output_split_sizes=list(output_splits),
                                                 input_split_sizes=list(input_splits), group=self.group,
                                                 async_op=True)]
        return self._finish(self._issue("all_to_all", label, sent, recv, launch, out), async_op)
