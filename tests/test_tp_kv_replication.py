"""TP (and TP x SP, Megatron-SP) with fewer KV heads than ranks: each KV head is copied on T/n_kv consecutive
ranks, the one every query head of the rank reads (as Megatron and vLLM do it).

Against the single-device reference in float32: loss and every gradient (with and without q/k/v bias and
q/k norm, saved and recomputed activations), bytes moved against the traffic formula, greedy tokens and
logits of generate, the KV cache at 1/n_kv of the single-device cache, and the memory model's count of the
copies.
"""

from __future__ import annotations

import pytest

import torchtsp
from helpers import batch
from test_kv_replication import (
    CASES,
    check_exactness,
    check_step_logits,
    exactness_on_rank,
    measured_and_predicted_peak,
    reference,
    train_with_kv_copies_then_resume_at_two,
)

B, S = 2, 16


@pytest.mark.parametrize("degrees,scheme,options,cases", [
    ({"tp": 4}, "tp", {}, ["kv2", "kv1_bias_norm"]),
    ({"tp": 4}, "tp", {"sequence_parallel": True}, ["kv2_bias"]),
    ({"tp": 2, "sp": 2}, "tp_sp", {}, ["kv1_bias_norm"]),
], ids=["TP4", "TP4+seqpar", "TP2xSP2"])
def test_loss_and_every_gradient_match_reference(pools, degrees, scheme, options, cases):
    # The bounds of TSP's copies (test_kv_replication.py): float32 round-off of the copies' summed partial sums.
    check_exactness(pools(4).run(exactness_on_rank, cases, degrees, scheme, options))


def traffic_on_rank(name, degrees, scheme, options):
    from torchtsp.distributed.comm import Traffic

    model = torchtsp.parallelize(reference(CASES[name]), torchtsp.init_mesh(**degrees), scheme, **options)
    tokens, labels = batch(model.cfg, B, S)
    with Traffic(model.comms()) as traffic:
        model.loss(tokens, labels).backward()
    return traffic.recv, model.traffic_seq_rank()


@pytest.mark.parametrize("name,degrees,scheme,options", [
    ("kv2", {"tp": 4}, "tp", {}), ("kv1_bias_norm", {"tp": 4}, "tp", {}),
    ("kv2_bias", {"tp": 4}, "tp", {"sequence_parallel": True}), ("kv1_bias_norm", {"tp": 2, "sp": 2}, "tp_sp", {}),
], ids=["kv2", "kv1_bias_norm", "kv2_bias_seqpar", "kv1_tp2xsp2"])
def test_bytes_moved_equal_the_traffic_formula(pools, name, degrees, scheme, options):
    """The copies' gradient all-reduce (float32, one per layer over each copy group) is in the formula."""
    from torchtsp.analysis import predict_comm

    for got, seq_rank in pools(4).run(traffic_on_rank, name, degrees, scheme, options):
        want = predict_comm(scheme, CASES[name], B, S, **degrees, seq_rank=seq_rank, **options).total
        assert got == want, (got, want, seq_rank)


def generate_on_rank(name, prompts):
    from torchtsp.infer import generate

    model = torchtsp.parallelize(reference(CASES[name]), torchtsp.init_mesh(tp=4), "tp")
    r = generate(model, prompts, 5, return_logits=True)
    return r.tokens, [t.clone() for t in r.logits], r.kv_cache_bytes


@pytest.mark.parametrize("name", ["kv2", "kv1_bias_norm"])
def test_generate_equals_the_reference_and_the_cache_holds_one_head(pools, name):
    """Greedy tokens and every step's logits equal the reference's (1e-4: float32 partial sums over 4 ranks and 5
    steps); each rank's cache holds its one KV head of every token: 1/n_kv of the single-device cache, the
    floor TSP's sequence-sharded cache goes below."""
    from torchtsp.analysis import predict_memory
    from torchtsp.infer import generate

    cfg = CASES[name]
    prompts = [[3, 17, 5, 42, 8, 1, 9, 11], [4, 5, 6, 7, 9]]
    ref = reference(cfg)
    expected = generate(ref, prompts, 5).tokens
    single_cache = cfg.n_layers * 2 * len(prompts) * cfg.n_kv_heads * cfg.head_dim * 4 * (8 + 5 - 1)
    predicted = predict_memory("tp", cfg, len(prompts), 8, tp=4, mode="infer", new_tokens=5).kv_cache
    for rank, (tokens, logits, kv_bytes) in enumerate(pools(4).run(generate_on_rank, name, prompts)):
        assert tokens == expected, (rank, tokens, expected)
        check_step_logits(ref, prompts, tokens, logits, rank)
        assert kv_bytes * cfg.n_kv_heads == single_cache, (rank, kv_bytes, single_cache)
        assert kv_bytes == predicted, (kv_bytes, predicted)


def test_memory_and_traffic_models_count_the_copies():
    from torchtsp.analysis import param_elements, predict_comm, predict_memory

    cfg = torchtsp.get_preset("llama3.1-8b")  # 8 KV heads
    h, d, L = cfg.dim, cfg.head_dim, cfg.n_layers
    at16 = param_elements("tp", cfg, tp=16)
    at8 = param_elements("tp", cfg, tp=8)
    # From 8 to 16 ranks wq, wo and the MLP halve; wk, wv stay one KV head per rank.
    kv = 2 * h * d
    assert at8["layers"] - at16["layers"] == L * ((2 * h * cfg.n_heads * d + 3 * h * cfg.ffn_dim) // 16)
    assert at16["layers"] == L * ((2 * h * cfg.n_heads * d + 3 * h * cfg.ffn_dim) // 16 + kv)
    comm = predict_comm("tp", cfg, 1, 4096, tp=16, dtype_bytes=2)
    base = predict_comm("tp", cfg.replace(n_kv_heads=16), 1, 4096, tp=16, dtype_bytes=2)
    assert comm.grad_sync - base.grad_sync == L * 2 * (2 - 1) * kv * 4 // 2  # float32 sums over pairs of ranks
    tp16, tp8 = (predict_memory("tp", cfg, 1, 8192, tp=T, mode="infer", new_tokens=1).kv_cache for T in (16, 8))
    assert tp16 == tp8  # one KV head per rank either way


def test_training_with_copies_matches_one_device_and_its_checkpoint_resumes_at_t2(pools, tmp_path):
    train_with_kv_copies_then_resume_at_two(pools, tmp_path, "tp")


def test_predicted_peak_memory_with_kv_copies_within_15_percent(pools):
    """The memory model's reference walk with TP's copied KV heads (weights, K/V activations and their gradients
    of one head per rank), against one measured forward + backward; the bound of tests/test_analysis.py."""
    measured, predicted = measured_and_predicted_peak(pools, "tp")
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)
