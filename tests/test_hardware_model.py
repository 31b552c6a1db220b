"""The hardware model behind ``torchtsp plan --hardware``: FLOPs, step time, overlap, the paper comparison."""

import argparse
import json
import math

import pytest

from torchtsp.analysis.hardware import (
    HARDWARE,
    Hardware,
    ceiling_tokens_per_s,
    forward_flops,
    get_hardware,
    predict_step,
)
from torchtsp.analysis.plan import add_plan_arguments, run_plan
from torchtsp.presets import get_preset

PAPER = get_preset("paper-7b")
LLAMA = get_preset("llama3-8b")


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(argv)


def test_table_is_sane():
    for name, hw in HARDWARE.items():
        assert hw.name == name
        assert 100e12 <= hw.bf16_flops <= 3e15, name
        assert 1e12 <= hw.hbm_bytes_per_s <= 10e12 and 40e9 <= hw.hbm_bytes <= 300e9, name
        assert hw.inter_node_bytes_per_s < hw.intra_node_bytes_per_s < hw.hbm_bytes_per_s, name


def test_flops_match_the_6n_rule_at_short_context_and_attention_grows_quadratically():
    """At S = 1 attention is nothing and a step is 6 FLOPs per weight per token (plus the head); attention per
    sequence grows as S^2, the GEMMs as S."""
    f1 = forward_flops(PAPER, 1, 1)
    # 16 h^2 weights per layer (g = 1, F = 4h), 2 FLOPs each per token.
    assert f1.layers * f1.layer_gemm == 2 * PAPER.n_layers * 16 * PAPER.dim ** 2 and f1.attention == 2 * PAPER.dim
    a, b = forward_flops(PAPER, 1, 4096), forward_flops(PAPER, 1, 8192)
    assert b.attention == 4 * a.attention and b.layer_gemm == 2 * a.layer_gemm
    # 128K: attention is about two thirds of the FLOPs (2·S·h vs 2·16h^2 per token per layer: S/16h = 2).
    f = forward_flops(PAPER, 1, 131072)
    assert f.attention / (f.attention + f.layer_gemm) == pytest.approx(2 / 3, rel=1e-6)


def test_step_time_is_monotonic_in_mfu_flops_and_bandwidth():
    kw = dict(gpus=16, degrees={"tsp": 8}, seq_len=32768)
    base = predict_step("tsp", LLAMA, HARDWARE["h100"], **kw)
    assert base.step_s == pytest.approx(base.compute_s + base.exposed_s)
    assert 0 <= base.exposed_s <= base.comm_s
    assert predict_step("tsp", LLAMA, HARDWARE["h100"], mfu=0.5, **kw).step_s < base.step_s
    fast_link = Hardware("x", 989.4e12, 3.35e12, 80e9, 900e9, 100e9)
    assert predict_step("tsp", LLAMA, fast_link, **kw).step_s <= base.step_s
    assert predict_step("tsp", LLAMA, HARDWARE["a100"], **kw).step_s > base.step_s
    for mfu in (0.2, 0.4, 0.8):
        r = predict_step("tsp", LLAMA, HARDWARE["h100"], mfu=mfu, **kw)
        assert r.mfu_effective <= mfu + 1e-12  # communication only ever lowers the achieved fraction
        assert r.tokens_per_s <= ceiling_tokens_per_s(LLAMA, HARDWARE["h100"], 16, 32768) * mfu * (1 + 1e-9)


def test_tsp_hides_its_traffic_behind_gemms_and_tp_sp_does_not():
    """Same bytes at a link so slow that nothing hides: TSP's exposed time is its whole traffic; at a fast one
    TSP exposes less of its traffic than TP x SP, which waits on every collective."""
    kw = dict(gpus=8, seq_len=131072)
    hw = HARDWARE["mi300x"]
    tsp = predict_step("tsp", PAPER, hw, degrees={"tsp": 8}, **kw)
    tpsp = predict_step("tp_sp", PAPER, hw, degrees={"tp": 4, "sp": 2}, **kw)
    assert tpsp.exposed_s == pytest.approx(tpsp.comm_s)
    assert tsp.exposed_s < 0.5 * tsp.comm_s
    slow = Hardware("slow", hw.bf16_flops, hw.hbm_bytes_per_s, hw.hbm_bytes, 1e6, 1e6)
    crawl = predict_step("tsp", PAPER, slow, degrees={"tsp": 8}, **kw)
    assert crawl.exposed_s == pytest.approx(crawl.comm_s, rel=0.05)


def test_dp_gradient_sums_cross_the_nic():
    one = predict_step("tsp", LLAMA, HARDWARE["h100"], gpus=8, degrees={"tsp": 8}, seq_len=8192)
    many = predict_step("tsp", LLAMA, HARDWARE["h100"], gpus=64, degrees={"tsp": 8}, seq_len=8192)
    assert many.dp == 8 and many.exposed_s > one.exposed_s
    # 8 replicas, less than 8x the tokens: the fp32 gradient all-reduce after backward is exposed.
    assert one.tokens_per_s < many.tokens_per_s < 8 * one.tokens_per_s
    assert many.comm_s - one.comm_s == pytest.approx(many.exposed_s - one.exposed_s)


def test_paper_setting_prints_the_comparison_and_the_ceiling(capsys):
    assert run_plan(_args("--hardware", "mi300x", "--preset", "paper-7b", "--gpus", "1024", "--tsp", "8",
                          "--seq-len", "131072")) == 0
    out = capsys.readouterr().out
    for needle in ("173,000,000", "66,300,000", "DP128xTSP8", "DP128xTP4xSP2", "physical ceiling",
                   "cannot be training tokens per second"):
        assert needle in out, needle
    assert run_plan(_args("--hardware", "mi300x", "--preset", "paper-7b", "--gpus", "1024", "--tsp", "8",
                          "--seq-len", "131072", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    paper = data["paper"]
    ceiling = ceiling_tokens_per_s(PAPER, get_hardware("mi300x"), 1024, 131072)
    assert paper["ceiling_train"] == pytest.approx(ceiling)
    assert 1e6 < paper["ours_tsp"] < ceiling and paper["ours_tp_sp"] < paper["ours_tsp"]
    assert paper["paper_tsp"] > ceiling  # the paper's figure is not a training step's tokens/s counted once
    # 1024 x 1307.4 TFLOP/s over 3 x (2·16h^2·L + 2·h·V + 2·S·h·L) FLOPs per token.
    h, L, V, S = 4096, 32, 32000, 131072
    assert ceiling == pytest.approx(1024 * 1307.4e12 / (3 * (2 * 16 * h * h * L + 2 * h * V + 2 * S * h * L)))


@pytest.mark.parametrize("argv,match", [
    (("--mfu", "0"), r"--mfu must be in \(0, 1\]"),
    (("--mfu", "nan"), r"--mfu must be in \(0, 1\]"),
    (("--tsp", "16"), r"--tsp \(GPUs per replica\) must be between 1 and 8"),
    (("--gpus", "12"), r"divide --gpus=12"),
    (("--preset", "tiny-moe"), "dense models"),
    (("--mode", "infer"), "training steps"),
])
def test_hardware_plan_rejects_bad_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        run_plan(_args("--hardware", "h100", *argv))


def test_every_layout_of_a_node_is_priced(capsys):
    assert run_plan(_args("--hardware", "a100", "--preset", "llama3-8b", "--gpus", "32", "--seq-len", "16384",
                          "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(r["layout"] for r in data["rows"]) == sorted(
        ["DP4xTSP8", "DP4xTP8", "DP4xTP8+seqpar", "DP4xSP8", "DP4xTP4xSP2", "DP4xTP2xSP4"])
    assert data["paper"] is None


def test_predictions_are_finite():
    for hw in HARDWARE.values():
        r = predict_step("tp", LLAMA, hw, gpus=16, degrees={"tp": 8}, seq_len=4096)
        assert all(math.isfinite(x) and x >= 0 for x in (r.compute_s, r.comm_s, r.exposed_s, r.step_s))
