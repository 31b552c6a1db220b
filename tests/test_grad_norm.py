"""The global gradient norm and clipping (train/optim.py), one process: a model's gradients are cut as the D ranks
of TSP hold them (KV-head copies when n_kv < D, padded vocabulary shards, replicated norm weights) and, for ZeRO, as
dp ranks own chunks of those shards; the norm summed over simulated ranks and the clipped pieces must equal
``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchtsp.config import ModelConfig
from torchtsp.model import Transformer
from torchtsp.parallel.shards import vocab_shard
from torchtsp.parallel.tsp.model import TSPTransformer
from torchtsp.parallel.tsp.shard_math import TSPShardMath
from torchtsp.train.optim import clip_grads_, global_grad_norm, local_squares
from torchtsp.train.zero import ZeroOptimizer
from torchtsp.weights import ModelWeights

D, DP = 8, 3  # 8 query heads, 4 KV heads: every KV head held by two ranks; 3 dp ranks own uneven chunks
CFG = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=257, qkv_bias=True,
                  qk_norm=True)
MESH = ("dp", "tsp")  # simulated ranks: tensors of shape [DP, D], one element per rank


def mesh_sum(tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """``global_grad_norm``'s all_reduce over simulated ranks: every rank gets the sum over its axis."""
    dim = MESH.index(axis)
    return tensor.sum(dim, keepdim=True).expand_as(tensor)


class _Rank:
    """What TSP rank ``p`` holds of a reference model's tensors ``source`` (named as ``TSPTransformer`` names
    its parameters), and its ``reference_parts``."""

    def __init__(self, source: ModelWeights, p: int, dp_rank: int = 0):
        comm = SimpleNamespace(size=D, rank=p)
        self.cfg, self.comm = CFG, comm
        self.shard_math = TSPShardMath(CFG, comm)
        self.dp_rank = dp_rank
        self.tensors = {"embedding_shard": vocab_shard(source, "tok_embeddings.weight", D, p)}
        for i in range(CFG.n_layers):
            prefix = f"layers.{i}."
            self.tensors[prefix + "attention_shard"] = self.shard_math.attention_layout.pack(source, prefix, p)
            self.tensors[prefix + "mlp_shard"] = self.shard_math.mlp_layout.pack(source, prefix, p)
            for norm in ("attention_norm", "ffn_norm"):
                self.tensors[prefix + norm] = source.get(f"{prefix}{norm}.weight")
            for norm in ("q_norm", "k_norm"):
                self.tensors[prefix + norm] = source.get(f"{prefix}attention.{norm}.weight")
        self.tensors["norm"] = source.get("norm.weight")
        self.tensors["output_shard"] = vocab_shard(source, "output.weight", D, p)

    def reference_parts(self, name, local):
        return TSPTransformer.reference_parts(self, name, local)

    # What ZeroOptimizer reads of a model.
    def named_parameters(self):
        return ((name, torch.nn.Parameter(t.clone())) for name, t in self.tensors.items())

    def comms(self):
        return {"tsp": SimpleNamespace(size=D, rank=self.comm.rank), "dp": SimpleNamespace(size=DP, rank=self.dp_rank)}


def source_of(tensors: dict[str, torch.Tensor], model: Transformer) -> ModelWeights:
    source = ModelWeights(model)
    source._tensors = tensors
    return source


@pytest.fixture(scope="module")
def reference():
    """(the unsharded model's gradients, the same after clip_grad_norm_, its norm, max_norm)."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    max_norm = 0.25 * torch.stack([g.norm() for g in grads.values()]).norm().item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    clipped = {name: p.grad.clone() for name, p in model.named_parameters()}
    return model, grads, clipped, norm, max_norm


def stack_squares(per_rank: list[dict], shape) -> dict:
    """Every simulated rank's ``local_squares`` as one dict of [shape] tensors (0 where a rank has no such key)."""
    keys = {key for squares in per_rank for key in squares}
    return {key: torch.stack([torch.as_tensor(s.get(key, 0.0), dtype=torch.float32) for s in per_rank]).view(shape)
            for key in keys}


def test_tsp_shards_norm_and_clipping_match_clip_grad_norm(reference):
    model, grads, clipped, expected, max_norm = reference
    ranks = [_Rank(source_of(grads, model), p) for p in range(D)]
    assert ranks[0].shard_math.kv_replicas == 2
    per_rank = [local_squares(((piece, dims) for name, t in r.tensors.items()
                               for _, piece, dims in r.reference_parts(name, t)), {"tsp": D}) for r in ranks]
    norms = global_grad_norm(stack_squares(per_rank, (1, D)), mesh_sum)
    torch.testing.assert_close(norms, expected.expand(1, D), rtol=1e-6, atol=0)
    want = [_Rank(source_of(clipped, model), p) for p in range(D)]
    for p, (rank, target) in enumerate(zip(ranks, want)):
        clip_grads_(rank.tensors.values(), norms[0, p], max_norm)
        for name, t in rank.tensors.items():
            torch.testing.assert_close(t, target.tensors[name], rtol=1e-6, atol=1e-7)


def test_zero_chunks_norm_and_clipping_match_clip_grad_norm(reference):
    model, grads, clipped, expected, max_norm = reference
    per_rank, optimizers, wants = [], [], []
    for r in range(DP):
        for p in range(D):
            rank, want = _Rank(source_of(grads, model), p, r), _Rank(source_of(clipped, model), p, r)
            zero = ZeroOptimizer(rank, 1, 1e-3, 0.0)
            for slot in zero.slots:  # the summed gradient's owned chunk, as the reduce-scatter leaves it
                slot.grad = rank.tensors[slot.name].reshape(-1)[slot.lo:slot.hi].clone()
            per_rank.append(zero.local_squares())
            optimizers.append(zero)
            wants.append(want)
    norms = global_grad_norm(stack_squares(per_rank, (DP, D)), mesh_sum, over=("dp",))
    torch.testing.assert_close(norms, expected.expand(DP, D), rtol=1e-6, atol=0)
    for i, (zero, want) in enumerate(zip(optimizers, wants)):
        clip_grads_((slot.master.grad for slot in zero.slots), norms.view(-1)[i], max_norm)
        for slot in zero.slots:
            torch.testing.assert_close(slot.master.grad, want.tensors[slot.name].reshape(-1)[slot.lo:slot.hi],
                                       rtol=1e-6, atol=1e-7)
