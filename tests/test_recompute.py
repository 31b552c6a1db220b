"""Recompute policies (``--recompute {none,full,selective}``): every policy computes the same loss and gradients
as the reference without recompute, selective moves no byte more than none (full does, where its re-run layer
communicates), and the flag's spellings (a bare ``--recompute``, ``--no-recompute``, a bool from an older config)
mean what they meant."""

import contextlib
import copy
import math

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torchtsp
from helpers import batch, compare_with_reference
from torchtsp.analysis.comm_model import predict_comm
from torchtsp.recompute import POLICIES, recompute_policy

# Two layers, GQA, ffn not a multiple of dim: small enough for a CPU pool, every part of a layer present.
CFG = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=257, n_layers=2, max_seq_len=256)

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _save_matmuls(ctx, op, *args, **kwargs):
    """torch's selective-checkpoint policy in torchtitan's "op" form: keep matmul outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _torch_sac_loss(model, tokens, labels):
    """The reference model with each layer checkpointed under torch's own selective policy: an independent
    implementation of "save the GEMMs, recompute the elementwise ops" to compare selective's gradients with."""
    x = torchtsp.layers.scale_embeddings(model.tok_embeddings(tokens), model.cfg)
    tables = torchtsp.layers.layer_rope(torch.arange(tokens.shape[1]), model.cfg)
    for layer, (cos, sin) in zip(model.layers, tables):
        x = checkpoint(layer, x, cos, sin, use_reentrant=False,
                       context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls))
    logits = torch.nn.functional.linear(model.norm(x), model.output_weight)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_every_policy_gives_the_reference_gradients_on_one_process():
    """Exact: the policies change what backward keeps, not which floating-point operations it runs (the recomputed
    activation and product are the same kernels on the same inputs), so on one CPU process the losses and
    gradients equal those of no recompute and of torch's own selective checkpointing to fp32 round-off
    (1e-6 relative: a GEMM run in another blocking may reorder a sum; seen: 0 here)."""
    cfg = torchtsp.ModelConfig(**CFG)
    torch.manual_seed(0)
    model = torchtsp.Transformer(cfg)
    tokens, labels = batch(cfg, 2, 48)

    def run(loss_of):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    expected_loss, expected = run(lambda: _torch_sac_loss(model, tokens, labels))
    for policy in POLICIES:
        loss, grads = run(lambda p=policy: _mean(model.loss_terms(tokens, labels, recompute=p)))
        assert loss == pytest.approx(expected_loss, rel=1e-6), policy
        for name, g in grads.items():
            assert (g - expected[name]).abs().max() <= 1e-6 * expected[name].abs().max(), (policy, name)


def _mean(terms):
    return terms.nll_sum / terms.count


def _saved_bytes(model, tokens, labels, policy) -> int:
    """Bytes autograd holds for backward after the forward (each storage once), counted by a saved-tensor hook."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = model.loss_terms(tokens, labels, recompute=policy)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    del terms
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_selective_saves_two_ffn_sized_tensors_fewer_per_layer_and_full_saves_least():
    """What each policy keeps, by arithmetic: selective drops the activation and the product (the down
    projection's input) of every layer, 2 x tokens x ffn_dim floats each; full keeps each layer's input only."""
    cfg = torchtsp.ModelConfig(**CFG)
    torch.manual_seed(0)
    model = torchtsp.Transformer(cfg)
    B, S = 2, 48
    tokens, labels = batch(cfg, B, S)
    saved = {p: _saved_bytes(model, tokens, labels, p) for p in POLICIES}
    assert saved["none"] - saved["selective"] == cfg.n_layers * 2 * B * S * cfg.ffn_dim * 4
    assert saved["full"] < saved["selective"]


def test_policy_spellings():
    assert [recompute_policy(v) for v in (None, False, True, "none", "full", "selective")] == \
        ["none", "none", "full", "none", "full", "selective"]
    with pytest.raises(ValueError, match="none, full, selective"):
        recompute_policy("some")


def test_train_flag_spellings_and_older_configs():
    from torchtsp.cli import build_parser
    from torchtsp.train.config import TrainConfig

    parser = build_parser()
    for argv, expected in ((["--recompute"], "full"), (["--no-recompute"], "none"),
                           (["--recompute", "selective"], "selective"), (["--recompute", "none"], "none"), ([], None)):
        assert parser.parse_args(["train", *argv]).recompute == expected, argv
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--recompute", "some"])
    assert TrainConfig(recompute=True).recompute == "full"  # a run saved before the policies
    assert TrainConfig().recompute == "none"


@pytest.mark.parametrize("scheme", ["tsp", "tp", "tp_sp", "sp", "dp", "torch_tp"])
def test_every_scheme_takes_every_policy_in_its_layout(scheme):
    from torchtsp.layout import Layout
    from torchtsp.schemes import get_scheme

    for policy in POLICIES:
        layout = Layout.resolve(scheme, 4, recompute=policy) if scheme != "tp_sp" else \
            Layout.resolve(scheme, 4, tp=2, recompute=policy)
        assert layout.option_values["recompute"] == policy
    layout = Layout.resolve(scheme, 4, pp=2, recompute="selective") if get_scheme(scheme).pipeline else None
    assert layout is None or layout.option_values["recompute"] == "selective"


def policies_on_rank(scheme, degrees, B, S):
    """For each policy: the comparison with the reference (loss, every full gradient) and the bytes this rank
    received in the step."""
    cfg = torchtsp.ModelConfig(**CFG)
    mesh = torchtsp.init_mesh(**degrees)
    out = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        ref = torchtsp.Transformer(cfg)
        tokens, labels = batch(cfg, B, S)
        model = torchtsp.parallelize(copy.deepcopy(ref), mesh, scheme, recompute=policy)
        with contextlib.ExitStack() as stack:
            stats = [stack.enter_context(c.counting()) for c in model.comms().values()]
            loss = model.loss(tokens, labels)
            loss.backward()
        ref_loss = ref.loss(tokens, labels)
        ref_loss.backward()
        out[policy] = (compare_with_reference(model, ref, loss, ref_loss), sum(s.total_recv for s in stats),
                       model.traffic_seq_rank())
    return out


@pytest.mark.parametrize("scheme,degrees", [("tsp", {"tsp": 2}), ("tp", {"tp": 2}), ("sp", {"sp": 2}),
                                            ("dp", {"dp": 2}), ("torch_tp", {"tp": 2}),
                                            ("tp_sp", {"tp": 2, "sp": 2})])
def test_policies_match_the_reference_and_selective_moves_no_byte_more(pools, scheme, degrees):
    """At D = 2 (tp_sp: 2 x 2) every policy's loss and full gradients equal the single-process reference's to fp32
    round-off (2e-5 relative: the sums over ranks add partials in another order than the whole-tensor GEMM; the schemes'
    own tests hold 1e-4 for the same reason). Selective re-runs no collective: its counted bytes equal none's;
    full re-runs each layer's forward, collectives and all (TSP's MLP ring excepted), so it moves more; the
    analytic model (``predict_comm``, recompute = full) says how much. torch_tp (DTensor's own collectives, which
    our comm layer does not count) is held to the gradients only."""
    B, S = 2, 32
    cfg = torchtsp.ModelConfig(**CFG)
    for rank_result in pools(math.prod(degrees.values())).run(policies_on_rank, scheme, degrees, B, S):
        for policy, (cmp, _, _) in rank_result.items():
            assert cmp["names"], policy
            assert cmp["loss"] == pytest.approx(cmp["ref_loss"], rel=2e-5), policy
            assert max(cmp["grad_err"].values()) <= 2e-5, (policy, cmp["grad_err"])
        if scheme == "torch_tp":
            continue
        received = {p: r[1] for p, r in rank_result.items()}
        seq_rank = rank_result["none"][2]
        assert received["selective"] == received["none"]
        for policy, full in (("none", False), ("full", True)):
            assert received[policy] == predict_comm(scheme, cfg, B, S, **degrees, recompute=full,
                                                    seq_rank=seq_rank).total, policy
        assert received["full"] > received["none"] or scheme == "dp"  # dp: its layers communicate nothing
