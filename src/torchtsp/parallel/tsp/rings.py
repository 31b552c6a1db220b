"""TSP's rings: the gated MLP, the embedding and the LM head with cross-entropy; shards pass p -> p+1."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import compiled
from ...layers import IGNORE_INDEX, activation, activation_backward, gated, gated_backward, swiglu
from ..shards import vocab_slice_index
from .shard_math import TSPShardMath
from .streams import ACC, GradientRing, add_mm, mm_into, ring_each


class TSPFeedForward(torch.autograd.Function):
    """y = swiglu(x) for local tokens x; packed (w_gate, w_up, w_down) shards pass around a ring.

    Saves (default) the gate and up projections of the local tokens for every shard; backward passes the
    shards around again and recomputes only the elementwise silu and product. ``prefetch`` (a ``Prefetch``)
    starts the broadcast of the next attention's shard 0 during the last ring step (forward);
    ``prefetch_backward`` the same for this layer's attention in backward.

    ``recompute``: save the input only; backward projects gate and up of each shard again as the shard passes
    by, so the forward's GEMMs run again inside backward's ring and the weights go around once in backward,
    not twice. ``rerun``: this is the layer's forward run again by ``checkpoint`` inside backward, which wants
    only the saved input back (the block's output is discarded): nothing to compute, the output is left zero.
    """

    @staticmethod
    def forward(ctx, x, shard, shard_math: TSPShardMath, prefetch=None, prefetch_backward=None, layout=None,
                recompute=False, rerun=False):
        # ``layout``: the packed shards' layout, if not the dense MLP's (a mixture of experts' shared expert).
        ctx.shard_math, ctx.prefetch_backward = shard_math, prefetch_backward
        ctx.layout = layout or shard_math.mlp_layout
        if recompute and rerun:
            ctx.save_for_backward(x, shard)
            return torch.zeros_like(x)
        comm, D = shard_math.comm, shard_math.comm.size
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
                prefetch.issue()
            wg, wu, wd = layout.unpack(w)
            gate, up = gate_all[s % shards], up_all[s % shards]
            torch.mm(x2, wg.t(), out=gate)
            torch.mm(x2, wu.t(), out=up)
            y = add_mm(y, gated(gate, up, shard_math.cfg.mlp_activation), wd.t())
        ctx.save_for_backward(x, shard, *((gate_all, up_all) if keep else ()))
        return y.view(B, n, h).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, shard, *kept = ctx.saved_tensors
        shard_math, prefetch, layout = ctx.shard_math, ctx.prefetch_backward, ctx.layout
        comm, D = shard_math.comm, shard_math.comm.size
        B, n, h = x.shape
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
        dx = None
        grads = GradientRing(comm, "mlp.grad")
        for k, (s, w) in enumerate(ring_each(comm.weights, shard, "mlp.backward")):
            comm.mark(("mlp.backward", s))
            if prefetch is not None and k == max(D - 2, 0):
                prefetch.issue()
            wg, wu, wd = layout.unpack(w)
            gate, up = (kept[0][s], kept[1][s]) if kept else (x2 @ wg.t(), x2 @ wu.t())
            dw = torch.empty(layout.numel, dtype=ACC, device=x.device)
            dwg, dwu, dwd = layout.unpack(dw)
            kind = shard_math.cfg.mlp_activation
            if compiled.enabled():  # the elementwise part as one compiled kernel (one more buffer alive at once)
                hidden, dgate, dup = gated_backward(dy2 @ wd, gate, up, kind)
                mm_into(dwd, dy2.t(), hidden)
                hidden = None
            else:  # eager: act * up freed before dhidden is made (the memory model counts these buffers)
                act = activation(gate, kind)
                mm_into(dwd, dy2.t(), act * up)
                dhidden = dy2 @ wd
                dgate = activation_backward(dhidden * up, gate, kind)  # the kernel autograd runs for the activation
                dup = dhidden * act
            dx = add_mm(add_mm(dx, dgate, wg), dup, wu)
            mm_into(dwg, dgate.t(), x2)
            mm_into(dwu, dup.t(), x2)
            grads.add(dw)
            dw = dwg = dwu = dwd = None  # travels on with the ring: not bound here when the next one is made
        return dx.view(B, n, h).to(x.dtype), grads.result(shard.dtype), None, None, None, None, None, None


# ---------------------------------------------------------------- embedding and LM head


@torch.no_grad()
def ring_mlp(h: torch.Tensor, shard: torch.Tensor, layout, comm, label: str, kind: str = "silu") -> torch.Tensor:
    """The gated MLP of tokens h with its packed shards (``layout``) travelling the ring, summed in h's dtype:
    the inference form of ``TSPFeedForward`` (no autograd); ``kind``: the model's ``mlp_activation``."""
    out = torch.zeros_like(h)
    for _, w in ring_each(comm, shard, label):
        out += swiglu(h, *layout.unpack(w), kind)
    return out


class TSPEmbedding(torch.autograd.Function):
    """Rows of the local token ids, picked from vocabulary shards as they pass around the ring."""

    @staticmethod
    def forward(ctx, ids, shard, shard_math: TSPShardMath):
        comm, rows = shard_math.comm, shard.shape[0]
        x = shard.new_zeros(*ids.shape, shard.shape[1])
        for s, w in ring_each(comm.weights, shard, "embedding.forward"):
            comm.mark(("embedding.forward", s))
            local, hit = vocab_slice_index(ids, rows, s)
            x = torch.where(hit.unsqueeze(-1), F.embedding(local, w), x)
        ctx.save_for_backward(ids)
        ctx.shard_math, ctx.shard_shape, ctx.dtype = shard_math, shard.shape, shard.dtype
        return x

    @staticmethod
    def backward(ctx, dx):
        (ids,) = ctx.saved_tensors
        comm, rows = ctx.shard_math.comm, ctx.shard_shape[0]
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
    def forward(ctx, z, labels, shard, shard_math: TSPShardMath):
        comm, rows = shard_math.comm, shard.shape[0]
        lse = z.new_full((z.shape[0],), float("-inf"), dtype=torch.float32)
        target = torch.zeros_like(lse)
        for s, w in ring_each(comm.weights, shard, "head.forward"):
            comm.mark(("head.forward", s))
            logits = shard_math.vocab_logits(z, w, s)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            local, hit = vocab_slice_index(labels, rows, s)
            target = torch.where(hit, logits.gather(1, local.unsqueeze(1)).squeeze(1), target)
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(z, labels, shard, lse)
        ctx.shard_math = shard_math
        return torch.where(valid, lse - target, 0.0)

    @staticmethod
    def backward(ctx, dnll):
        z, labels, shard, lse = ctx.saved_tensors
        shard_math, rows = ctx.shard_math, shard.shape[0]
        comm = shard_math.comm
        scale = torch.where(labels != IGNORE_INDEX, dnll, 0.0)[:, None]
        dz = None
        grads = GradientRing(comm, "head.grad")
        for s, w in ring_each(comm.weights, shard, "head.backward"):
            comm.mark(("head.backward", s))
            dlogits = torch.exp(shard_math.vocab_logits(z, w, s) - lse[:, None])  # softmax slice
            local, hit = vocab_slice_index(labels, rows, s)
            dlogits.scatter_add_(1, local.unsqueeze(1), -hit.to(dlogits.dtype).unsqueeze(1))  # minus one-hot
            dlogits = (dlogits * scale).to(z.dtype)
            dz = add_mm(dz, dlogits, w)
            grads.add(dlogits.t() @ z)
        return dz.to(z.dtype), None, grads.result(shard.dtype), None
