"""One TSP training step: no host-device synchronisation, and bf16 accuracy no worse than the single-device model."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchtsp
from helpers import batch, rel_err

aten = torch.ops.aten

# Ops whose result shape or value the host must read from the device: each one is a sync on CUDA.
SYNC_OPS = {aten.nonzero.default, aten._local_scalar_dense.default, aten.is_nonzero.default,
            aten.masked_select.default, aten.repeat_interleave.Tensor, aten.unique_consecutive.default,
            aten._unique2.default, aten.unique_dim.default}
INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class SyncSpy(TorchDispatchMode):
    """Records every op of the step that would synchronise host and device."""

    def __init__(self):
        super().__init__()
        self.flagged, self.ops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func in SYNC_OPS:
            self.flagged.append(str(func))
        elif func in INDEXING_OPS:
            indices = args[1] if len(args) > 1 else ()
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
                self.flagged.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


def sync_ops_on_rank(world, recompute, **features):
    cfg = torchtsp.ModelConfig(**{**dict(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=101, n_layers=2,
                                         max_seq_len=64), **features})
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(tsp=world), "tsp", recompute=recompute)
    tokens, labels = batch(cfg, 2, 8 * world)
    # loss() validates token ids with .item() (input checking, outside the step): run the step on shards.
    tokens, labels = model.shard_batch(tokens), model.shard_batch(labels)
    with SyncSpy() as spy:
        model.loss_on_shard(tokens, labels).backward()
    return spy.flagged, spy.ops


def test_spy_flags_boolean_mask_indexing_and_nonzero():
    x, mask = torch.randn(6), torch.tensor([True, False] * 3)
    with SyncSpy() as spy:
        x[mask] = 0.0
        x[mask.nonzero().squeeze(-1)]
        x.sum().item()
    assert len(spy.flagged) == 3, spy.flagged


@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("world", [1, 2])
def test_training_step_has_no_host_device_sync(pools, world, recompute):
    for rank, (flagged, ops) in enumerate(pools(world).run(sync_ops_on_rank, world, recompute)):
        assert ops > 100, "the spy saw no ops"
        assert flagged == [], (rank, flagged)


def test_step_with_model_features_and_kv_head_copies_has_no_host_device_sync(pools):
    """q/k/v bias, q/k norm (its backward runs autograd on local tokens) and one KV head copied on 2 ranks."""
    features = dict(n_kv_heads=1, qkv_bias=True, qk_norm=True)
    for rank, (flagged, ops) in enumerate(pools(2).run(sync_ops_on_rank, 2, False, **features)):
        assert ops > 100, "the spy saw no ops"
        assert flagged == [], (rank, flagged)


# ---------------------------------------------------------------- bf16

BF16_CASES = {
    "mha_untied": torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=101, n_layers=2,
                                       max_seq_len=128),
    "gqa_tied": torchtsp.ModelConfig(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=101, n_layers=2,
                                     max_seq_len=128, tie_embeddings=True),
    # Qwen-like features and, at D = 4, each of the 2 KV heads copied on 2 ranks.
    "kv2_features": torchtsp.ModelConfig(dim=64, n_heads=8, n_kv_heads=2, ffn_dim=128, vocab_size=101, n_layers=2,
                                         max_seq_len=128, qkv_bias=True, qk_norm=True),
}


def bf16_errors_on_rank(world, name):
    """Errors against the fp32 reference of (the bf16 single-device model, TSP in bf16): loss and every gradient."""
    cfg = BF16_CASES[name]
    torch.manual_seed(0)
    ref = torchtsp.Transformer(cfg)
    tokens, labels = batch(cfg, 2, 128)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    model = torchtsp.parallelize(copy.deepcopy(ref).to(torch.bfloat16), torchtsp.init_mesh(tsp=world), "tsp")
    loss = ref.loss(tokens, labels)
    loss.backward()
    loss16 = ref16.loss(tokens, labels)
    loss16.backward()
    loss_tsp = model.loss(tokens, labels)
    loss_tsp.backward()
    tsp_grads = model.full_grads()
    errors = {"single": {"loss": abs(loss16.item() - loss.item()) / loss.item()},
              "tsp": {"loss": abs(loss_tsp.item() - loss.item()) / loss.item()}}
    for n, p in ref.named_parameters():
        errors["single"][n] = rel_err(dict(ref16.named_parameters())[n].grad.float(), p.grad)
        errors["tsp"][n] = rel_err(tsp_grads[n].float(), p.grad)
    return errors


@pytest.mark.parametrize("name", sorted(BF16_CASES))
def test_bf16_tsp_is_as_accurate_as_bf16_single_device(pools, name):
    """At D = 4, TSP in bf16 against the fp32 reference is no less accurate than the bf16 single-device model.

    Both run the same bf16 GEMMs; TSP splits their sums over ranks, shards and head groups and accumulates the
    bf16-rounded partial results in fp32. Two bf16 computations that sum in different orders scatter per tensor
    by about +-50% around each other (measured here: TSP/single from 0.7 to 1.6 per gradient), so a single
    tensor may be up to 2x the single-device error; averaged over every gradient the scatter cancels, and the
    mean must be within 1.25x (measured: about 1.06). Accumulating in bf16 instead fails it (tried: a norm
    weight's gradient error 2.2x the single-device one).
    The q/k norm weights have head_dim = 8 elements: their relative error is the noisiest. SP in bf16, which
    also sums in another order than the single device, measured 2.0x there; TSP 1.7-2.6x. They get 3x.
    Errors below a quarter bf16 ulp (2^-10 relative: the loss) count as equal, their ratio being noise."""
    floor = 2.0 ** -10
    cfg = BF16_CASES[name]
    bound = {n: 3.0 if p.numel() <= cfg.head_dim else 2.0
             for n, p in torchtsp.Transformer(cfg).to("meta").named_parameters()}
    for rank, errors in enumerate(pools(4).run(bf16_errors_on_rank, 4, name)):
        single, tsp = errors["single"], errors["tsp"]
        grads = [k for k in single if k != "loss"]
        mean_single, mean_tsp = (sum(e[k] for k in grads) / len(grads) for e in (single, tsp))
        if rank == 0:
            print(f"\n{name}: loss error single {single['loss']:.2e} tsp {tsp['loss']:.2e}; mean gradient error "
                  f"single {mean_single:.2e} tsp {mean_tsp:.2e}")
        assert tsp["loss"] <= 1.5 * max(single["loss"], floor), (rank, tsp["loss"], single["loss"])
        assert mean_tsp <= 1.25 * mean_single, (rank, mean_tsp, mean_single)
        for key in grads:
            assert tsp[key] <= bound[key] * max(single[key], floor), (rank, key, tsp[key], single[key])
