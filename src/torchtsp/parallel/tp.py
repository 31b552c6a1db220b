"""TP: Megatron-style tensor parallelism over the ``tp`` mesh axis (T ranks), optionally with Megatron-SP.

Every rank holds 1/T of every weight matrix and computes on every token:

* column-parallel ``wq, wk, wv`` (a contiguous group of n_heads/T query and n_kv_heads/T KV heads, the
  same slicing as TSP) and ``w_gate, w_up`` (ffn/T rows): the local heads / FFN slice need no
  communication until the row-parallel ``wo`` and ``w_down`` (the matching columns), whose partial
  outputs are summed over the axis;
* vocabulary-parallel embedding and LM head (V padded with zero rows to a multiple of T): the embedding
  looks up only in-range ids and sums over the axis; the LM head produces logits of the local vocabulary
  slice only, and the cross-entropy combines per-rank log-sum-exps and target logits (never [N, V]);
* RMSNorm weights replicated and identical;
* with fewer KV heads than ranks (n_kv_heads < T, T a multiple of n_kv_heads, as Megatron and vLLM do it),
  rank r holds a copy of KV head r // (T/n_kv), the one all of its n_heads/T query heads read. Each copy's
  gradient covers its own query heads only, so the copies' wk/wv (and bk/bv) gradients are summed over the
  T/n_kv ranks sharing the head (one float32 all-reduce per layer in backward, ``kv_comm``); dX needs
  nothing extra (each rank's partial already is its query heads' share).

Communication sits in the autograd Functions below, each a conjugate pair (forward op / backward op):

=========================  ================================  =================================
                           forward                           backward
=========================  ================================  =================================
ColumnParallelLinear       identity (TP) / all-gather (SP)   all-reduce (TP) / reduce-scatter (SP)
RowParallelLinear          all-reduce (TP) / reduce-scatter  identity (TP) / all-gather (SP)
VocabParallelEmbedding     all-reduce / reduce-scatter       identity / all-gather
VocabParallelCrossEntropy  all-gather of [3, N] statistics   none
=========================  ================================  =================================

The "copy to TP region" operator is fused into ``ColumnParallelLinear`` (and the "reduce from TP region"
one into ``RowParallelLinear``) rather than standing alone, for three reasons: with sequence parallelism
the linear saves only the LOCAL input and re-gathers it in backward (Megatron's re-gather, so autograd
never holds a [B, S, h] gathered activation); the backward all-reduce / reduce-scatter of dX is issued
asynchronously and overlaps the weight-gradient GEMMs; and the forward all-reduce can run in place on the
GEMM's fresh output without an autograd-visible in-place op on somebody else's tensor.

With ``sequence_parallel=True`` (Megatron-SP) the residual stream between the linears is sharded along the
sequence in contiguous chunks: rank r holds tokens [r·S/T, (r+1)·S/T) of every sequence ([B, S/T, h]).
Norms run on local tokens; their weights' gradients are summed over the axis (``ReplicatedGrad``). The
gathered sequence is assembled with one copy when B > 1 (chunks of every sequence interleave); B = 1, the
usual long-sequence case, is copy-free.

Per-layer forward traffic: two all-reduces of [B, S, h] (TP) or two all-gathers plus two reduce-scatters of
[B, S/T, h] (SP): 4·B·S·h·(T-1)/T elements received either way (``torchtsp.analysis``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..layers import (
    IGNORE_INDEX,
    SANDWICH_NORMS,
    Placement,
    attend_with_sinks,
    gated,
    gated_down_backward,
    norm,
    qkv_heads,
    scale_embeddings,
)
from ..model import Transformer
from ..recompute import NONE, SELECTIVE, recompute_policy
from ..weights import WeightSource
from .base import LayerInputs, ParallelTransformer, ReplicatedGrad, ShardView, replicated_grad, weight_source
from .moe import tp_moe
from .params import layer_params
from .shards import real_vocab_rows, vocab_shard, vocab_slice_index

# A layer's K/V projection parameters: copied on T/n_kv ranks when n_kv_heads < T.
KV_PARAMS = ("wk", "wv", "bk", "bv")

# ---------------------------------------------------------------- sequence sharding ([B, S/T, ...] <-> [B, S, ...])


def gather_seq(comm: AxisComm, x: torch.Tensor, async_op: bool = False, label: str = "tp.gather"):
    """All-gather the contiguous sequence shards [B, S/T, ...] into [B, S, ...] (async: a finisher)."""
    pending = comm.all_gather(x, async_op=True, label=label)
    finish = lambda: pending.wait().movedim(0, 1).flatten(1, 2)  # a view when B == 1
    return finish if async_op else finish()


def scatter_seq(comm: AxisComm, y: torch.Tensor, async_op: bool = False, label: str = "tp.reduce_scatter"):
    """Sum [B, S, ...] over the axis and keep this rank's sequence chunk [B, S/T, ...]."""
    per_rank = y.unflatten(1, (comm.size, -1)).movedim(1, 0)  # [T, B, S/T, ...]; contiguous when B == 1
    return comm.reduce_scatter(per_rank.contiguous(), async_op=async_op, label=label)


def sum_partials(comm: AxisComm, y: torch.Tensor, sequence_parallel: bool, label: str, async_op: bool = False):
    """Sum per-rank partial results over the axis: all of it (all-reduce, TP), or this rank's
    sequence chunk (reduce-scatter, SP)."""
    if sequence_parallel:
        return scatter_seq(comm, y, async_op=async_op, label=label)
    return comm.all_reduce(y, async_op=async_op, label=label)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [tokens, n] (a view for contiguous tensors)."""
    return t.reshape(-1, t.shape[-1])


# ---------------------------------------------------------------- conjugate autograd Functions


class ColumnParallelLinear(torch.autograd.Function):
    """``(x_full @ w.T for w in weights)`` with x_full = x (TP) or x all-gathered along the sequence (SP).

    Backward: dX = sum_i dY_i @ W_i, all-reduced (TP) or reduce-scattered (SP) while the weight-gradient
    GEMMs run. Saves only the local x; with SP the full input is re-gathered in backward, overlapped with
    the dX GEMMs.
    """

    @staticmethod
    def forward(ctx, x, comm: AxisComm, sequence_parallel: bool, *weights):
        x_full = gather_seq(comm, x, label="tp.column.gather") if sequence_parallel else x
        ctx.save_for_backward(x, *weights)
        ctx.comm, ctx.sequence_parallel = comm, sequence_parallel
        return tuple(F.linear(x_full, w) for w in weights)

    @staticmethod
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors
        comm, sp = ctx.comm, ctx.sequence_parallel
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        # Re-gather the input first, so the transfer runs behind the dX GEMMs.
        regather = gather_seq(comm, x, async_op=True, label="tp.column.regather") if sp and any(need_dw) else None
        full_shape = dys[0].shape[:-1]  # [B, S] (the whole sequence, also with SP)
        dys = [_rows(dy) for dy in dys]
        reducing = None
        if need_dx:
            dx = dys[0] @ weights[0]
            for dy, w in zip(dys[1:], weights[1:]):
                dx.addmm_(dy, w)
            dx = dx.view(*full_shape, -1)
            # In flight while the weight gradients are computed.
            reducing = sum_partials(comm, dx, sp, "tp.column.grad", async_op=True)
        dws = [None] * len(weights)
        if any(need_dw):
            x_rows = _rows(regather() if sp else x)
            dws = [dy.t() @ x_rows if need else None for dy, need in zip(dys, need_dw)]
        return (reducing.wait() if reducing is not None else None), None, None, *dws


class RowParallelLinear(torch.autograd.Function):
    """``x @ w.T`` on the local input slice, summed over the axis: all-reduce (TP) or reduce-scatter to
    sequence chunks (SP). Backward: dY is the same on every rank (TP) or all-gathered (SP).

    With ``up`` (selective recompute of the MLP), x is the gate and the input is ``gated(x, up, kind)``,
    recomputed in backward from the saved gate and up (``layers.gated_down_backward``), not saved."""

    @staticmethod
    def forward(ctx, x, w, comm: AxisComm, sequence_parallel: bool, up=None, kind: str = "silu"):
        ctx.save_for_backward(x, w, up)
        ctx.comm, ctx.sequence_parallel, ctx.kind = comm, sequence_parallel, kind
        local = F.linear(x if up is None else gated(x, up, kind), w)
        return sum_partials(comm, local, sequence_parallel, "tp.row")  # fresh: reduced in place

    @staticmethod
    def backward(ctx, dy):
        x, w, up = ctx.saved_tensors
        if ctx.sequence_parallel:
            dy = gather_seq(ctx.comm, dy.contiguous(), label="tp.row.grad_gather")
        needs = ctx.needs_input_grad
        if up is not None:
            dgate, dup, dw = gated_down_backward(dy, x, up, w, ctx.kind, (needs[0], needs[4], needs[1]))
            return dgate, dw, None, None, dup, None
        dy_rows = _rows(dy)
        dx = (dy_rows @ w).view(*x.shape) if needs[0] else None
        dw = dy_rows.t() @ _rows(x) if needs[1] else None
        return dx, dw, None, None, None, None


class VocabParallelEmbedding(torch.autograd.Function):
    """Rows of the ids in this rank's vocabulary slice (zeros elsewhere), summed over the axis: all-reduce
    (TP) or reduce-scatter to sequence chunks (SP). Saves only the (local) ids."""

    @staticmethod
    def forward(ctx, ids, w, comm: AxisComm, sequence_parallel: bool):
        rows = w.shape[0]
        local, hit = vocab_slice_index(ids, rows, comm.rank)
        outside = ~hit
        x = F.embedding(local, w).masked_fill_(outside.unsqueeze(-1), 0.0)
        ctx.save_for_backward(local, outside)
        ctx.comm, ctx.sequence_parallel, ctx.rows = comm, sequence_parallel, rows
        return sum_partials(comm, x, sequence_parallel, "tp.embedding")

    @staticmethod
    def backward(ctx, dx):
        local, outside = ctx.saved_tensors
        if ctx.sequence_parallel:
            dx = gather_seq(ctx.comm, dx.contiguous(), label="tp.embedding.grad_gather")
        dx = dx.masked_fill(outside.unsqueeze(-1), 0.0)
        # The kernel the reference embedding's backward runs (out-of-slice ids add zeros to a clamped row).
        dw = torch.ops.aten.embedding_dense_backward(dx, local, ctx.rows, -1, False)
        return None, dw, None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token NLL [N] from vocabulary-sharded logits [N, V_pad/T] (this rank's slice only).

    Each rank reduces its slice to (max m_r, sum of exp(logit - m_r), target logit or 0); one all-gather
    of these [3, N] statistics gives the global log-sum-exp and target logit on every rank. Saves the
    local softmax slice (float32, computed in place) for backward: dlogits = (softmax - onehot)·dnll.
    Padding columns (ids >= V) are -inf; a slice of padding only contributes nothing.
    """

    @staticmethod
    def forward(ctx, logits, labels, comm: AxisComm, vocab_size: int):
        N, cols = logits.shape
        start = comm.rank * cols
        real = min(cols, vocab_size - start)  # may be <= 0 for a tiny vocabulary
        probs = logits.to(torch.float32, copy=True)
        if real < cols:
            probs[:, max(real, 0):] = float("-inf")
        local, hit = vocab_slice_index(labels, cols, comm.rank)  # labels are < vocab_size: never a padding column
        target = torch.where(hit, probs.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
        m = probs.amax(dim=1).clamp_(min=torch.finfo(torch.float32).min)  # finite even for padding-only slices
        sum_exp = probs.sub_(m.unsqueeze(1)).exp_().sum(dim=1)
        stats = comm.all_gather(torch.stack([m, sum_exp, target]), label="tp.loss")  # [T, 3, N]
        m_all, s_all, t_all = stats.unbind(1)
        m_max = m_all.amax(dim=0)
        lse = m_max + (s_all * (m_all - m_max).exp()).sum(dim=0).log()
        probs.mul_((m - lse).exp().unsqueeze(1))  # exp(logit - m_r) -> exp(logit - lse): the softmax slice
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(probs, local, hit, valid)
        ctx.dtype = logits.dtype
        return torch.where(valid, lse - t_all.sum(dim=0), 0.0)

    @staticmethod
    def backward(ctx, dnll):
        probs, local, hit, valid = ctx.saved_tensors
        scale = torch.where(valid, dnll, 0.0)
        dlogits = probs * scale.unsqueeze(1)
        dlogits.scatter_add_(1, local.unsqueeze(1), torch.where(hit, -scale, 0.0).unsqueeze(1))
        return dlogits.to(ctx.dtype), None, None, None


# ---------------------------------------------------------------- the model

class TPLayer(nn.Module):
    """One decoder block's parameters on this rank (see ``LAYER_PARAMS``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in tensors.items():
            setattr(self, name, nn.Parameter(t))


class TPTransformer(ParallelTransformer):
    """A reference ``Transformer`` split over the ``tp`` mesh axis; each rank keeps only its shards."""

    scheme = "tp"

    def __init__(self, model: Transformer, mesh, sequence_parallel: bool = False, recompute: str | bool = NONE,
                 timeout_s: float = DEFAULT_TIMEOUT_S, weights: WeightSource | None = None):
        super().__init__(model.cfg, mesh)
        self.tp = AxisComm.from_mesh(mesh, "tp", timeout_s)
        self.sequence_parallel = bool(sequence_parallel)
        self.recompute = recompute_policy(recompute)
        # Ranks holding copies of one KV head (n_kv < T; Layout checked T % n_kv == 0) sum their gradients.
        self.kv_replicas = self.tp.size // min(model.cfg.n_kv_heads, self.tp.size)
        self.kv_comm = self.tp.blocks(mesh, self.kv_replicas, "kv_replicas")
        self._shard(model, self.tp, weight_source(model, mesh, weights))

    def _slices(self, attr: str) -> int:
        """Distinct slices of a layer parameter over the tp ranks (fewer than T: copies of KV heads)."""
        return self.tp.size // self.kv_replicas if attr in KV_PARAMS else self.tp.size

    def _shard(self, model: Transformer, tp: AxisComm, weights: WeightSource) -> None:
        """Materialise this rank's shards one reference tensor at a time."""
        cfg, T, p = model.cfg, tp.size, tp.rank
        self.embedding_shard = nn.Parameter(vocab_shard(weights, "tok_embeddings.weight", T, p))
        slice_of = lambda attr: p * self._slices(attr) // T  # a KV-head copy: the head of this rank's queries
        self.layers = nn.ModuleList(
            TPLayer({attr: weights.get(f"layers.{i}.{ref}", dim, self._slices(attr), slice_of(attr))
                     for attr, (ref, dim) in layer_params(cfg, i).items()})
            for i in range(cfg.n_layers))
        self.norm = nn.Parameter(weights.get("norm.weight"))
        self.output_shard = None if cfg.tie_embeddings else nn.Parameter(vocab_shard(weights, "output.weight", T, p))
        model.to("meta")  # release the full weights, if any: this rank keeps only its shards

    # -- hooks that TP x SP (tp_sp.py) overrides ---------------------------------

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        """A tp-sharded weight as used in compute (every rank already sees every token: no extra reduction)."""
        return w

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A replicated norm weight: with SP each rank normalises its own tokens, so gradients are summed."""
        return replicated_grad(w, self.tp) if self.sequence_parallel else w

    def attention_positions(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The whole sequence, also with SP (whose x holds a contiguous chunk of it): every rank's attention
        computes every position."""
        seq_len = x.shape[1] * (self.tp.size if self.sequence_parallel else 1)
        return torch.arange(seq_len, device=x.device), seq_len

    def _attend(self, q, k, v, mask, sinks=None):
        """Causal attention of the local heads over the whole sequence (with their sinks), as the reference does it."""
        return attend_with_sinks(q, k, v, mask, sinks)

    def _sum_and_count(self, nll_sum: torch.Tensor, labels: torch.Tensor):
        # Every rank holds every token and the same NLL: the local sum and count are the global ones.
        return nll_sum, (labels != IGNORE_INDEX).sum().to(nll_sum.dtype)

    # -- forward -------------------------------------------------------------------

    def comms(self):
        return {"tp": self.tp}

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """The global batch, unchanged: every TP rank computes on every token."""
        return tokens

    def placement(self, inputs: LayerInputs, state=None) -> Placement:
        """One decoder block on this rank's activations ([B, S, h]; [B, S/T, h] with SP): column- and row-parallel
        attention and MLP (a sparse layer: every expert's FFN slice on every token, adding its router statistics)."""
        cfg, tp = self.cfg, self.tp
        layer = self.layers[inputs.spec.index]
        if inputs.spec.moe:
            mlp = lambda h: tp_moe(h, layer, self.cfg, tp, inputs.stats)
        else:
            mlp = lambda h: self._mlp(layer, h)
        attention = lambda h, _cache: self._attention(layer, h, inputs.cos, inputs.sin, inputs.mask)
        # The norm weights are wrapped when used, not before: the autograd nodes keep the order they had.
        normed = lambda name: lambda x: norm(x, self._norm_weight(getattr(layer, name)), cfg)
        outer = [normed(n) for n in SANDWICH_NORMS] if cfg.sandwich_norm else [None, None]
        return Placement(normed("attention_norm"), attention, normed("ffn_norm"), mlp, *outer)

    def _attention(self, layer: TPLayer, h, cos, sin, mask) -> torch.Tensor:
        """Column-parallel q/k/v of this rank's heads, attention, row-parallel ``wo`` summed over the axis."""
        cfg, tp, sp, w = self.cfg, self.tp, self.sequence_parallel, self._weight
        kv = [w(t) for t in self._kv_params(layer)]  # wk, wv (, bk, bv)
        q, k, v = ColumnParallelLinear.apply(h, tp, sp, w(layer.wq), *kv[:2])
        if cfg.qkv_bias:  # this rank's heads' biases; every rank sees every token, so no extra reduction
            q, k, v = q + w(layer.bq), k + kv[2], v + kv[3]
        # q/k norm: replicated weights applied to this rank's heads only, so their gradients are summed over tp.
        norms = [w(replicated_grad(n, tp)) for n in (layer.q_norm, layer.k_norm)] if cfg.qk_norm else []
        q, k, v = qkv_heads(q, k, v, cfg, cos, sin, *norms)
        B, S = q.shape[:2]
        sinks = w(layer.sinks) if cfg.attention_sinks else None  # this rank's heads' sinks
        out = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, sinks)
        y = RowParallelLinear.apply(out.transpose(1, 2).reshape(B, S, -1), w(layer.wo), tp, sp)
        # GPT-OSS's output bias: replicated and added once, after the sum (its gradient summed like a norm's).
        return y + self._norm_weight(layer.bo) if cfg.o_bias else y

    def _mlp(self, layer: TPLayer, h) -> torch.Tensor:
        """Column-parallel gate/up of this rank's FFN slice, row-parallel ``w_down`` summed over the axis."""
        tp, sp, w = self.tp, self.sequence_parallel, self._weight
        gate, up = ColumnParallelLinear.apply(h, tp, sp, w(layer.w_gate), w(layer.w_up))
        if self.recompute == SELECTIVE:  # the hidden state recomputed in backward from the saved gate and up
            return RowParallelLinear.apply(gate, w(layer.w_down), tp, sp, up, self.cfg.mlp_activation)
        return RowParallelLinear.apply(gated(gate, up, self.cfg.mlp_activation), w(layer.w_down), tp, sp)

    def _kv_params(self, layer: TPLayer) -> list[torch.Tensor]:
        """wk, wv (and bk, bv): with copied KV heads, their gradients summed over the copies in one float32
        all-reduce (each copy's covers only its own rank's query heads)."""
        params = [getattr(layer, name) for name in KV_PARAMS[:4 if self.cfg.qkv_bias else 2]]
        if self.kv_replicas == 1:
            return params
        return list(ReplicatedGrad.apply(self.kv_comm, torch.float32, *params))

    # The three parts of the model a pipeline stage (parallel/pipeline.py) runs one or more of.

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [B, S] -> their embeddings [B, S, h] ([B, S/T, h] with SP)."""
        x = VocabParallelEmbedding.apply(tokens, self._weight(self.embedding_shard), self.tp, self.sequence_parallel)
        return scale_embeddings(x, self.cfg)

    def head_nll_sum_and_count(self, x: torch.Tensor, labels: torch.Tensor):
        """Final norm, LM head and cross-entropy of this rank's hidden states against its labels."""
        cfg, tp, sp = self.cfg, self.tp, self.sequence_parallel
        z = norm(x, self._norm_weight(self.norm), cfg)
        head = self.embedding_shard if self.output_shard is None else self.output_shard
        (logits,) = ColumnParallelLinear.apply(z, tp, sp, self._weight(head))  # [B, S, V_pad/T]
        nll = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), tp, cfg.vocab_size)
        return self._sum_and_count(nll.sum(), labels)

    # -- full views (for checks, checkpoints, export) -------------------------------

    def reference_parts(self, name, local):
        if name in ("embedding_shard", "output_shard"):
            ref = "tok_embeddings.weight" if name == "embedding_shard" else "output.weight"
            return [(ref, real_vocab_rows(local, self.cfg.vocab_size, self.tp.rank), {"tp": 0})]
        if name == "norm":
            return [("norm.weight", local, {})]
        prefix, _, attr = name.rpartition(".")  # layers.<i>.<attr>
        ref, dim = layer_params(self.cfg, int(prefix.split(".")[1]))[attr]
        slices = self._slices(attr)  # a KV head copied on several ranks is one of n_kv slices, stored once
        return [(f"{prefix}.{ref}", local,
                 {} if dim is None else {"tp": dim if slices == self.tp.size else (dim, slices)})]

    def shard_view(self) -> ShardView:
        """This rank's slices under ``layer_params``' names (a sparse layer's expert slices instead of its MLP)."""
        if self.sequence_parallel:
            raise ValueError("inference runs TP without sequence parallelism; parallelize with "
                             "sequence_parallel=False")
        layers = tuple({name: getattr(layer, name).detach() for name in layer_params(self.cfg, i)}
                       for i, layer in enumerate(self.layers))
        head = self.embedding_shard if self.output_shard is None else self.output_shard
        return ShardView(self.cfg, self.tp, layers, self.embedding_shard.detach(), head.detach(), self.norm.detach())

    def _full(self, pick) -> dict[str, torch.Tensor]:
        """Gather every rank's shards of ``pick(param)`` (data or grad) into reference-named tensors."""
        V = self.cfg.vocab_size
        gather = lambda t, dim, every=1: pick(t) if dim is None else torch.cat(
            self.tp.all_gather(pick(t).contiguous(), label="gather_full").unbind(0)[::every], dim=dim)
        out = {}
        if self.embedding_shard is not None:  # None: a pipeline stage without the embedding
            out["tok_embeddings.weight"] = gather(self.embedding_shard, 0)[:V]
        for i, layer in enumerate(self.layers):
            for attr, (ref, dim) in layer_params(self.cfg, i).items():
                # A copied KV head once, from the first rank of its group.
                out[f"layers.{i}.{ref}"] = gather(getattr(layer, attr), dim, self.tp.size // self._slices(attr))
        if self.norm is not None:
            out["norm.weight"] = pick(self.norm)
        if self.output_shard is not None:
            out["output.weight"] = gather(self.output_shard, 0)[:V]
        return out
