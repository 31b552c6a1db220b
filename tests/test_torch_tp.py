"""torch_tp (PyTorch's own tensor parallelism on the reference model) against the single-device reference."""

import copy
import re

import pytest
import torch

import torchtsp
from helpers import batch, compare_with_reference

CFG = dict(n_layers=2, max_seq_len=4096)
CASES = {
    # vocab_size 101 is not divisible by T: DTensor shards the vocabulary unevenly.
    "mha_untied": torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=101, **CFG),
    "gqa_tied": torchtsp.ModelConfig(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=101,
                                     tie_embeddings=True, **CFG),
    "gqa4_untied": torchtsp.ModelConfig(dim=64, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=100, **CFG),
}
WORLD_CASES = {2: ["mha_untied", "gqa_tied", "gqa4_untied"], 4: ["mha_untied", "gqa_tied"]}
SEQ_PARALLEL = (True, False)
B, S = 3, 24  # S divisible by T for T = 2, 4


def exactness_on_rank(world, names):
    """Per (case, sequence_parallel): losses, every full gradient's relative error, residual shape."""
    mesh = torchtsp.init_mesh(tp=world)
    out, shapes = {}, []  # shapes: the output shape of layer 1 (the residual stream), per run
    for name in names:
        cfg = CASES[name]
        torch.manual_seed(0)
        ref = torchtsp.Transformer(cfg)
        tokens, labels = batch(cfg, B, S)
        ref_loss = ref.loss(tokens, labels)
        ref_loss.backward()
        for sp in SEQ_PARALLEL:
            model = torchtsp.parallelize(copy.deepcopy(ref), mesh, "torch_tp", sequence_parallel=sp)
            hook = model.module.layers[1].register_forward_hook(lambda m, args, y: shapes.append(tuple(y.shape)))
            loss = model.loss(tokens, labels)
            hook.remove()
            loss.backward()
            weights = model.full_state_dict()
            out[name, sp] = {**compare_with_reference(model, ref, loss, ref_loss),
                             "residual_shape": shapes.pop(), "comms": model.comms(),
                             "weights_equal": sorted(weights) == sorted(n for n, _ in ref.named_parameters())
                             and all(torch.equal(weights[n], p) for n, p in ref.named_parameters())}
    return out


def bad_input_on_rank(world):
    """Error messages (or None) for an indivisible sequence and an indivisible head count."""
    mesh = torchtsp.init_mesh(tp=world)
    cfg = CASES["mha_untied"]
    messages = {}
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), mesh, "torch_tp")
    try:
        model.loss(*batch(cfg, 1, world + 1, ignore=0))
    except ValueError as e:
        messages["seq"] = str(e)
    try:
        torchtsp.parallelize(torchtsp.Transformer(cfg.replace(n_heads=2, n_kv_heads=2)), mesh, "torch_tp")
    except ValueError as e:
        messages["heads"] = str(e)
    return messages


def all_on_rank(world, names):
    return dict(exact=exactness_on_rank(world, names), bad=bad_input_on_rank(world) if world == 4 else None)


@pytest.fixture(scope="module")
def results(pools):
    return {world: pools(world).run(all_on_rank, world, names) for world, names in WORLD_CASES.items()}


@pytest.mark.parametrize("sp", SEQ_PARALLEL, ids=["seq_parallel", "no_seq_parallel"])
@pytest.mark.parametrize("world,name", [(w, n) for w, names in WORLD_CASES.items() for n in names])
def test_loss_and_every_gradient_match_reference(results, world, name, sp):
    for rank, per_rank in enumerate(results[world]):
        r = per_rank["exact"][name, sp]
        assert r["names"], "full_grads() and full_state_dict() must name exactly the reference parameters"
        assert r["weights_equal"], "full_state_dict() must reassemble the reference weights exactly"
        assert r["comms"] == {}
        # The residual stream is sequence-sharded with sequence parallelism, replicated without.
        assert r["residual_shape"] == (B, S // world if sp else S, CASES[name].dim), r["residual_shape"]
        # float32 round-off: the row-parallel projections and the vocabulary-parallel log-sum-exp are
        # sums of T partial sums (~1e-7 relative observed).
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (rank, r["loss"], r["ref_loss"])
        worst = max(r["grad_err"], key=r["grad_err"].get)
        # Gradients of replicated inputs are all-reduced partial sums (~1e-6 observed); 1e-4 leaves room.
        assert r["grad_err"][worst] <= 1e-4, (rank, worst, r["grad_err"][worst])


@pytest.mark.parametrize("case,match", [
    ("seq", r"sequence length 5 must be divisible by the TP degree T=4"),
    ("heads", r"n_heads=2 divisible by 4"),
])
def test_bad_input_raises_value_error_on_every_rank(results, case, match):
    for rank, per_rank in enumerate(results[4]):
        message = per_rank["bad"].get(case)
        assert message is not None and re.search(match, message), (rank, message)
