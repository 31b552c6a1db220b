"""The analytic models against arithmetic done here by hand from the model's shapes, never from the models' own
fields: parameter counts, the per-layer forward traffic of TSP, TP and SP, DP's gradient sum, the TSP / TP
crossover, weights + gradients + optimizer bytes per layout, KV-cache bytes, and a step's compute time, at
degrees the memory model was not fitted at (D = 3 and 8) and on other model shapes. Single process, torch-free.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

import pytest

import torchtsp
from torchtsp.analysis import predict_comm, predict_memory, tsp_tp_crossover_tokens
from torchtsp.analysis.hardware import HARDWARE, predict_step
from torchtsp.analysis.plan import add_plan_arguments, run_plan

PAPER = torchtsp.get_preset("paper-7b")  # h 4096, L 32, MHA, F 16384, V 32000, untied
LLAMA3 = torchtsp.get_preset("llama3-8b")  # h 4096, L 32, 32 heads / 8 KV heads, F 14336, V 128256, untied
# Two shapes nothing was fitted on: 6 MHA heads (D = 3), and 16 query heads over 4 KV heads (D = 8 copies them).
SIX = torchtsp.ModelConfig(dim=192, n_layers=3, n_heads=6, n_kv_heads=6, ffn_dim=576, vocab_size=1001,
                           max_seq_len=4096)
WIDE = torchtsp.ModelConfig(dim=512, n_layers=2, n_heads=16, n_kv_heads=4, ffn_dim=1408, vocab_size=32003,
                            max_seq_len=4096, tie_embeddings=True)

# Per-layer matrix elements, written out: wq and wo h x h, wk and wv h x h/g, w_gate, w_up, w_down h x F.
P_LLAMA3 = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # 218,103,808
P_PAPER = 4 * 4096 * 4096 + 3 * 4096 * 16384  # 268,435,456 (16 h^2 with F = 4h)
# Whole models: layers, two norms per layer, the final norm, embedding and (untied) head.
N_LLAMA3 = 32 * (P_LLAMA3 + 2 * 4096) + 4096 + 2 * 128256 * 4096
N_PAPER = 32 * (P_PAPER + 2 * 4096) + 4096 + 2 * 32000 * 4096


def test_parameter_counts_are_the_published_ones():
    assert N_LLAMA3 == 8_030_261_248  # Llama 3 8B's published count
    for cfg, n in ((LLAMA3, N_LLAMA3), (PAPER, N_PAPER)):
        parts = torchtsp.analysis.memory_model.param_elements("dp", cfg)
        assert sum(parts.values()) == n
        with_model = sum(torchtsp.analysis.memory_model.param_elements("tsp", cfg, tsp=1).values())
        assert with_model == n


def test_the_crossover_is_p_over_4h_minus_2h_over_g():
    # TSP moves P + 2·B·S·h/g elements per layer forward, TP 4·B·S·h: equal at B·S = P / (4h - 2h/g).
    assert tsp_tp_crossover_tokens(LLAMA3) == Fraction(P_LLAMA3, 4 * 4096 - 2 * 4096 // 4)
    assert int(tsp_tp_crossover_tokens(LLAMA3)) == 15213
    assert tsp_tp_crossover_tokens(PAPER) == 8 * 4096


@pytest.mark.parametrize("cfg,P,D,B,S", [
    (LLAMA3, P_LLAMA3, 2, 1, 8192), (LLAMA3, P_LLAMA3, 8, 2, 4096), (LLAMA3, P_LLAMA3, 4, 3, 1000),
    (PAPER, P_PAPER, 8, 1, 131072),
    (SIX, 4 * 192 * 192 + 3 * 192 * 576, 3, 2, 1020),
    (WIDE, 2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1408, 8, 1, 4096),
])
def test_per_layer_forward_bytes_by_hand(cfg, P, D, B, S):
    """bf16, bytes one rank receives in one layer's forward: TSP all-gathers the layer's weights and every rank's
    K/V, 2·(P + 2·B·S·h/g)·(D-1)/D; TP all-reduces the attention and MLP outputs, 2 x 2·B·S·h·2·(D-1)/D (an
    all-reduce receives twice a reduce-scatter's share); SP's ring brings the others' K/V, 2·2·B·S·h/g·(D-1)/D."""
    h, g, e = cfg.dim, cfg.n_heads // cfg.n_kv_heads, 2
    kv = 2 * B * S * h // g
    if cfg is WIDE:  # 4 KV heads over 8 ranks: each rank holds a copy of one, so K/V count as 8 heads' worth
        kv = 2 * B * S * h // 2
        P = 2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1408
    assert predict_comm("tsp", cfg, B, S, tsp=D, dtype_bytes=e).layer_forward == e * (P + kv) * (D - 1) // D
    if cfg.n_heads % D == 0 and (cfg.n_kv_heads % D == 0 or D % cfg.n_kv_heads == 0):
        assert predict_comm("tp", cfg, B, S, tp=D, dtype_bytes=e).layer_forward == e * 2 * 2 * B * S * h * (D - 1) // D
    assert predict_comm("sp", cfg, B, S, sp=D, dtype_bytes=e).layer_forward == e * 2 * B * S * h // g * (D - 1) // D


@pytest.mark.parametrize("D", [2, 3, 8])
def test_dp_sums_every_gradient_in_float32(D):
    """An all-reduce of the N float32 gradients: each rank receives 2·N·4·(D-1)/D bytes (up to how the pieces
    round when D does not divide them)."""
    c = predict_comm("dp", LLAMA3, D, 4096, dp=D, dtype_bytes=2)
    assert c.grad_sync == pytest.approx(2 * N_LLAMA3 * 4 * (D - 1) / D, rel=1e-8)
    assert c.layer_forward == c.layer_backward == 0


def _plan_json(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(["--json", *argv])


def test_plan_weights_gradients_and_adamw_are_16_bytes_per_parameter_over_the_weight_shards(capsys):
    """bf16 weights and gradients, fp32 master and two fp32 moments: 2 + 2 + 12 bytes per parameter, divided by
    the ranks that shard the weights (TSP 8, TP x SP by T, SP none)."""
    assert run_plan(_plan_json("--preset", "paper-7b", "--seq-len", "131072", "--gpus", "8")) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    # The embedding and head rows split evenly (32000 / 8), the norms do not split: 2·(2L+1)·h replicated.
    norms = (2 * 32 + 1) * 4096
    for layout, shards in (("TSP8", 8), ("TP8", 8), ("SP8", 1), ("TP4xSP2", 4), ("TP2xSP4", 2)):
        m = rows[layout]["memory_bytes"]
        per_rank = (N_PAPER - norms) // shards + norms
        assert m["params"] == m["grads"] == 2 * per_rank, layout
        assert m["optimizer"] == 12 * per_rank, layout
        assert m["total"] >= 16 * per_rank, layout


@pytest.mark.parametrize("scheme,cfg,D", [("tsp", SIX, 3), ("sp", SIX, 3), ("tsp", WIDE, 8), ("tp", WIDE, 8)])
def test_weights_and_optimizer_bytes_at_degrees_not_fitted(scheme, cfg, D):
    h, d, L = cfg.dim, cfg.head_dim, cfg.n_layers
    shards = 1 if scheme == "sp" else D
    kv_heads = cfg.n_kv_heads if scheme == "sp" or cfg.n_kv_heads >= D else D  # a copy of one KV head per rank
    attention = 2 * h * cfg.n_heads * d + 2 * h * kv_heads * d
    rows = -(-cfg.vocab_size // shards)  # the vocabulary padded to a multiple of the shards
    per_rank = (L * (attention + 3 * h * cfg.ffn_dim)) // shards + (2 * L + 1) * h \
        + rows * h * (1 if cfg.tie_embeddings else 2)
    m = predict_memory(scheme, cfg, 2, 1020 if D == 3 else 1024, dtype_bytes=2, **{scheme: D})
    assert m.params == m.grads == 2 * per_rank
    assert m.optimizer == 12 * per_rank
    assert m.total >= m.params + m.optimizer
    bare = predict_memory(scheme, cfg, 2, 1020 if D == 3 else 1024, dtype_bytes=4, optimizer=None, **{scheme: D})
    assert bare.params == 4 * per_rank and bare.optimizer == 0


@pytest.mark.parametrize("scheme,cfg,D,layout,heads,slots", [
    # TSP's sequence layout and SP shard the sequence: prompt 1000 padded to a multiple of 2D, 1/D of it, then every
    # D-th of the 19 tokens written after the first (the last chosen one is never written).
    ("tsp", SIX, 3, "sequence", 6, 1002 // 3 + 7),
    ("sp", SIX, 3, "auto", 6, 1002 // 3 + 7),
    ("tsp", WIDE, 8, "sequence", 4, 1008 // 8 + 3),
    # TSP's heads layout: the n_kv/D KV heads of its head group, every token (the padded prompt and 19 more).
    ("tsp", SIX, 3, "heads", 2, 1002 + 19),
    ("tsp", SIX, 3, "auto", 2, 1002 + 19),
    # TSP's grouped layout: 4 KV heads over 8 ranks, c = 2 ranks per head, each half its tokens: 504 of the prompt
    # and 10 of the 19 decoded (the first member takes tokens 0, 2, ..., 18).
    ("tsp", WIDE, 8, "grouped", 1, 504 + 10),
    ("tsp", WIDE, 8, "auto", 1, 504 + 10),
    # TP holds every token of its KV heads: 4 KV heads over 8 ranks, a copy of one each.
    ("tp", WIDE, 8, "auto", 1, 1000 + 19),
])
def test_kv_cache_bytes_by_hand(scheme, cfg, D, layout, heads, slots):
    B, e = 3, 2
    m = predict_memory(scheme, cfg, B, 1000, mode="infer", new_tokens=20, dtype_bytes=e, kv_layout=layout,
                       **{scheme: D})
    assert m.kv_cache == cfg.n_layers * 2 * e * B * heads * slots * cfg.head_dim  # K and V of every layer
    assert m.total == m.params + m.kv_cache + m.transient and m.grads == m.optimizer == 0
    assert m.params + m.kv_cache < m.decode_peak <= m.total


@pytest.mark.parametrize("scheme,cfg,D,layout,match", [
    ("tsp", WIDE, 8, "heads", r"n_kv=4 KV heads on D=8 ranks"),  # 4 % 8 != 0
    ("tsp", SIX, 3, "grouped", r"n_kv=6 KV heads on D=3 ranks"),  # 3 % 6 != 0
    ("tp", WIDE, 8, "sequence", r"TSP layout"),
    ("tsp", SIX, 3, "rows", r"unknown kv_layout"),
])
def test_kv_layout_the_model_does_not_allow_is_refused(scheme, cfg, D, layout, match):
    with pytest.raises(ValueError, match=match):
        predict_memory(scheme, cfg, 1, 1000, mode="infer", new_tokens=20, kv_layout=layout, **{scheme: D})


def test_grouped_cache_is_one_dth_of_the_single_device_cache_and_half_of_tp_at_two_kv_heads():
    """The issue's goal shape: 2 KV heads on 4 ranks. TP copies each KV head on 2 ranks and stops at 1/n_kv of the
    one-device cache; grouped TSP stores 1/D of it, half of TP's; heads is not allowed, sequence stores 1/D too."""
    cfg = torchtsp.ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=257)
    kv = lambda scheme, layout, D: predict_memory(scheme, cfg, 4, 2048, mode="infer", new_tokens=33,
                                                  kv_layout=layout, **{scheme: D}).kv_cache
    single = kv("tsp", "sequence", 1)
    assert single == 4 * 2 * 4 * 4 * 2 * (2048 + 32) * 64
    assert kv("tsp", "grouped", 4) * 4 == single == kv("tsp", "sequence", 4) * 4
    assert kv("tp", "auto", 4) == single // 2 == 2 * kv("tsp", "auto", 4)


def test_step_compute_time_is_three_forwards_of_flops_at_the_given_mfu():
    """6 FLOPs per weight per token (forward 2, backward 4) for the layers and the head, and causal attention's
    QK^T and PV: 2·2·S²·h/2 per layer per sequence, forward; over the replica's GPUs at mfu x peak."""
    hw, S, mfu = HARDWARE["h100"], 32768, 0.4
    r = predict_step("tsp", LLAMA3, hw, gpus=8, degrees={"tsp": 8}, seq_len=S, mfu=mfu)
    forward = 2 * P_LLAMA3 * 32 * S + 2 * 4096 * 128256 * S + 32 * 2 * S * S * 4096
    assert r.compute_s == pytest.approx(3 * forward / (8 * hw.bf16_flops * mfu), rel=1e-12)
    assert r.tokens_per_s == pytest.approx(S / r.step_s, rel=1e-12) and r.step_s >= r.compute_s


@pytest.mark.parametrize("scheme,degrees", [("tsp", {"tsp": 2}), ("sp", {"sp": 2}), ("tp", {"tp": 2})])
def test_gemma_sandwich_norms_add_their_gradient_sums(scheme, degrees):
    """Gemma's two extra norms per layer (after each sublayer) are replicated like the others: each adds one
    float32 all-reduce of h values over the two ranks per layer, (D - 1)/D · 2 · h · 4 bytes received by hand
    (ring all-reduce: a reduce-scatter and an all-gather). tp sums norms only with Megatron-SP."""
    cfg = torchtsp.get_preset("tiny-gemma3")
    plain = cfg.replace(sandwich_norm=False)
    L, h = cfg.n_layers, cfg.dim
    extra = predict_comm(scheme, cfg, 2, 64, **degrees, dtype_bytes=4).grad_sync
    extra -= predict_comm(scheme, plain, 2, 64, **degrees, dtype_bytes=4).grad_sync
    assert extra == (0 if scheme == "tp" else 2 * L * 2 * h * 4 // 2)


def test_plan_shows_a_hybrids_local_and_global_layers_apart(capsys):
    """``plan --preset gemma3-4b --seq-len 131072``: a column per layer type; TSP's local layers receive the weights
    and only their window's keys (W = 1024 of 131,072 tokens), well under its global layers and under TP's."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--preset", "gemma3-4b", "--seq-len", "131072", "--gpus", "8"])
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "fwd GB/local layer" in out and "fwd GB/global layer" in out
    cfg = torchtsp.get_preset("gemma3-4b")
    tsp = predict_comm("tsp", cfg, 1, 131072, tsp=8, dtype_bytes=2).layer_types
    tp = predict_comm("tp", cfg, 1, 131072, tp=8, dtype_bytes=2).layer_types
    local, full = tsp["sliding_attention"]["forward"], tsp["full_attention"]["forward"]
    assert local < full / 4 and local < tp["sliding_attention"]["forward"] / 10
    assert tp["sliding_attention"] == tp["full_attention"]  # TP moves activations: the window changes nothing


def test_plan_infer_gives_a_hybrids_kv_cache_per_layer_type(capsys):
    """``plan --mode infer`` on gemma3-4b: one global layer's cache of 131,072 tokens is K and V of 4 KV heads of
    256 in bf16 per token, 0.537 GB; a local layer's in serve's paged cache is at most its window's 1024 positions
    spread over 65 blocks of 16 (a run of 1024 positions starting at a block's last slot touches 1 + 64 blocks),
    1,040 tokens' worth: 0.004 GB."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--preset", "gemma3-4b", "--seq-len", "131072", "--gpus", "8", "--mode", "infer"])
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    per_token = 2 * 2 * 4 * 256
    assert f"a global layer {per_token * 131072 / 1e9:.3f} GB" in out
    assert f"{per_token * 65 * 16 / 1e9:.3f} GB in serve's paged cache" in out
