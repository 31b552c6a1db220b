"""TSP: tensor and sequence parallelism folded onto one mesh axis (see docs/design.md).

Every rank p of the ``tsp`` axis (size D) holds 1/D of every weight and 1/D of the tokens
(zigzag layout). Weights move, activations stay:

* attention: each rank's packed (wq, wk, wv, wo) head-group shard is broadcast in turn;
  all ranks project their own tokens with it, all-gather that group's K/V, attend, and
  accumulate the output projection locally;
* gated MLP, embedding, LM head: packed shards travel around a ring (p -> p+1), and each
  rank applies every passing shard to its own tokens;
* backward re-communicates the weights (and K/V) instead of saving them, so autograd
  never holds more than local-token tensors. Attention weight gradients are reduced to
  their owner; ring gradients travel with the shard and arrive home after D hops.

Activations (the ``recompute`` flag, as for every scheme): by default each block saves the
activations of its local tokens, all 1/D-sized: per head group the queries, local K/V,
attention output and log-sum-exp; per FFN shard the gate and up projections. Backward
then moves weights and K/V again but recomputes no GEMM. ``recompute=True`` keeps each
layer's input only and re-runs the layer's forward, transfers included, in backward; the MLP's
part of that re-run happens inside its backward ring (each passing shard's gate and up are
projected again there), so its weights go around once in backward, not twice, and the down
projection, whose output the re-run would discard, is not repeated.

Overlap: weights (and their gradient reductions) travel on a second process group of the
same ranks (``comm.weights``), activations, K/V and travelling gradients on the first, so
on a GPU (NCCL runs one group's collectives in issue order) a weight prefetch never
delays the K/V gather the current step waits for. On each group, transfers are issued in
the order they are waited on. The next shard is always requested before the current one
is used (attention in training keeps two shards and two head groups' K/V in flight ahead
of the one in use, since each transfer is a meeting point of every rank: the slack lets a
rank that fell behind catch up before the others wait for it), and the next layer's first
attention shard is broadcast while the current layer's MLP runs. Norm weights' gradients
are summed in one all-reduce at the end of a backward pass.

bf16/fp16 runs accumulate partial sums in float32: outputs over head groups and shards,
input gradients, travelling gradients and the gradient reductions (sent in float32).
No step synchronises host and device (no ``.item()``, ``nonzero`` or boolean-mask indexing).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..distributed import zigzag
from ..distributed.attention import first_chunk, gather_kv, zigzag_attention_backward, zigzag_attention_forward
from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..model import (
    IGNORE_INDEX,
    RouterStats,
    Transformer,
    head_norm,
    reference_shapes,
    rms_norm,
    rope_tables,
)
from ..weights import WeightSource
from .base import (
    ParallelTransformer,
    ReplicatedGrad,
    global_sum_and_count,
    replicated_grad,
    sum_router_stats_over,
    weight_source,
)
from .moe import TSPMoE
from .shards import PackedLayout, Part, real_vocab_rows, vocab_shard, vocab_slice_index

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


class ShardPrefetch:
    """Shard 0 of a layer's attention, broadcast while the block before it finishes (cross-layer prefetch).

    ``issue(key, ...)`` and ``take(key)`` pair up; every rank issues and takes the same keys in the same order.
    """

    def __init__(self, comm: AxisComm):
        self.comm, self.pending = comm, {}

    def issue(self, key, own: torch.Tensor) -> None:
        self.pending[key] = issue_broadcast(self.comm, own, 0, (key[0], 0))

    def take(self, key):
        return self.pending.pop(key, None)


def _add_mm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b in float32 (``acc`` None: the first term, no zero-filled start): in place, in one GEMM
    when the dtypes agree, else the product is added in acc's precision."""
    if acc is None:
        return (a @ b).to(ACC)
    return acc.addmm_(a, b) if acc.dtype == a.dtype else acc.add_(a @ b)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, written straight into ``out`` when the dtypes agree (else computed, then cast in)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


# ---------------------------------------------------------------- attention


class TSPAttention(torch.autograd.Function):
    """y = attention(x) for local tokens x [B, S/D, h]; weights broadcast head group by head group.

    Saves (default) per head group the local queries, K/V, attention output and LSE (with q/k norm also the
    pre-norm q and k projections); backward broadcasts the weights again, all-gathers the saved K/V again and
    recomputes no projection. q/k/v biases travel in the packed shard with their heads' rows. ``q_norm`` and
    ``k_norm`` (Qwen3's per-head norm weights, replicated) get this rank's tokens' gradient; the caller sums it
    over the axis (``ReplicatedGrad``). When n_kv < D, D/n_kv consecutive ranks hold copies of one KV head:
    each group's K/V gradient reaches its owner as usual and the copies' gradients are then summed over
    those ranks (``math.kv_comm``). ``prefetch_backward`` = (ShardPrefetch, key, shard): a broadcast to start
    once backward has issued its last reduce (under recompute, shard 0 of the previous layer's attention, whose
    forward backward runs again next).

    Heads stay token-major ([B, S/D, H, d], as the projections produce them) from projection to output
    projection: the attention kernel reads strided heads, so no head transpose is ever copied.
    """

    @staticmethod
    def forward(ctx, x, shard, cos, sin, math: TSPShardMath, prefetch=None, layer: int = 0, q_norm=None,
                k_norm=None, prefetch_backward=None):
        comm, D = math.comm, math.comm.size
        B, n, h = x.shape
        x2 = x.reshape(-1, h)
        saving = any(ctx.needs_input_grad)
        groups = []  # per head group, what backward needs: (q, kv, out, lse, q_raw, k_raw)
        y = None
        first = prefetch.take(("attention.forward", layer)) if prefetch is not None else None
        weights = BroadcastStream(comm.weights, shard, "attention.forward", first, depth=3 if saving else 2)

        def start_kv(j):
            """Project group j's local K/V and start their all-gather: (kv, pre-norm k, finisher)."""
            kv, k_raw = math.project_kv(x2, math.attention(weights.get(j)), k_norm, cos, sin, B)
            return kv, k_raw, gather_kv(comm, kv, async_op=True, label=("attention.forward", j))

        # Each K/V all-gather (and each shard broadcast) is a meeting point of every rank; slack between a
        # transfer's issue and its wait lets a rank that fell behind catch up before the others wait for it.
        # In training, group j+1's K/V are projected and their gather issued before group j's are waited for,
        # group j+2's (whose shard came during group j's attention) right after group j's attention: two
        # gathered groups alive at most, issued in group order on one process group, so nothing needed now
        # queues behind a later transfer. Without saving (no backward), one group's K/V at a time.
        started, following = [], 0  # (kv, pre-norm k, finisher) of groups started and not yet used; the next

        def start_until(last):
            nonlocal following
            while following <= min(last, D - 1):
                started.append(start_kv(following))
                following += 1

        for j in range(D):
            comm.mark(("attention.forward", j))
            start_until(j)
            w = math.attention(weights.get(j))
            q, q_raw = math.project_q(x2, w, q_norm, cos, sin, B)
            if saving:
                start_until(j + 1)
            kv, k_raw, gathering = started.pop(0)
            out, lse = zigzag_attention_forward(q.transpose(1, 2), gathering(), comm.rank, D)
            out = out.transpose(1, 2)  # token-major [B, S/D, Hq, d]
            y = _add_mm(y, out.reshape(B * n, -1), w.wo.t())
            w = gathering = None  # the gathered K/V go with their finisher
            if saving:
                groups.append((q, kv, out, lse, q_raw, k_raw))
                start_until(j + 2)
            weights.release(j)
        ctx.save_for_backward(x, shard, cos, sin, q_norm, k_norm, *(t for group in groups for t in group))
        ctx.math, ctx.prefetch, ctx.layer, ctx.prefetch_backward = math, prefetch, layer, prefetch_backward
        return y.view(B, n, h).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, shard, cos, sin, q_norm, k_norm, *saved = ctx.saved_tensors
        math = ctx.math
        comm, D = math.comm, math.comm.size
        qs, kvs, outs, lses, q_raws, k_raws = (saved[i::6] for i in range(6))
        B, n, h = x.shape
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
        unrotate_sin = -sin  # RoPE's transpose rotates by the opposite angle
        dx = None
        # q and k norm weight gradients from this rank's tokens, over every head group (float32).
        dnorms = None if q_norm is None else torch.zeros(2, math.cfg.head_dim, dtype=ACC, device=x.device)
        layout = math.attention_layout
        dshard, reducing = None, []  # (owner, pending reduce) of partial gradients in flight

        def settle(keep: int):
            """Wait for reductions until at most ``keep`` remain in flight; keep the one owned here."""
            nonlocal dshard
            while len(reducing) > keep:
                owner, pending = reducing.pop(0)
                result = pending.wait()
                if owner == comm.rank:
                    dshard = result

        # A pipeline over head groups. On the activation group: gather K/V of groups 0 and 1, then per group j
        # the dK/dV reduce-scatter of j and the gather of j+2; group j's dK/dV are waited for (and its
        # key/value gradients finished) after group j+1's attention backward. On the weight group: shards
        # 0, 1 and 2, then per group j its partial weight-gradient reduce and shard j+3; a reduce is waited for
        # one group after it was issued. So every transfer runs behind a group's attention, and on each group
        # transfers are waited for in the order they were issued.
        def gather(j):
            return gather_kv(comm, kvs[j], async_op=True, label=("attention.backward", j))

        gathers = {j: gather(j) for j in range(min(D, 2))}
        first = ctx.prefetch.take(("attention.backward", ctx.layer)) if ctx.prefetch is not None else None
        weights = BroadcastStream(comm.weights, shard, "attention.backward", first, depth=3)

        def finish(j, scattering, dw):
            """Group j's key/value path: wait for its dK/dV, then dX, dWk, dWv; reduce dW to its owner."""
            nonlocal dx
            w, g = math.attention(weights.get(j)), math.attention(dw)
            dkv = scattering.wait()  # [2, B, S/D, Hkv, d] float32, summed over every rank's queries
            dk2 = math.rotate(dkv[0], cos, unrotate_sin).to(x.dtype).view(B * n, -1)
            if k_norm is not None:
                dk2 = math.norm_backward(dk2, k_raws[j], k_norm, dnorms[1])
            dv2 = dkv[1].reshape(B * n, -1).to(x.dtype)
            dx = _add_mm(_add_mm(dx, dk2, w.wk), dv2, w.wv)
            _mm_into(g.wk, dk2.t(), x2)
            _mm_into(g.wv, dv2.t(), x2)
            if g.bk is not None:
                g.bk.copy_(dk2.sum(0, dtype=ACC))
                g.bv.copy_(dv2.sum(0, dtype=ACC))
            # Every rank's partial gradient of head group j goes to its owner j. (One reduce-scatter of all
            # groups at the end moves the same bytes but would hold the layer's partial gradients at once.)
            reducing.append((j, comm.weights.reduce(dw, dst=j, async_op=True, label=("attention.backward", j))))
            weights.release(j)

        previous = None
        for j in range(D):
            comm.mark(("attention.backward", j))
            settle(keep=1)  # reductions issued before shard j's broadcast
            w = math.attention(weights.get(j))
            dout = (dy2 @ w.wo).view(B, n, -1, math.cfg.head_dim)  # before waiting for the K/V
            dq, dkv = zigzag_attention_backward(dout.transpose(1, 2), qs[j].transpose(1, 2), gathers.pop(j)(),
                                                outs[j].transpose(1, 2), lses[j], comm.rank, D)
            dout = None
            # dK/dV of own tokens, summed over every rank's queries.
            scattering = comm.reduce_scatter(dkv, async_op=True, label=("attention.backward", j),
                                             prefix=first_chunk(kvs[j]))
            dkv = None
            if j + 2 < D:
                gathers[j + 2] = gather(j + 2)
            dw = torch.empty(layout.numel, dtype=ACC, device=x.device)
            g = math.attention(dw)
            _mm_into(g.wo, dy2.t(), outs[j].reshape(B * n, -1))
            dq2 = math.rotate(dq.transpose(1, 2), cos, unrotate_sin).view(B * n, -1)
            if q_norm is not None:
                dq2 = math.norm_backward(dq2, q_raws[j], q_norm, dnorms[0])
            dx = _add_mm(dx, dq2, w.wq)
            _mm_into(g.wq, dq2.t(), x2)
            if g.bq is not None:
                g.bq.copy_(dq2.sum(0, dtype=ACC))
            dq = dq2 = w = g = None
            if previous is not None:
                finish(*previous)
            previous = (j, scattering, dw)
        finish(*previous)
        if ctx.prefetch_backward is not None:  # after this layer's last reduce: waited for after it
            ctx.prefetch_backward[0].issue(*ctx.prefetch_backward[1:])
        settle(keep=0)
        if math.kv_replicas > 1:
            # This rank's KV-head copy got the gradient of its own query group only: sum the copies' gradients
            # (the packed shard's contiguous K/V tail) over the ranks sharing the head.
            math.kv_comm.all_reduce(dshard[math.kv_offset:], label=("attention.kv_replicas", ctx.layer))
        dq_norm = dk_norm = None
        if dnorms is not None:
            dq_norm, dk_norm = dnorms[0].to(q_norm.dtype), dnorms[1].to(k_norm.dtype)
        return (dx.view(B, n, h).to(x.dtype), dshard.to(shard.dtype), None, None, None, None, None, dq_norm, dk_norm,
                None)


# ---------------------------------------------------------------- gated MLP


class TSPFeedForward(torch.autograd.Function):
    """y = swiglu(x) for local tokens x; packed (w_gate, w_up, w_down) shards pass around a ring.

    Saves (default) the gate and up projections of the local tokens for every shard; backward passes the
    shards around again and recomputes only the elementwise silu and product. ``prefetch`` = (ShardPrefetch,
    key, attention shard) starts the broadcast of the next attention's shard 0 during the last ring step
    (forward); ``prefetch_backward`` the same for this layer's attention in backward.

    ``recompute``: save the input only; backward projects gate and up of each shard again as the shard passes
    by, so the forward's GEMMs run again inside backward's ring and the weights go around once in backward,
    not twice. ``rerun``: this is the layer's forward run again by ``checkpoint`` inside backward, which wants
    only the saved input back (the block's output is discarded): nothing to compute, the output is left zero.
    """

    @staticmethod
    def forward(ctx, x, shard, math: TSPShardMath, prefetch=None, prefetch_backward=None, layout=None,
                recompute=False, rerun=False):
        # ``layout``: the packed shards' layout, if not the dense MLP's (a mixture of experts' shared expert).
        ctx.math, ctx.prefetch_backward, ctx.layout = math, prefetch_backward, layout or math.mlp_layout
        if recompute and rerun:
            ctx.save_for_backward(x, shard)
            return torch.zeros_like(x)
        comm, D = math.comm, math.comm.size
        B, n, h = x.shape
        x2 = x.reshape(-1, h)
        layout = ctx.layout
        ff = layout.local_shape(layout.parts[0])[0]
        keep = not recompute and any(ctx.needs_input_grad[:2])
        shards = D if keep else 1  # without backward, or recomputed in it, one shard's slot is reused
        gate_all, up_all = x.new_empty(shards, B * n, ff), x.new_empty(shards, B * n, ff)
        y = None
        for k, (s, w) in enumerate(ring_each(comm.weights, shard, "mlp.forward")):
            comm.mark(("mlp.forward", s))
            if prefetch is not None and k == max(D - 2, 0):  # queued after the last shard's transfer
                prefetch[0].issue(*prefetch[1:])
            wg, wu, wd = layout.unpack(w)
            gate, up = gate_all[s % shards], up_all[s % shards]
            torch.mm(x2, wg.t(), out=gate)
            torch.mm(x2, wu.t(), out=up)
            y = _add_mm(y, F.silu(gate) * up, wd.t())
        ctx.save_for_backward(x, shard, *((gate_all, up_all) if keep else ()))
        return y.view(B, n, h).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, shard, *kept = ctx.saved_tensors
        math, prefetch, layout = ctx.math, ctx.prefetch_backward, ctx.layout
        comm, D = math.comm, math.comm.size
        B, n, h = x.shape
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
        dx = None
        grads = GradientRing(comm, "mlp.grad")
        for k, (s, w) in enumerate(ring_each(comm.weights, shard, "mlp.backward")):
            comm.mark(("mlp.backward", s))
            if prefetch is not None and k == max(D - 2, 0):
                prefetch[0].issue(*prefetch[1:])
            wg, wu, wd = layout.unpack(w)
            gate, up = (kept[0][s], kept[1][s]) if kept else (x2 @ wg.t(), x2 @ wu.t())
            silu = F.silu(gate)
            dw = torch.empty(layout.numel, dtype=ACC, device=x.device)
            dwg, dwu, dwd = layout.unpack(dw)
            _mm_into(dwd, dy2.t(), silu * up)
            dhidden = dy2 @ wd
            dgate = torch.ops.aten.silu_backward(dhidden * up, gate)  # the kernel autograd runs for F.silu
            dup = dhidden * silu
            dx = _add_mm(_add_mm(dx, dgate, wg), dup, wu)
            _mm_into(dwg, dgate.t(), x2)
            _mm_into(dwu, dup.t(), x2)
            grads.add(dw)
            dw = dwg = dwu = dwd = None  # travels on with the ring: not bound here when the next one is made
        return dx.view(B, n, h).to(x.dtype), grads.result(shard.dtype), None, None, None, None, None, None


# ---------------------------------------------------------------- embedding and LM head


class TSPEmbedding(torch.autograd.Function):
    """Rows of the local token ids, picked from vocabulary shards as they pass around the ring."""

    @staticmethod
    def forward(ctx, ids, shard, math: TSPShardMath):
        comm, rows = math.comm, shard.shape[0]
        x = shard.new_zeros(*ids.shape, shard.shape[1])
        for s, w in ring_each(comm.weights, shard, "embedding.forward"):
            comm.mark(("embedding.forward", s))
            local, hit = vocab_slice_index(ids, rows, s)
            x = torch.where(hit.unsqueeze(-1), F.embedding(local, w), x)
        ctx.save_for_backward(ids)
        ctx.math, ctx.shard_shape, ctx.dtype = math, shard.shape, shard.dtype
        return x

    @staticmethod
    def backward(ctx, dx):
        (ids,) = ctx.saved_tensors
        comm, rows = ctx.math.comm, ctx.shard_shape[0]
        grads = GradientRing(comm, "embedding.grad")
        dx = dx.reshape(-1, dx.shape[-1]).to(ACC)
        ids = ids.reshape(-1)
        for k in range(comm.size):  # only gradients travel: the lookup needs no weights
            s = (comm.rank - k) % comm.size
            local, hit = vocab_slice_index(ids, rows, s)
            rows_of_shard = torch.where(hit.unsqueeze(-1), dx, 0.0)
            grads.add(dx.new_zeros(ctx.shard_shape).index_add_(0, local, rows_of_shard))
        return None, grads.result(ctx.dtype), None


class TSPHeadCrossEntropy(torch.autograd.Function):
    """Per-token NLL of the LM head without materialising [tokens, V] logits.

    Vocabulary shards pass around the ring; logits of local tokens against each slice are folded
    into an online log-sum-exp and the target logit. Backward passes the shards around again and
    recomputes each slice's logits (saving them would hold [tokens, V] per rank).
    """

    @staticmethod
    def forward(ctx, z, labels, shard, math: TSPShardMath):
        comm, rows = math.comm, shard.shape[0]
        lse = z.new_full((z.shape[0],), float("-inf"), dtype=torch.float32)
        target = torch.zeros_like(lse)
        for s, w in ring_each(comm.weights, shard, "head.forward"):
            comm.mark(("head.forward", s))
            logits = math.vocab_logits(z, w, s)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            local, hit = vocab_slice_index(labels, rows, s)
            target = torch.where(hit, logits.gather(1, local.unsqueeze(1)).squeeze(1), target)
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(z, labels, shard, lse)
        ctx.math = math
        return torch.where(valid, lse - target, 0.0)

    @staticmethod
    def backward(ctx, dnll):
        z, labels, shard, lse = ctx.saved_tensors
        math, rows = ctx.math, shard.shape[0]
        comm = math.comm
        scale = torch.where(labels != IGNORE_INDEX, dnll, 0.0)[:, None]
        dz = None
        grads = GradientRing(comm, "head.grad")
        for s, w in ring_each(comm.weights, shard, "head.backward"):
            comm.mark(("head.backward", s))
            dlogits = torch.exp(math.vocab_logits(z, w, s) - lse[:, None])  # softmax slice
            local, hit = vocab_slice_index(labels, rows, s)
            dlogits.scatter_add_(1, local.unsqueeze(1), -hit.to(dlogits.dtype).unsqueeze(1))  # minus one-hot
            dlogits = (dlogits * scale).to(z.dtype)
            dz = _add_mm(dz, dlogits, w)
            grads.add(dlogits.t() @ z)
        return dz.to(z.dtype), None, grads.result(shard.dtype), None


# ---------------------------------------------------------------- per-shard math


class AttentionShard(NamedTuple):
    """Views of one packed attention shard (a rank's head group): the weights and, with q/k/v bias, the
    biases (None without)."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None


def _linear_into(x2, weight, bias, out=None):
    """x2 @ weight.T (+ bias), into ``out`` if given (one GEMM either way)."""
    if out is None:
        return x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())
    if bias is None:
        return torch.mm(x2, weight.t(), out=out)
    return torch.addmm(bias, x2, weight.t(), out=out)


class TSPShardMath:
    """What every rank computes with one passing shard: the packed layouts of a layer's attention and MLP
    shards, head reshapes, q/k norms, RoPE and its transpose, and the vocabulary-slice logits (no parameters).

    Attention shard of rank p: query heads p·n_q/D … and the columns of ``wo`` that read them, then the KV
    heads they read; q/k/v biases with their heads' rows. With n_kv < D there are fewer KV heads than ranks:
    rank p holds a copy of KV head p // (D/n_kv), the one all of its query heads read (``kv_replicas`` ranks
    share it; ``kv_comm`` is their group). The K/V parts are the shard's tail, so their gradients are one slice.
    """

    def __init__(self, cfg, comm: AxisComm, kv_comm: AxisComm | None = None):
        D, h, d = comm.size, cfg.dim, cfg.head_dim
        self.cfg, self.comm = cfg, comm
        kv_chunks = min(cfg.n_kv_heads, D)  # distinct KV-head slices (schemes.check_model: D % n_kv == 0 if fewer)
        self.kv_replicas, self.kv_comm = D // kv_chunks, kv_comm
        self.q_heads, self.kv_heads = cfg.n_heads // D, cfg.n_kv_heads // kv_chunks
        q_rows, kv_rows = cfg.n_heads * d, cfg.n_kv_heads * d
        bias = cfg.qkv_bias
        self.attention_layout = PackedLayout((
            Part("attention.wq.weight", (q_rows, h), 0),
            Part("attention.wo.weight", (h, q_rows), 1),
            *([Part("attention.wq.bias", (q_rows,), 0)] if bias else []),
            Part("attention.wk.weight", (kv_rows, h), 0, kv_chunks),
            Part("attention.wv.weight", (kv_rows, h), 0, kv_chunks),
            *([Part("attention.wk.bias", (kv_rows,), 0, kv_chunks),
               Part("attention.wv.bias", (kv_rows,), 0, kv_chunks)] if bias else []),
        ), D)
        self.kv_offset = self.attention_layout.offset("attention.wk.weight")
        self.mlp_layout = PackedLayout((
            Part("feed_forward.w_gate.weight", (cfg.ffn_dim, h), 0),
            Part("feed_forward.w_up.weight", (cfg.ffn_dim, h), 0),
            Part("feed_forward.w_down.weight", (h, cfg.ffn_dim), 1),
        ), D)

    def attention(self, flat: torch.Tensor) -> AttentionShard:
        """Views of a packed attention shard (or of a gradient buffer of the same layout)."""
        named = self.attention_layout.named(flat)
        return AttentionShard(*(named.get(f"attention.{n}") for n in ("wq.weight", "wk.weight", "wv.weight",
                                                                      "wo.weight", "wq.bias", "wk.bias", "wv.bias")))

    @staticmethod
    def rotate(x, cos, sin, out=None):
        """``model.apply_rope`` of x [B, S/D, H, d] (cos/sin [S/D, d]), written into ``out`` (a new tensor if
        None) half by half, without building the rotated copy. With -sin it is RoPE's transpose (backward)."""
        half = x.shape[-1] // 2
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        x1, x2, out1, out2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
        # Rounded as the reference rounds x·cos + rotate_half(x)·sin: the same values in every dtype.
        torch.mul(x1, cos[..., :half], out=out1).sub_(x2 * sin[..., :half])
        torch.mul(x2, cos[..., half:], out=out2).add_(x1 * sin[..., half:])
        return out

    def norm_backward(self, g2, raw2, weight, dweight):
        """Gradient through the per-head q/k norm: g2 [B·S/D, H·d] w.r.t. its output -> w.r.t. its input
        ``raw2`` (the pre-norm projection); adds the weight's gradient to ``dweight`` (float32 [d]).
        Elementwise only: the reference's own ops, differentiated by autograd on these local tokens. The weight
        takes part in float32, so its gradient (a partial sum over tokens, later summed over groups and ranks)
        is summed in float32 too."""
        d = self.cfg.head_dim
        with torch.enable_grad():
            r = raw2.detach().view(-1, d).requires_grad_()
            w = weight.detach().requires_grad_()
            out = head_norm(r, w, self.cfg.norm_eps)
            dr, dw = torch.autograd.grad(out, (r, w), g2.reshape(-1, d).to(out.dtype))
        dweight.add_(dw)
        return dr.view(raw2.shape)

    def _rotated_heads(self, raw, norm, cos, sin, batch: int, out=None):
        """[B·S/D, H·d] projection -> per-head norm (if ``norm``) -> RoPE, token-major [B, S/D, H, d]."""
        y = raw.view(batch, -1, raw.shape[-1] // self.cfg.head_dim, self.cfg.head_dim)
        if norm is not None:
            y = head_norm(y, norm, self.cfg.norm_eps)
        return self.rotate(y, cos, sin, out)

    def project_q(self, x2, w: AttentionShard, norm, cos, sin, batch: int):
        """Local tokens' rotated queries of one head group, token-major [B, S/D, Hq/D, d], and the pre-norm
        projection (None without q norm: backward needs it only for the norm)."""
        raw = _linear_into(x2, w.wq, w.bq)
        return self._rotated_heads(raw, norm, cos, sin, batch), raw if norm is not None else None

    def project_kv(self, x2, w: AttentionShard, norm, cos, sin, batch: int):
        """Local tokens' rotated keys and values of one head group, token-major [2, B, S/D, Hkv/D, d] (the
        all-gather's send buffer, written in place), and the pre-norm key projection (None without k norm)."""
        kv = x2.new_empty(2, batch, x2.shape[0] // batch, self.kv_heads, self.cfg.head_dim)
        raw = _linear_into(x2, w.wk, w.bk)
        self._rotated_heads(raw, norm, cos, sin, batch, out=kv[0])
        _linear_into(x2, w.wv, w.bv, out=kv[1].view(x2.shape[0], -1))
        return kv, raw if norm is not None else None

    def vocab_logits(self, z, w, s):
        """float32 logits [N, V/D] of local tokens against vocabulary shard s; padding rows -> -inf."""
        logits = (z @ w.t()).float()
        first_pad = self.cfg.vocab_size - s * w.shape[0]
        if first_pad < w.shape[0]:
            logits[:, max(first_pad, 0):] = float("-inf")
        return logits


class TSPLayer(nn.Module):
    def __init__(self, attention_shard, mlp_shard, attention_norm, ffn_norm, q_norm=None, k_norm=None, moe=None):
        super().__init__()
        self.attention_norm = nn.Parameter(attention_norm)
        self.attention_shard = nn.Parameter(attention_shard)
        # Qwen3's q/k norm weights act on head_dim, the same for every head: replicated, like the RMSNorms.
        self.q_norm = None if q_norm is None else nn.Parameter(q_norm)
        self.k_norm = None if k_norm is None else nn.Parameter(k_norm)
        self.ffn_norm = nn.Parameter(ffn_norm)
        # A sparse layer holds a mixture of experts (parallel/moe.py) instead of the dense MLP's shard.
        self.mlp_shard = None if mlp_shard is None else nn.Parameter(mlp_shard)
        self.moe = moe


class TSPTransformer(ParallelTransformer):
    """A reference ``Transformer`` split over the ``tsp`` mesh axis; each rank keeps only its shards."""

    scheme = "tsp"

    def __init__(self, model: Transformer, mesh, recompute: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights: WeightSource | None = None):
        super().__init__(model.cfg, mesh)
        self.recompute = recompute
        comm = AxisComm.from_mesh(mesh, "tsp", timeout_s, weight_stream=True)
        cfg, D, p = model.cfg, comm.size, comm.rank
        self.comm = comm
        # Ranks holding copies of one KV head (n_kv < D) sum their gradients over a group of their own.
        kv_comm = comm.blocks(mesh, D // min(cfg.n_kv_heads, D), "kv_replicas")
        self.math = TSPShardMath(cfg, comm, kv_comm)
        # This rank's shards, one reference tensor at a time: the full model is never materialised here.
        weights = weight_source(model, mesh, weights)
        self.embedding_shard = nn.Parameter(vocab_shard(weights, "tok_embeddings.weight", D, p))
        self.layers = nn.ModuleList()
        for i in range(cfg.n_layers):
            prefix = f"layers.{i}."
            qk_norms = [weights.get(f"{prefix}attention.{n}.weight") for n in ("q_norm", "k_norm")] if cfg.qk_norm \
                else [None, None]
            sparse = cfg.is_moe_layer(i)
            self.layers.append(TSPLayer(
                self.math.attention_layout.pack(weights, prefix, p),
                None if sparse else self.math.mlp_layout.pack(weights, prefix, p),
                weights.get(prefix + "attention_norm.weight"), weights.get(prefix + "ffn_norm.weight"), *qk_norms,
                moe=TSPMoE(cfg, comm, weights, prefix) if sparse else None))
        self.norm = nn.Parameter(weights.get("norm.weight"))
        self.output_shard = None
        if not cfg.tie_embeddings:
            self.output_shard = nn.Parameter(vocab_shard(weights, "output.weight", D, p))
        model.to("meta")  # release the full weights, if any: this rank keeps only its shards

    # -- batches ------------------------------------------------------------

    def comms(self):
        return {"tsp": self.comm}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag shard [B, S/D] of a global [B, S] batch."""
        return zigzag.shard(tokens, self.comm.size, self.comm.rank, dim=1)

    def nll_sum_and_count(self, tokens: torch.Tensor, labels: torch.Tensor):
        """Summed cross-entropy and target count over the axis, from this rank's zigzag shard [B, S/D]."""
        return self.head_nll_sum_and_count(self.hidden_states(self.embed(tokens)), labels)

    # The three parts of the model a pipeline stage (parallel/pipeline.py) runs one or more of.

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Local tokens [B, S/D] -> their embeddings [B, S/D, h]."""
        return TSPEmbedding.apply(tokens, self.embedding_shard, self.math)

    def hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer of this model on local tokens x [B, S/D, h] (zigzag positions)."""
        cfg, comm = self.cfg, self.comm
        seq_len = x.shape[1] * comm.size
        positions = zigzag.positions(seq_len, comm.size, comm.rank, device=x.device)
        cos, sin = rope_tables(positions, cfg)
        eps, math = cfg.norm_eps, self.math
        # Cross-layer prefetch of an attention's first shard: in forward the next layer's, in backward this
        # layer's (during its MLP backward). Under recompute a layer's forward runs again inside backward,
        # where a forward prefetch would fetch a shard nobody takes: ``recomputing`` is set there.
        prefetch = ShardPrefetch(comm.weights)
        recomputing = [False]

        @contextlib.contextmanager
        def recompute_context():
            recomputing[0] = True
            try:
                yield
            finally:
                recomputing[0] = False
        layers = list(self.layers)
        stats = self.router_stats = RouterStats(cfg.n_experts) if cfg.moe else None
        # Every layer's norm weights go through one ReplicatedGrad node: their gradients (each rank's tokens'
        # share) are summed in one all-reduce once backward has produced the last of them (layer 0's),
        # instead of the ranks meeting once per weight in the middle of backward.
        norm_names = ["attention_norm", "ffn_norm"] + (["q_norm", "k_norm"] if cfg.qk_norm else [])
        summed = ReplicatedGrad.apply(comm, ACC, *(getattr(layer, n) for layer in layers for n in norm_names))
        norms = [dict(zip(norm_names, summed[i * len(norm_names):])) for i in range(len(layers))]

        def block(x, i):
            layer, norm = layers[i], norms[i]
            h = rms_norm(x, norm["attention_norm"], eps)
            qk_norms = [norm["q_norm"], norm["k_norm"]] if cfg.qk_norm else [None, None]
            # Under recompute, backward runs layer i-1's forward again right after this attention's backward.
            rerun = ((prefetch, ("attention.forward", i - 1), layers[i - 1].attention_shard.detach())
                     if self.recompute and i > 0 else None)
            x = x + TSPAttention.apply(h, layer.attention_shard, cos, sin, math, prefetch, i, *qk_norms, rerun)
            h = rms_norm(x, norm["ffn_norm"], eps)
            ahead = None
            if not recomputing[0] and i + 1 < len(layers):
                ahead = (prefetch, ("attention.forward", i + 1), layers[i + 1].attention_shard.detach())
            behind = (prefetch, ("attention.backward", i), layer.attention_shard.detach())
            if layer.moe is not None:
                return x + layer.moe(h, stats, math, ahead, behind)
            return x + TSPFeedForward.apply(h, layer.mlp_shard, math, ahead, behind, None, self.recompute,
                                            recomputing[0])

        for i in range(len(layers)):
            # Recompute keeps only each layer's input; backward re-runs its forward (and its transfers).
            x = (checkpoint(block, x, i, use_reentrant=False,
                            context_fn=lambda: (contextlib.nullcontext(), recompute_context()))
                 if self.recompute else block(x, i))
        return x

    def head_nll_sum_and_count(self, x: torch.Tensor, labels: torch.Tensor):
        """Final norm, LM head and cross-entropy of local hidden states x [B, S/D, h] against labels [B, S/D]."""
        comm, math = self.comm, self.math
        z = rms_norm(x, replicated_grad(self.norm, comm, ACC), self.cfg.norm_eps).flatten(0, 1)
        head = self.embedding_shard if self.output_shard is None else self.output_shard
        nll = TSPHeadCrossEntropy.apply(z, labels.flatten(), head, math)
        return global_sum_and_count(nll.sum(), labels, comm)

    def sum_router_stats(self, stats):
        return sum_router_stats_over(self.comm, stats.counts, stats.probs, stats.rows)

    # -- full views (for checks, checkpoints, export) -----------------------

    def reference_parts(self, name, local):
        math, p = self.math, self.comm.rank
        if ".moe." in name:
            layer, _, attr = name.partition(".moe.")
            return self.layers[int(layer.split(".")[1])].moe.reference_parts(layer, attr, local)
        if name in ("embedding_shard", "output_shard"):
            ref = "tok_embeddings.weight" if name == "embedding_shard" else "output.weight"
            return [(ref, real_vocab_rows(local, self.cfg.vocab_size, p), {"tsp": 0})]
        layer, _, kind = name.rpartition(".")
        if kind in ("attention_shard", "mlp_shard"):
            layout = math.attention_layout if kind == "attention_shard" else math.mlp_layout
            # A KV-head copy held by several ranks is one of n_kv slices, stored once (comm.sharded_tensor).
            return [(f"{layer}.{part.name}", view,
                     {"tsp": part.shard_dim if layout.replicas(part) == 1 else (part.shard_dim, layout.chunks(part))})
                    for part, view in zip(layout.parts, layout.unpack(local))]
        if kind in ("q_norm", "k_norm"):
            return [(f"{layer}.attention.{kind}.weight", local, {})]  # replicated
        return [(f"{name}.weight", local, {})]  # norms: replicated

    def _full(self, pick) -> dict[str, torch.Tensor]:
        """Gather every rank's shards of ``pick(param)`` (data or grad) into reference-named tensors."""
        math, V = self.math, self.cfg.vocab_size
        gather = lambda t: self.comm.all_gather(t, label="gather_full")
        out = {}
        if self.embedding_shard is not None:  # None: a pipeline stage without the embedding
            out["tok_embeddings.weight"] = gather(pick(self.embedding_shard)).flatten(0, 1)[:V]
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.attention_norm.weight"] = pick(layer.attention_norm)
            if layer.q_norm is not None:
                out[f"layers.{i}.attention.q_norm.weight"] = pick(layer.q_norm)
                out[f"layers.{i}.attention.k_norm.weight"] = pick(layer.k_norm)
            for name, t in math.attention_layout.unpack_gathered(gather(pick(layer.attention_shard))).items():
                out[f"layers.{i}.{name}"] = t
            out[f"layers.{i}.ffn_norm.weight"] = pick(layer.ffn_norm)
            if layer.moe is not None:
                out.update(layer.moe.full(f"layers.{i}", pick))
                continue
            for name, t in math.mlp_layout.unpack_gathered(gather(pick(layer.mlp_shard))).items():
                out[f"layers.{i}.{name}"] = t
        if self.norm is not None:  # None: a pipeline stage without the head
            out["norm.weight"] = pick(self.norm)
        if self.output_shard is not None:
            out["output.weight"] = gather(pick(self.output_shard)).flatten(0, 1)[:V]
        return {name: out[name] for name in reference_shapes(self.cfg) if name in out}  # the reference model's order
