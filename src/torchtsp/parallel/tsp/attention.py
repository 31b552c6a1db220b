"""TSP attention: head-group shards broadcast in turn, K/V all-gathered per group (a sliding layer's: only the
window's keys, ``distributed/window.py``), a hand-written backward.

Each K/V all-gather and each shard broadcast is a meeting point of every rank; slack between a transfer's
issue and its wait lets a rank that fell behind catch up before the others wait for it. So both passes run a
pipeline over head groups, and on each process group transfers are waited for in the order they were issued
(NCCL runs one group's collectives in issue order: nothing needed now may queue behind a later transfer).
"""

from __future__ import annotations

import torch

from ...compiled import compilable
from ...distributed.attention import gather_kv, scatter_kv_grad, zigzag_attention_backward, zigzag_attention_forward
from ...layers import CAUSAL, apply_rope, apply_sinks, scale_queries, sinks_grad
from .shard_math import TSPShardMath
from .streams import ACC, BroadcastStream, add_mm, mm_into

FORWARD, BACKWARD = "attention.forward", "attention.backward"


@compilable
def unrotated(g, cos, minus_sin, dtype):
    """RoPE's transpose (rotation by the opposite angle: ``minus_sin``) of a gradient [B, S/D, H, d], in ``dtype``
    (one compiled kernel under ``--compile``)."""
    return apply_rope(g, cos, minus_sin).to(dtype)


class KVAhead:
    """Head groups' local K/V, projected and their all-gather started ahead of use, in group order.

    In training, group j+1's K/V are projected and gathered before group j's are waited for, group j+2's (whose
    shard came during group j's attention) right after group j's attention: two gathered groups alive at most.
    Without saving (no backward), one group's K/V at a time.
    """

    def __init__(self, shard_math: TSPShardMath, weights: BroadcastStream, x2, k_norm, cos, sin, batch: int,
                 mask=CAUSAL):
        self.shard_math, self.weights, self.x2, self.k_norm = shard_math, weights, x2, k_norm
        self.cos, self.sin, self.batch, self.mask = cos, sin, batch, mask
        self.started, self.following = [], 0  # (kv, pre-norm k, finisher) not yet used; the next group to start

    def start_until(self, last: int) -> None:
        comm, sm = self.shard_math.comm, self.shard_math
        while self.following <= min(last, comm.size - 1):
            j = self.following
            kv, k_raw = sm.project_kv(self.x2, sm.attention(self.weights.get(j)), self.k_norm, self.cos, self.sin,
                                      self.batch)
            self.started.append((kv, k_raw, gather_kv(comm, kv, async_op=True, label=(FORWARD, j), mask=self.mask)))
            self.following += 1

    def take(self):
        """The oldest started group: (its local K/V, pre-norm k, finisher of its gather)."""
        return self.started.pop(0)


class TSPAttention(torch.autograd.Function):
    """y = attention(x) for local tokens x [B, S/D, h]; weights broadcast head group by head group.

    Saves (default) per head group the local queries, K/V, attention output and LSE (with q/k norm also the
    pre-norm q and k projections); backward broadcasts the weights again, all-gathers the saved K/V again and
    recomputes no projection. q/k/v biases travel in the packed shard with their heads' rows. ``q_norm`` and
    ``k_norm`` (Qwen3's per-head norm weights, replicated) get this rank's tokens' gradient; the caller sums it
    over the axis (``ReplicatedGrad``). When n_kv < D, D/n_kv consecutive ranks hold copies of one KV head:
    each group's K/V gradient reaches its owner as usual and the copies' gradients are then summed over
    those ranks (``shard_math.kv_comm``). ``prefetch_backward`` (a ``Prefetch``): a broadcast to start
    once backward has issued its last reduce (under recompute, shard 0 of the previous layer's attention, whose
    forward backward runs again next).

    Heads stay token-major ([B, S/D, H, d], as the projections produce them) from projection to output
    projection: the attention kernel reads strided heads, so no head transpose is ever copied. ``documents``:
    the layer's ``layers.Mask`` (``sequence_mask``: packed rows' documents, each query attending within its own
    document, cos/sin then per row; a sliding layer's window).
    """

    @staticmethod
    def forward(ctx, x, shard, cos, sin, shard_math: TSPShardMath, prefetch=None, layer: int = 0, q_norm=None,
                k_norm=None, prefetch_backward=None, mask=CAUSAL):
        comm, D = shard_math.comm, shard_math.comm.size
        B, n, h = x.shape
        x2 = x.reshape(-1, h)
        saving = any(ctx.needs_input_grad)
        groups = []  # per head group, what backward needs: (q, kv, out, lse, q_raw, k_raw)
        y = None
        first = prefetch.take(FORWARD, layer) if prefetch is not None else None
        weights = BroadcastStream(comm.weights, shard, FORWARD, first, depth=3 if saving else 2)
        ahead = KVAhead(shard_math, weights, x2, k_norm, cos, sin, B, mask)
        for j in range(D):
            comm.mark((FORWARD, j))
            ahead.start_until(j)
            w = shard_math.attention(weights.get(j))
            q, q_raw = shard_math.project_q(x2, w, q_norm, cos, sin, B)
            if saving:
                ahead.start_until(j + 1)
            kv, k_raw, gathering = ahead.take()
            out, lse = zigzag_attention_forward(q.transpose(1, 2), gathering(), comm.rank, D, mask)
            if w.sinks is not None:  # once, on the group's attention merged over every rank's keys
                out, lse = apply_sinks(out, lse, w.sinks)
            out = out.transpose(1, 2)  # token-major [B, S/D, Hq, d]
            y = add_mm(y, out.reshape(B * n, -1), w.wo.t())
            w = gathering = None  # the gathered K/V go with their finisher
            if saving:
                groups.append((q, kv, out, lse, q_raw, k_raw))
                ahead.start_until(j + 2)
            weights.release(j)
        ctx.save_for_backward(x, shard, cos, sin, q_norm, k_norm, *(t for group in groups for t in group))
        ctx.shard_math, ctx.prefetch, ctx.layer, ctx.prefetch_backward = shard_math, prefetch, layer, prefetch_backward
        ctx.mask = mask
        return y.view(B, n, h).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return AttentionBackward(ctx, dy).run()


class AttentionBackward:
    """One backward pass of ``TSPAttention``: a pipeline over head groups.

    On the activation group: gather K/V of groups 0 and 1, then per group j the dK/dV reduce-scatter of j and
    the gather of j+2; group j's dK/dV are waited for (and its key/value gradients finished) after group j+1's
    attention backward. On the weight group: shards 0, 1 and 2, then per group j its partial weight-gradient
    reduce and shard j+3; a reduce is waited for one group after it was issued. So every transfer runs behind
    a group's attention.
    """

    def __init__(self, ctx, dy):
        x, shard, cos, sin, q_norm, k_norm, *saved = ctx.saved_tensors
        self.ctx, self.x, self.shard, self.cos, self.q_norm, self.k_norm = ctx, x, shard, cos, q_norm, k_norm
        self.unrotate_sin = -sin  # RoPE's transpose rotates by the opposite angle
        self.shard_math = sm = ctx.shard_math
        self.comm = sm.comm
        self.qs, self.kvs, self.outs, self.lses, self.q_raws, self.k_raws = (saved[i::6] for i in range(6))
        B, n, h = x.shape
        self.x2, self.dy2 = x.reshape(-1, h), dy.reshape(-1, h)
        self.dx = None
        # q and k norm weight gradients from this rank's tokens, over every head group (float32).
        self.dnorms = None if q_norm is None else torch.zeros(2, sm.cfg.head_dim, dtype=ACC, device=x.device)
        self.dshard, self.reducing = None, []  # (owner, pending reduce) of partial gradients in flight
        self.gathers = {j: self.gather(j) for j in range(min(self.comm.size, 2))}
        first = ctx.prefetch.take(BACKWARD, ctx.layer) if ctx.prefetch is not None else None
        self.weights = BroadcastStream(self.comm.weights, shard, BACKWARD, first, depth=3)

    def gather(self, j: int):
        return gather_kv(self.comm, self.kvs[j], async_op=True, label=(BACKWARD, j), mask=self.ctx.mask)

    def settle(self, keep: int) -> None:
        """Wait for reductions until at most ``keep`` remain in flight; keep the one owned here."""
        while len(self.reducing) > keep:
            owner, pending = self.reducing.pop(0)
            result = pending.wait()
            if owner == self.comm.rank:
                self.dshard = result

    def query_path(self, j: int):
        """Group j's attention backward and its query path: dX, dWq, dWo; starts the reduce-scatter of its dK/dV
        to their owners. Returns (the reduce-scatter in flight, the group's float32 weight-gradient buffer)."""
        sm, comm, D = self.shard_math, self.comm, self.comm.size
        B, n, _ = self.x.shape
        w = sm.attention(self.weights.get(j))
        dout = (self.dy2 @ w.wo).view(B, n, -1, sm.cfg.head_dim)  # before waiting for the K/V
        dq, dkv = zigzag_attention_backward(dout.transpose(1, 2), self.qs[j].transpose(1, 2), self.gathers.pop(j)(),
                                            self.outs[j].transpose(1, 2), self.lses[j], comm.rank, D,
                                            self.ctx.mask)
        dsinks = None if w.sinks is None else sinks_grad(dout.transpose(1, 2), self.outs[j].transpose(1, 2),
                                                         self.lses[j], w.sinks)
        dout = None
        # dK/dV of own tokens, summed over every rank's queries.
        scattering = scatter_kv_grad(comm, dkv, self.kvs[j], async_op=True, label=(BACKWARD, j))
        dkv = None
        if j + 2 < D:
            self.gathers[j + 2] = self.gather(j + 2)
        dw = torch.empty(sm.attention_layout.numel, dtype=ACC, device=self.x.device)
        g = sm.attention(dw)
        mm_into(g.wo, self.dy2.t(), self.outs[j].reshape(B * n, -1))
        if dsinks is not None:
            g.sinks.copy_(dsinks)
        # The query scale is a constant factor: its transpose is itself.
        dq2 = unrotated(scale_queries(dq.transpose(1, 2), sm.cfg), self.cos, self.unrotate_sin, dq.dtype)
        dq2 = dq2.view(B * n, -1)
        if self.q_norm is not None:
            dq2 = sm.norm_backward(dq2, self.q_raws[j], self.q_norm, self.dnorms[0])
        self.dx = add_mm(self.dx, dq2, w.wq)
        mm_into(g.wq, dq2.t(), self.x2)
        if g.bq is not None:
            g.bq.copy_(dq2.sum(0, dtype=ACC))
        return scattering, dw

    def key_value_path(self, j: int, scattering, dw) -> None:
        """Group j's key/value path: wait for its dK/dV, then dX, dWk, dWv; reduce dW to its owner."""
        sm, x = self.shard_math, self.x
        B, n, _ = x.shape
        w, g = sm.attention(self.weights.get(j)), sm.attention(dw)
        dkv = scattering.wait()  # [2, B, S/D, Hkv, d] float32, summed over every rank's queries
        dk2 = unrotated(dkv[0], self.cos, self.unrotate_sin, x.dtype).view(B * n, -1)
        if self.k_norm is not None:
            dk2 = sm.norm_backward(dk2, self.k_raws[j], self.k_norm, self.dnorms[1])
        dv2 = dkv[1].reshape(B * n, -1).to(x.dtype)
        self.dx = add_mm(add_mm(self.dx, dk2, w.wk), dv2, w.wv)
        mm_into(g.wk, dk2.t(), self.x2)
        mm_into(g.wv, dv2.t(), self.x2)
        if g.bk is not None:
            g.bk.copy_(dk2.sum(0, dtype=ACC))
            g.bv.copy_(dv2.sum(0, dtype=ACC))
        # Every rank's partial gradient of head group j goes to its owner j. (One reduce-scatter of all
        # groups at the end moves the same bytes but would hold the layer's partial gradients at once.)
        self.reducing.append((j, self.comm.weights.reduce(dw, dst=j, async_op=True, label=(BACKWARD, j))))
        self.weights.release(j)

    def run(self):
        sm, ctx, comm = self.shard_math, self.ctx, self.comm
        previous = None
        for j in range(comm.size):
            comm.mark((BACKWARD, j))
            self.settle(keep=1)  # reductions issued before shard j's broadcast
            scattering, dw = self.query_path(j)
            if previous is not None:
                self.key_value_path(*previous)
            previous = (j, scattering, dw)
        self.key_value_path(*previous)
        if ctx.prefetch_backward is not None:  # after this layer's last reduce: waited for after it
            ctx.prefetch_backward.issue()
        self.settle(keep=0)
        if sm.kv_replicas > 1:
            # This rank's KV-head copy got the gradient of its own query group only: sum the copies' gradients
            # (the packed shard's contiguous K/V tail) over the ranks sharing the head.
            sm.kv_comm.all_reduce(self.dshard[sm.kv_offset:], label=("attention.kv_replicas", ctx.layer))
        dq_norm = dk_norm = None
        if self.dnorms is not None:
            dq_norm, dk_norm = self.dnorms[0].to(self.q_norm.dtype), self.dnorms[1].to(self.k_norm.dtype)
        x = self.x
        return (self.dx.view(x.shape).to(x.dtype), self.dshard.to(self.shard.dtype), None, None, None, None, None,
                dq_norm, dk_norm, None, None)
