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

The next shard is always requested before the current one is used (double buffering),
so transfers run behind compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..distributed import zigzag
from ..distributed.attention import gather_kv, scatter_kv_grad, zigzag_causal_attention
from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..model import IGNORE_INDEX, Transformer, apply_rope, expand_kv_heads, rms_norm, rope_cos_sin, swiglu
from ..weights import WeightSource
from .base import ParallelTransformer, ReplicatedGrad, global_sum_and_count, weight_source
from .shards import PackedLayout, Part, real_vocab_rows, vocab_shard

WEIGHT_TAG, GRAD_TAG = 0, 1  # separate point-to-point streams for weights and travelling gradients


# ---------------------------------------------------------------- weight streams


def broadcast_each(comm: AxisComm, own: torch.Tensor, label: str):
    """Yield (j, rank j's shard) for j = 0..D-1; shard j+1's broadcast is in flight while j is used."""
    buffers = [torch.empty_like(own) for _ in range(min(comm.size - 1, 2))]

    def issue(j):
        buf = own if j == comm.rank else buffers[j % len(buffers)]
        return comm.broadcast(buf, src=j, async_op=True, label=(label, j))

    pending = issue(0)
    for j in range(comm.size):
        shard = pending.wait()
        if j + 1 < comm.size:
            pending = issue(j + 1)
        yield j, shard


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
    """The gradient accumulator of the shard passing by travels with it around the ring.

    Call ``add`` once per ring step with this rank's contribution to the current shard; after the
    last step ``result()`` is this rank's own shard's gradient, summed over every rank.
    """

    def __init__(self, comm: AxisComm, label: str):
        self.comm, self.label, self.pending = comm, label, None

    def add(self, contribution: torch.Tensor) -> None:
        acc = contribution if self.pending is None else self.pending.wait().add_(contribution)
        self.pending = self.comm.ring_shift(acc, async_op=True, tag=GRAD_TAG, label=self.label)

    def result(self) -> torch.Tensor:
        return self.pending.wait()


def _vjp(fn, inputs, grad_output):
    """Recompute ``fn(*inputs)`` with autograd and return its vector-Jacobian product for each input."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, grad_output)


# ---------------------------------------------------------------- attention


class TSPAttention(torch.autograd.Function):
    """y = attention(x) for local tokens x [B, S/D, h]; weights broadcast head group by head group."""

    @staticmethod
    def forward(ctx, x, shard, cos, sin, block: TSPBlocks):
        comm = block.comm
        y = torch.zeros_like(x)
        for j, w in broadcast_each(comm, shard, "attention.forward"):
            comm.mark(("attention.forward", j))
            kv_full = gather_kv(comm, block.project_kv(x, w, cos, sin), async_op=True)
            q = block.project_q(x, w, cos, sin)  # while the K/V gather is in flight
            y += block.attend(q, kv_full(), w)
        ctx.save_for_backward(x, shard, cos, sin)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, dy):
        x, shard, cos, sin = ctx.saved_tensors
        block, comm = ctx.block, ctx.block.comm
        dx = torch.zeros_like(x)
        dshard, reducing = None, []  # (owner, pending reduce) of partial gradients in flight

        def settle(keep: int):
            """Wait for reductions until at most ``keep`` remain in flight; keep the one owned here."""
            nonlocal dshard
            while len(reducing) > keep:
                owner, pending = reducing.pop(0)
                result = pending.wait()
                if owner == comm.rank:
                    dshard = result

        for j, w in broadcast_each(comm, shard, "attention.backward"):
            comm.mark(("attention.backward", j))
            with torch.enable_grad():
                x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
                kv = block.project_kv(x_, w_, cos, sin)
                gathering = gather_kv(comm, kv.detach(), async_op=True)
                q = block.project_q(x_, w_, cos, sin)
                kv_full = gathering().requires_grad_()
                dx_q, dw_q, dkv_full = torch.autograd.grad(
                    block.attend(q, kv_full, w_), (x_, w_, kv_full), dy, retain_graph=True)
                dkv = scatter_kv_grad(comm, dkv_full)  # dK/dV of own tokens, summed over every rank's queries
                dx_kv, dw_kv = torch.autograd.grad(kv, (x_, w_), dkv)
            dx += dx_q + dx_kv
            # Every rank's partial gradient of head group j goes to its owner j; keep at most two in flight.
            # (One reduce-scatter of all groups at the end moves the same bytes but would hold every
            # group's partial gradient, the full layer's worth, at once: the 1/D promise forbids it.)
            reducing.append((j, comm.reduce(dw_q + dw_kv, dst=j, async_op=True, label=("attention.backward", j))))
            settle(keep=1)
        settle(keep=0)
        return dx, dshard, None, None, None


# ---------------------------------------------------------------- gated MLP


class TSPFeedForward(torch.autograd.Function):
    """y = swiglu(x) for local tokens x; packed (w_gate, w_up, w_down) shards pass around a ring."""

    @staticmethod
    def forward(ctx, x, shard, block: TSPBlocks):
        comm = block.comm
        y = torch.zeros_like(x)
        for s, w in ring_each(comm, shard, "mlp.forward"):
            comm.mark(("mlp.forward", s))
            y += swiglu(x, *block.mlp_layout.unpack(w))
        ctx.save_for_backward(x, shard)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, dy):
        x, shard = ctx.saved_tensors
        block, comm = ctx.block, ctx.block.comm
        dx = torch.zeros_like(x)
        grads = GradientRing(comm, "mlp.grad")
        for s, w in ring_each(comm, shard, "mlp.backward"):
            comm.mark(("mlp.backward", s))
            dx_s, dw_s = _vjp(lambda x_, w_: swiglu(x_, *block.mlp_layout.unpack(w_)), (x, w), dy)
            dx += dx_s
            grads.add(dw_s)
        return dx, grads.result(), None


# ---------------------------------------------------------------- embedding and LM head


class TSPEmbedding(torch.autograd.Function):
    """Rows of the local token ids, picked from vocabulary shards as they pass around the ring."""

    @staticmethod
    def forward(ctx, ids, shard, block: TSPBlocks):
        comm, rows = block.comm, shard.shape[0]
        x = shard.new_zeros(*ids.shape, shard.shape[1])
        for s, w in ring_each(comm, shard, "embedding.forward"):
            comm.mark(("embedding.forward", s))
            local = ids - s * rows
            hit = (local >= 0) & (local < rows)
            x[hit] = w[local[hit]]
        ctx.save_for_backward(ids)
        ctx.block, ctx.shard_shape = block, shard.shape
        return x

    @staticmethod
    def backward(ctx, dx):
        (ids,) = ctx.saved_tensors
        comm, rows = ctx.block.comm, ctx.shard_shape[0]
        grads = GradientRing(comm, "embedding.grad")
        for k in range(comm.size):  # only gradients travel: the lookup needs no weights
            s = (comm.rank - k) % comm.size
            local = ids - s * rows
            hit = (local >= 0) & (local < rows)
            grads.add(dx.new_zeros(ctx.shard_shape).index_add_(0, local[hit], dx[hit]))
        return None, grads.result(), None


class TSPHeadCrossEntropy(torch.autograd.Function):
    """Per-token NLL of the LM head without materialising [tokens, V] logits.

    Vocabulary shards pass around the ring; logits of local tokens against each slice are folded
    into an online log-sum-exp and the target logit.
    """

    @staticmethod
    def forward(ctx, z, labels, shard, block: TSPBlocks):
        comm, rows = block.comm, shard.shape[0]
        lse = z.new_full((z.shape[0],), float("-inf"), dtype=torch.float32)
        target = torch.zeros_like(lse)
        for s, w in ring_each(comm, shard, "head.forward"):
            comm.mark(("head.forward", s))
            logits = block.vocab_logits(z, w, s)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            local = labels - s * rows
            hit = (local >= 0) & (local < rows)
            target[hit] = logits[hit, local[hit]]
        valid = labels != IGNORE_INDEX
        ctx.save_for_backward(z, labels, shard, lse)
        ctx.block = block
        return torch.where(valid, lse - target, 0.0)

    @staticmethod
    def backward(ctx, dnll):
        z, labels, shard, lse = ctx.saved_tensors
        block, comm, rows = ctx.block, ctx.block.comm, shard.shape[0]
        scale = torch.where(labels != IGNORE_INDEX, dnll, 0.0)[:, None]
        dz = torch.zeros_like(z)
        grads = GradientRing(comm, "head.grad")
        for s, w in ring_each(comm, shard, "head.backward"):
            comm.mark(("head.backward", s))
            dlogits = torch.exp(block.vocab_logits(z, w, s) - lse[:, None])  # softmax slice
            local = labels - s * rows
            hit = ((local >= 0) & (local < rows)).nonzero().squeeze(-1)
            dlogits[hit, local[hit]] -= 1.0
            dlogits = (dlogits * scale).to(z.dtype)
            dz += dlogits @ w
            grads.add(dlogits.t() @ z)
        return dz, None, grads.result(), None


# ---------------------------------------------------------------- the model


class TSPBlocks:
    """Shapes, layouts and the per-shard math shared by the autograd functions of one model."""

    def __init__(self, cfg, comm: AxisComm):
        D, h, d = comm.size, cfg.dim, cfg.head_dim
        self.cfg, self.comm = cfg, comm
        self.attention_layout = PackedLayout((
            Part("attention.wq.weight", (cfg.n_heads * d, h), 0),
            Part("attention.wk.weight", (cfg.n_kv_heads * d, h), 0),
            Part("attention.wv.weight", (cfg.n_kv_heads * d, h), 0),
            Part("attention.wo.weight", (h, cfg.n_heads * d), 1),
        ), D)
        self.mlp_layout = PackedLayout((
            Part("feed_forward.w_gate.weight", (cfg.ffn_dim, h), 0),
            Part("feed_forward.w_up.weight", (cfg.ffn_dim, h), 0),
            Part("feed_forward.w_down.weight", (h, cfg.ffn_dim), 1),
        ), D)

    def _heads(self, x, weight, cos=None, sin=None):
        """x [B, S/D, h] through a projection -> [B, heads, S/D, d], rotated if cos/sin are given."""
        B, S_local, _ = x.shape
        y = F.linear(x, weight).view(B, S_local, -1, self.cfg.head_dim)
        return (y if cos is None else apply_rope(y, cos, sin)).transpose(1, 2)

    def project_q(self, x, w, cos, sin):
        """Local tokens' queries of head group w: [B, Hq/D, S/D, d]."""
        return self._heads(x, self.attention_layout.unpack(w)[0], cos, sin)

    def project_kv(self, x, w, cos, sin):
        """Local tokens' keys and values of head group w: [2, B, Hkv/D, S/D, d]."""
        _, wk, wv, _ = self.attention_layout.unpack(w)
        return torch.stack([self._heads(x, wk, cos, sin), self._heads(x, wv)])

    def attend(self, q, kv_full, w):
        *_, wo = self.attention_layout.unpack(w)
        g = self.cfg.group_size
        k, v = expand_kv_heads(kv_full[0], g), expand_kv_heads(kv_full[1], g)
        out = zigzag_causal_attention(q, k, v, self.comm.rank, self.comm.size)
        return F.linear(out.transpose(1, 2).flatten(2), wo)

    def vocab_logits(self, z, w, s):
        """float32 logits [N, V/D] of local tokens against vocabulary shard s; padding rows -> -inf."""
        logits = (z @ w.t()).float()
        first_pad = self.cfg.vocab_size - s * w.shape[0]
        if first_pad < w.shape[0]:
            logits[:, max(first_pad, 0):] = float("-inf")
        return logits


class TSPLayer(nn.Module):
    def __init__(self, attention_shard, mlp_shard, attention_norm, ffn_norm):
        super().__init__()
        self.attention_norm = nn.Parameter(attention_norm)
        self.attention_shard = nn.Parameter(attention_shard)
        self.ffn_norm = nn.Parameter(ffn_norm)
        self.mlp_shard = nn.Parameter(mlp_shard)


class TSPTransformer(ParallelTransformer):
    """A reference ``Transformer`` split over the ``tsp`` mesh axis; each rank keeps only its shards."""

    scheme = "tsp"

    def __init__(self, model: Transformer, mesh, recompute: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights: WeightSource | None = None):
        super().__init__(model.cfg, mesh)
        self.recompute = recompute
        comm = AxisComm.from_mesh(mesh, "tsp", timeout_s)
        cfg, D, p = model.cfg, comm.size, comm.rank
        self.comm = comm
        self.blocks = TSPBlocks(cfg, comm)
        # This rank's shards, one reference tensor at a time: the full model is never materialised here.
        weights = weight_source(model, mesh, weights)
        self.embedding_shard = nn.Parameter(vocab_shard(weights, "tok_embeddings.weight", D, p))
        self.layers = nn.ModuleList()
        for i in range(cfg.n_layers):
            prefix = f"layers.{i}."
            self.layers.append(TSPLayer(
                self.blocks.attention_layout.pack(weights, prefix, p), self.blocks.mlp_layout.pack(weights, prefix, p),
                weights.get(prefix + "attention_norm.weight"), weights.get(prefix + "ffn_norm.weight")))
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
        cfg, comm = self.cfg, self.comm
        seq_len = tokens.shape[1] * comm.size
        positions = zigzag.positions(seq_len, comm.size, comm.rank, device=tokens.device)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        eps, blocks = cfg.norm_eps, self.blocks

        def block(x, layer):
            h = rms_norm(x, ReplicatedGrad.apply(layer.attention_norm, comm), eps)
            x = x + TSPAttention.apply(h, layer.attention_shard, cos, sin, blocks)
            h = rms_norm(x, ReplicatedGrad.apply(layer.ffn_norm, comm), eps)
            return x + TSPFeedForward.apply(h, layer.mlp_shard, blocks)

        x = TSPEmbedding.apply(tokens, self.embedding_shard, blocks)
        for layer in self.layers:
            # Recompute keeps only each layer's input; backward re-runs its forward (and its transfers).
            x = checkpoint(block, x, layer, use_reentrant=False) if self.recompute else block(x, layer)
        z = rms_norm(x, ReplicatedGrad.apply(self.norm, comm), eps).flatten(0, 1)
        head = self.embedding_shard if self.output_shard is None else self.output_shard
        nll = TSPHeadCrossEntropy.apply(z, labels.flatten(), head, blocks)
        return global_sum_and_count(nll.sum(), labels, comm)

    # -- full views (for checks, checkpoints, export) -----------------------

    def reference_parts(self, name, local):
        blocks, p = self.blocks, self.comm.rank
        if name in ("embedding_shard", "output_shard"):
            ref = "tok_embeddings.weight" if name == "embedding_shard" else "output.weight"
            return [(ref, real_vocab_rows(local, self.cfg.vocab_size, p), {"tsp": 0})]
        layer, _, kind = name.rpartition(".")
        if kind in ("attention_shard", "mlp_shard"):
            layout = blocks.attention_layout if kind == "attention_shard" else blocks.mlp_layout
            return [(f"{layer}.{part.name}", view, {"tsp": part.shard_dim})
                    for part, view in zip(layout.parts, layout.unpack(local))]
        return [(f"{name}.weight", local, {})]  # norms: replicated

    def _full(self, pick) -> dict[str, torch.Tensor]:
        """Gather every rank's shards of ``pick(param)`` (data or grad) into reference-named tensors."""
        blocks, V = self.blocks, self.cfg.vocab_size
        gather = lambda t: self.comm.all_gather(t, label="gather_full")
        out = {"tok_embeddings.weight": gather(pick(self.embedding_shard)).flatten(0, 1)[:V]}
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.attention_norm.weight"] = pick(layer.attention_norm)
            for name, t in blocks.attention_layout.unpack_gathered(gather(pick(layer.attention_shard))).items():
                out[f"layers.{i}.{name}"] = t
            out[f"layers.{i}.ffn_norm.weight"] = pick(layer.ffn_norm)
            for name, t in blocks.mlp_layout.unpack_gathered(gather(pick(layer.mlp_shard))).items():
                out[f"layers.{i}.{name}"] = t
        out["norm.weight"] = pick(self.norm)
        if self.output_shard is not None:
            out["output.weight"] = gather(pick(self.output_shard)).flatten(0, 1)[:V]
        return out
