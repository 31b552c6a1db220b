"""The TSP model: each rank's shards as parameters, and its placement of a layer with the cross-layer prefetch."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ...distributed import zigzag
from ...distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ...layers import SANDWICH_NORMS, Documents, Placement, block_norm_names, norm, scale_embeddings
from ...model import Transformer, reference_shapes
from ...recompute import FULL, NONE, recompute_policy
from ...weights import WeightSource
from ..base import (
    LayerInputs,
    ParallelTransformer,
    ReplicatedGrad,
    global_sum_and_count,
    replicated_grad,
    sum_router_stats_over,
    weight_source,
)
from ..shards import real_vocab_rows, vocab_shard
from .attention import TSPAttention
from .moe import TSPMoE
from .rings import TSPEmbedding, TSPFeedForward, TSPHeadCrossEntropy
from .shard_math import TSPShardMath
from .streams import ACC, ShardPrefetch


class TSPLayer(nn.Module):
    def __init__(self, attention_shard, mlp_shard, attention_norm, ffn_norm, q_norm=None, k_norm=None, moe=None,
                 attention_out_norm=None, ffn_out_norm=None, bo=None):
        super().__init__()
        # GPT-OSS's output-projection bias: replicated (added once to the sum over head groups), like the norms.
        self.bo = None if bo is None else nn.Parameter(bo)
        # Sandwich norms (Gemma), replicated like the others.
        self.attention_out_norm = None if attention_out_norm is None else nn.Parameter(attention_out_norm)
        self.ffn_out_norm = None if ffn_out_norm is None else nn.Parameter(ffn_out_norm)
        self.attention_norm = nn.Parameter(attention_norm)
        self.attention_shard = nn.Parameter(attention_shard)
        # Qwen3's q/k norm weights act on head_dim, the same for every head: replicated, like the RMSNorms.
        self.q_norm = None if q_norm is None else nn.Parameter(q_norm)
        self.k_norm = None if k_norm is None else nn.Parameter(k_norm)
        self.ffn_norm = nn.Parameter(ffn_norm)
        # A sparse layer holds a mixture of experts (parallel/moe.py) instead of the dense MLP's shard.
        self.mlp_shard = None if mlp_shard is None else nn.Parameter(mlp_shard)
        self.moe = moe


@dataclass(frozen=True)
class TSPForward:
    """What one forward's layers share: the cross-layer shard prefetch and each layer's norm weights (views through
    the one ``ReplicatedGrad`` that sums their gradients)."""

    prefetch: ShardPrefetch
    norms: list[dict[str, torch.Tensor]]


@dataclass(frozen=True)
class TSPLayerShards:
    """One layer's weights on this rank, detached: its packed attention shard (head group p) and MLP shard (FFN
    slice p; None for a sparse layer, whose experts ``moe`` holds), its replicated norms."""

    attention: torch.Tensor
    mlp: torch.Tensor | None
    attention_norm: torch.Tensor
    ffn_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    moe: TSPMoE | None
    sandwich: dict = dataclasses.field(default_factory=dict)  # Gemma's sandwich norms, by their names
    bo: torch.Tensor | None = None  # GPT-OSS's output-projection bias, replicated


@dataclass(frozen=True)
class TSPShardView:
    """What the TSP inference engine reads of a ``TSPTransformer`` on this rank: the axis, the packed layouts
    (``shard_math``), the layers' shards, the vocabulary rows of the embedding and the head, the final norm."""

    cfg: object
    comm: AxisComm
    shard_math: TSPShardMath
    layers: tuple[TSPLayerShards, ...]
    embedding: torch.Tensor
    head: torch.Tensor
    norm: torch.Tensor


class TSPTransformer(ParallelTransformer):
    """A reference ``Transformer`` split over the ``tsp`` mesh axis; each rank keeps only its shards."""

    scheme = "tsp"

    def __init__(self, model: Transformer, mesh, recompute: str | bool = NONE, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights: WeightSource | None = None):
        super().__init__(model.cfg, mesh)
        self.recompute = recompute_policy(recompute)
        comm = AxisComm.from_mesh(mesh, "tsp", timeout_s, weight_stream=True)
        cfg, D, p = model.cfg, comm.size, comm.rank
        self.comm = comm
        # Ranks holding copies of one KV head (n_kv < D) sum their gradients over a group of their own.
        kv_comm = comm.blocks(mesh, D // min(cfg.n_kv_heads, D), "kv_replicas")
        self.shard_math = TSPShardMath(cfg, comm, kv_comm)
        # This rank's shards, one reference tensor at a time: the full model is never materialised here.
        weights = weight_source(model, mesh, weights)
        self.embedding_shard = nn.Parameter(vocab_shard(weights, "tok_embeddings.weight", D, p))
        self.layers = nn.ModuleList()
        for i in range(cfg.n_layers):
            prefix = f"layers.{i}."
            qk_norms = [weights.get(f"{prefix}attention.{n}.weight") for n in ("q_norm", "k_norm")] if cfg.qk_norm \
                else [None, None]
            sparse = cfg.is_moe_layer(i)
            sandwich = {n: weights.get(f"{prefix}{n}.weight") for n in SANDWICH_NORMS} if cfg.sandwich_norm else {}
            self.layers.append(TSPLayer(
                self.shard_math.attention_layout.pack(weights, prefix, p),
                None if sparse else self.shard_math.mlp_layout.pack(weights, prefix, p),
                weights.get(prefix + "attention_norm.weight"), weights.get(prefix + "ffn_norm.weight"), *qk_norms,
                moe=TSPMoE(cfg, comm, weights, prefix) if sparse else None, **sandwich,
                bo=weights.get(prefix + "attention.wo.bias") if cfg.o_bias else None))
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

    # The three parts of the model a pipeline stage (parallel/pipeline.py) runs one or more of.

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Local tokens [B, S/D] -> their embeddings [B, S/D, h]."""
        return scale_embeddings(TSPEmbedding.apply(tokens, self.embedding_shard, self.shard_math), self.cfg)

    def attention_positions(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's local tokens' global zigzag positions, and the whole sequence's length."""
        comm, seq_len = self.comm, x.shape[1] * self.comm.size
        return zigzag.positions(seq_len, comm.size, comm.rank, device=x.device), seq_len

    def forward_state(self, documents: Documents | None = None) -> TSPForward:
        """The cross-layer prefetch of an attention's first shard (in forward the next layer's, in backward this
        layer's, during its MLP backward) and every layer's norm weights through one ``ReplicatedGrad`` node: their
        gradients (each rank's tokens' share) are summed in one all-reduce once backward has produced the last of
        them (layer 0's), instead of the ranks meeting once per weight in the middle of backward."""
        cfg, comm, layers = self.cfg, self.comm, list(self.layers)
        norm_names = [*block_norm_names(cfg)] + (["q_norm", "k_norm"] if cfg.qk_norm else []) + \
            (["bo"] if cfg.o_bias else [])
        summed = ReplicatedGrad.apply(comm, ACC, *(getattr(layer, n) for layer in layers for n in norm_names))
        norms = [dict(zip(norm_names, summed[i * len(norm_names):])) for i in range(len(layers))]
        return TSPForward(ShardPrefetch(comm.weights), norms)

    def placement(self, inputs: LayerInputs, state: TSPForward) -> Placement:
        """Layer i on local tokens: its attention's head-group broadcasts and K/V exchange, its MLP's weight ring
        (or experts), with the cross-layer prefetches."""
        i, prefetch = inputs.spec.index, state.prefetch
        attention = lambda h, _cache: self._attention(h, i, inputs.cos, inputs.sin, state.norms[i], prefetch,
                                                      inputs.mask)
        mlp = lambda h: self._mlp(h, i, prefetch, inputs.stats)
        return Placement.normed(state.norms[i], attention, mlp, self.cfg)

    def recompute_context(self, state: TSPForward):
        """A layer's forward run again in backward tells the prefetch so (``ShardPrefetch.rerun``): it must not
        prefetch the next layer's shard again."""
        return contextlib.nullcontext(), state.prefetch.rerun()

    def _attention(self, h, i: int, cos, sin, norms, prefetch: ShardPrefetch, mask):
        """Layer i's attention on normed local tokens h: head-group broadcasts and the K/V all-gather."""
        layers = self.layers
        qk_norms = [norms["q_norm"], norms["k_norm"]] if self.cfg.qk_norm else [None, None]
        # Under recompute, backward runs layer i-1's forward again right after this attention's backward.
        rerun = (prefetch.request("attention.forward", i - 1, layers[i - 1].attention_shard)
                 if self.recompute == FULL and i > 0 else None)
        y = TSPAttention.apply(h, layers[i].attention_shard, cos, sin, self.shard_math, prefetch, i, *qk_norms,
                               rerun, mask)
        return y + norms["bo"] if self.cfg.o_bias else y

    def _mlp(self, h, i: int, prefetch: ShardPrefetch, stats):
        """Layer i's MLP (the weight ring) or experts on normed local tokens h, prefetching the attention shards
        the next steps need: the next layer's in forward, this layer's for its backward."""
        layers = self.layers
        layer, ahead = layers[i], None
        if not prefetch.rerunning and i + 1 < len(layers):
            ahead = prefetch.request("attention.forward", i + 1, layers[i + 1].attention_shard)
        behind = prefetch.request("attention.backward", i, layer.attention_shard)
        if layer.moe is not None:
            return layer.moe(h, stats, self.shard_math, ahead, behind)
        # Full and selective recompute alike keep the MLP's input only: backward projects gate and up again as the
        # shards pass (they travel in backward anyway, so selective moves no byte twice).
        return TSPFeedForward.apply(h, layer.mlp_shard, self.shard_math, ahead, behind, None,
                                    self.recompute != NONE, prefetch.rerunning)

    def head_nll_sum_and_count(self, x: torch.Tensor, labels: torch.Tensor):
        """Final norm, LM head and cross-entropy of local hidden states x [B, S/D, h] against labels [B, S/D]."""
        comm, shard_math = self.comm, self.shard_math
        z = norm(x, replicated_grad(self.norm, comm, ACC), self.cfg).flatten(0, 1)
        head = self.embedding_shard if self.output_shard is None else self.output_shard
        nll = TSPHeadCrossEntropy.apply(z, labels.flatten(), head, shard_math)
        return global_sum_and_count(nll.sum(), labels, comm)

    def sum_router_stats(self, stats):
        return sum_router_stats_over(self.comm, stats.counts, stats.probs, stats.rows)

    # -- full views (for checks, checkpoints, export) -----------------------

    def shard_view(self) -> TSPShardView:
        detached = lambda t: None if t is None else t.detach()
        layers = tuple(TSPLayerShards(layer.attention_shard.detach(), detached(layer.mlp_shard),
                                      layer.attention_norm.detach(), layer.ffn_norm.detach(), detached(layer.q_norm),
                                      detached(layer.k_norm), layer.moe,
                                      {n: getattr(layer, n).detach() for n in SANDWICH_NORMS
                                       if getattr(layer, n) is not None}, detached(layer.bo)) for layer in self.layers)
        head = self.embedding_shard if self.output_shard is None else self.output_shard
        return TSPShardView(self.cfg, self.comm, self.shard_math, layers, self.embedding_shard.detach(),
                            head.detach(), self.norm.detach())

    def reference_parts(self, name, local):
        shard_math, p = self.shard_math, self.comm.rank
        if ".moe." in name:
            layer, _, attr = name.partition(".moe.")
            return self.layers[int(layer.split(".")[1])].moe.reference_parts(layer, attr, local)
        if name in ("embedding_shard", "output_shard"):
            ref = "tok_embeddings.weight" if name == "embedding_shard" else "output.weight"
            return [(ref, real_vocab_rows(local, self.cfg.vocab_size, p), {"tsp": 0})]
        layer, _, kind = name.rpartition(".")
        if kind in ("attention_shard", "mlp_shard"):
            layout = shard_math.attention_layout if kind == "attention_shard" else shard_math.mlp_layout
            # A KV-head copy held by several ranks is one of n_kv slices, stored once (checkpoint.sharded_tensor).
            return [(f"{layer}.{part.name}", view,
                     {"tsp": part.shard_dim if layout.replicas(part) == 1 else (part.shard_dim, layout.chunks(part))})
                    for part, view in zip(layout.parts, layout.unpack(local))]
        if kind == "bo":
            return [(f"{layer}.attention.wo.bias", local, {})]  # replicated
        if kind in ("q_norm", "k_norm"):
            return [(f"{layer}.attention.{kind}.weight", local, {})]  # replicated
        return [(f"{name}.weight", local, {})]  # norms: replicated

    def _full(self, pick) -> dict[str, torch.Tensor]:
        """Gather every rank's shards of ``pick(param)`` (data or grad) into reference-named tensors."""
        shard_math, V = self.shard_math, self.cfg.vocab_size
        gather = lambda t: self.comm.all_gather(t, label="gather_full")
        out = {}
        if self.embedding_shard is not None:  # None: a pipeline stage without the embedding
            out["tok_embeddings.weight"] = gather(pick(self.embedding_shard)).flatten(0, 1)[:V]
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.attention_norm.weight"] = pick(layer.attention_norm)
            for n in SANDWICH_NORMS if layer.attention_out_norm is not None else ():
                out[f"layers.{i}.{n}.weight"] = pick(getattr(layer, n))
            if layer.bo is not None:
                out[f"layers.{i}.attention.wo.bias"] = pick(layer.bo)
            if layer.q_norm is not None:
                out[f"layers.{i}.attention.q_norm.weight"] = pick(layer.q_norm)
                out[f"layers.{i}.attention.k_norm.weight"] = pick(layer.k_norm)
            for name, t in shard_math.attention_layout.unpack_gathered(gather(pick(layer.attention_shard))).items():
                out[f"layers.{i}.{name}"] = t
            out[f"layers.{i}.ffn_norm.weight"] = pick(layer.ffn_norm)
            if layer.moe is not None:
                out.update(layer.moe.full(f"layers.{i}", pick))
                continue
            for name, t in shard_math.mlp_layout.unpack_gathered(gather(pick(layer.mlp_shard))).items():
                out[f"layers.{i}.{name}"] = t
        if self.norm is not None:  # None: a pipeline stage without the head
            out["norm.weight"] = pick(self.norm)
        if self.output_shard is not None:
            out["output.weight"] = gather(pick(self.output_shard)).flatten(0, 1)[:V]
        return {name: out[name] for name in reference_shapes(self.cfg) if name in out}  # the reference model's order
