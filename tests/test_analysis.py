"""The analytic models (torchtsp.analysis) and ``torchtsp plan``: crossover, sanity, CLI speed, calibration."""

import argparse
import contextlib
import json
import subprocess
import sys
import time
from fractions import Fraction

import pytest

import torchtsp
from torchtsp.analysis import (
    layer_weight_elements,
    predict_comm,
    predict_memory,
    tp_layer_forward_recv_elements,
    tsp_layer_forward_recv_elements,
    tsp_tp_crossover_tokens,
)
from torchtsp.analysis.plan import add_plan_arguments, run_plan

PAPER = torchtsp.get_preset("paper-7b")
LLAMA3 = torchtsp.get_preset("llama3-8b")


# ---------------------------------------------------------------- the TSP / TP crossover


@pytest.mark.parametrize("world", [2, 8])
def test_paper_model_crossover_is_exactly_8h(world):
    """g = 1, F = 4h: TSP's forward traffic per layer is at most TP's exactly when B·S >= 8h."""
    h = PAPER.dim
    assert PAPER.group_size == 1 and PAPER.ffn_dim == 4 * h
    assert tsp_tp_crossover_tokens(PAPER) == 8 * h
    for seq_len in (8 * h - 1, 8 * h, 8 * h + 1, 4 * h, 16 * h):
        tsp = tsp_layer_forward_recv_elements(PAPER, 1, seq_len, world)
        tp = tp_layer_forward_recv_elements(PAPER, 1, seq_len, world)
        assert (tsp <= tp) == (seq_len >= 8 * h), (seq_len, tsp, tp)
    at = 8 * h
    assert tsp_layer_forward_recv_elements(PAPER, 1, at, world) == tp_layer_forward_recv_elements(PAPER, 1, at, world)


def test_gqa_crossover_formula_llama3():
    """TSP <= TP  <=>  P + 2·B·S·h/g <= 4·B·S·h  <=>  B·S >= P / (4h - 2h/g) = h(2 + 2/g + 3F/h) / (4 - 2/g)."""
    h, g, F = LLAMA3.dim, LLAMA3.group_size, LLAMA3.ffn_dim
    crossover = tsp_tp_crossover_tokens(LLAMA3)
    assert g == 4
    P = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # wq, wo; wk, wv (8 of 32 heads); gate, up, down
    assert layer_weight_elements(LLAMA3) == P
    assert crossover == Fraction(P, 4 * h - Fraction(2 * h, g))
    assert crossover == h * (2 + Fraction(2, g) + Fraction(3 * F, h)) / (4 - Fraction(2, g))
    # At the crossover the two (unrounded) volumes are equal.
    assert P + 2 * crossover * h / g == 4 * crossover * h
    below, above = int(crossover), int(crossover) + 1  # 15213 < B·S* = 15213.7 < 15214
    for batch in (1,):
        for tokens, tsp_wins in ((below, False), (above, True)):
            tsp = tsp_layer_forward_recv_elements(LLAMA3, batch, tokens, 8)
            tp = tp_layer_forward_recv_elements(LLAMA3, batch, tokens, 8)
            assert (tsp <= tp) == tsp_wins, (tokens, tsp, tp)
    # The condition is on B·S: two sequences of half the length give the same volumes.
    for tokens in (2 * below, 2 * above):
        assert tsp_layer_forward_recv_elements(LLAMA3, 2, tokens // 2, 8) == \
            tsp_layer_forward_recv_elements(LLAMA3, 1, tokens, 8)
    # GQA moves less K/V, so TSP catches up with TP at fewer tokens than MHA would (8h).
    assert crossover < 8 * h


# ---------------------------------------------------------------- sanity of the models

LAYOUTS = [("dp", {}), ("tsp", {"tsp": 8}), ("tp", {"tp": 8}), ("tp", {"tp": 8, "sequence_parallel": True}),
           ("sp", {"sp": 8}), ("tp_sp", {"tp": 4, "sp": 2}), ("tp_sp", {"tp": 2, "sp": 4})]


@pytest.mark.parametrize("scheme,kw", LAYOUTS)
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_memory_grows_with_sequence_length(scheme, kw, mode):
    totals = []
    # One TSP schedule throughout: auto switches from activations-move to the leaner weights-move prefill at
    # the crossover (8h tokens), so its peak legitimately drops there.
    infer = {"schedule": "weights"} if mode == "infer" else {}
    for seq_len in (4096, 16384, 65536, 131072):
        m = predict_memory(scheme, PAPER, 1, seq_len, dtype_bytes=2, mode=mode, **infer, **kw)
        assert m.params + m.optimizer <= m.total <= m.params + m.grads + m.optimizer + m.activations + m.transient \
            + m.kv_cache
        totals.append(m.total)
    assert totals == sorted(totals) and totals[-1] > totals[0]


def test_memory_shrinks_with_tsp_degree_and_tsp_is_leanest_at_long_context():
    totals = [predict_memory("tsp", PAPER, 1, 131072, tsp=D, dtype_bytes=2).total for D in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True)
    assert totals[-1] < totals[0] / 4
    tsp = predict_memory("tsp", PAPER, 1, 131072, tsp=8, dtype_bytes=2).total
    for scheme, kw in LAYOUTS[2:]:
        assert tsp < predict_memory(scheme, PAPER, 1, 131072, dtype_bytes=2, **kw).total, scheme
    # Recompute and no optimizer only ever lower the peak.
    for scheme, kw in LAYOUTS[1:]:
        full = predict_memory(scheme, PAPER, 1, 131072, dtype_bytes=2, **kw).total
        assert predict_memory(scheme, PAPER, 1, 131072, dtype_bytes=2, recompute=True, **kw).total <= full
        assert predict_memory(scheme, PAPER, 1, 131072, dtype_bytes=2, optimizer=None, **kw).total <= full


@pytest.mark.parametrize("scheme,kw", LAYOUTS)
def test_comm_grows_with_tokens(scheme, kw):
    # The per-layer volumes themselves are checked against hand arithmetic in test_analysis_arithmetic.py.
    degrees = {k: v for k, v in kw.items() if k != "sequence_parallel"}
    batch = 8 if scheme == "dp" else 1
    deg = {"dp": 8} if scheme == "dp" else degrees
    previous = -1
    for seq_len in (4096, 16384, 131072):
        c = predict_comm(scheme, PAPER, batch, seq_len, dtype_bytes=2, **deg,
                         sequence_parallel=kw.get("sequence_parallel", False))
        assert c.total >= PAPER.n_layers * (c.layer_forward + c.layer_backward) > 0 or scheme == "dp"
        assert c.total >= previous
        previous = c.total


@pytest.mark.parametrize("scheme,kw", LAYOUTS)
def test_selective_recompute_saves_between_none_and_full(scheme, kw):
    """Saved activations: full < selective < none for every scheme at the paper's 128K. The gap to none is, by
    arithmetic, two bf16 [tokens, F] tensors per layer of the rank's tokens and FFN slice: silu and the product for
    the reference block's schemes; for TSP the D shards' gate and up, [tokens, F/D] each."""
    acts = {p: predict_memory(scheme, PAPER, 1, 131072, dtype_bytes=2, recompute=p, **kw).activations
            for p in ("none", "full", "selective")}
    assert acts["full"] < acts["selective"] < acts["none"], acts
    tokens = 131072 // (kw.get("sp", 1) * kw.get("tsp", 1))
    assert acts["none"] - acts["selective"] == PAPER.n_layers * 2 * 2 * tokens * PAPER.ffn_dim // kw.get("tp", 1)


def test_plan_prints_each_recompute_policy_beside_the_paper(capsys):
    """The multi-node plan of the paper's model: each policy's peak, and the paper's 38.8 GB (TSP 8 at 128K)."""
    assert run_plan(_args("--preset", "paper-7b", "--seq-len", "131072", "--gpus-per-node", "8", "--nodes", "8",
                          "--zero", "3", "--batch-size", "8")) == 0
    out = capsys.readouterr().out
    assert "the paper measured 38.8 GB" in out
    lines = {line.split()[0]: line for line in out.splitlines() if "activations" in line and "peak" in line}
    assert set(lines) == {"none", "full", "selective"}
    assert "<= the paper's 38.8 GB" in lines["full"]
    # Without --batch-size, one sequence per replica: the command as written (B = 8 over dp = 8).
    assert run_plan(_args("--preset", "paper-7b", "--seq-len", "131072", "--gpus-per-node", "8", "--nodes", "8")) == 0
    out = capsys.readouterr().out
    assert "B=8, S=131,072, 64 GPUs (8 nodes x 8), mesh pp=1 x dp=8 x tsp=8" in out
    # With stages, one sequence per microbatch (the default: pp of them) of each of the dp = 16 / (2 x 4) replicas.
    assert run_plan(_args("--preset", "paper-7b", "--seq-len", "131072", "--gpus", "16", "--pp", "2",
                          "--tsp", "4")) == 0
    assert "B=4, S=131,072, 16 GPUs, mesh pp=2 x dp=2 x tsp=4, 2 microbatches" in capsys.readouterr().out
    # An explicit batch the replicas cannot share is still refused.
    with pytest.raises(ValueError, match="batch size 4 must be divisible by the DP degree 8"):
        run_plan(_args("--preset", "paper-7b", "--seq-len", "131072", "--gpus-per-node", "8", "--nodes", "8",
                       "--batch-size", "4"))
    # One node of 8 GPUs: the table's first layout, TSP8, is the paper's too.
    assert run_plan(_args("--preset", "paper-7b", "--seq-len", "131072", "--gpus", "8")) == 0
    out = capsys.readouterr().out
    assert "recompute policies, TSP8 (the table's first) (per GPU; the paper measured 38.8 GB" in out


def test_bad_layouts_are_value_errors():
    predict_memory("tsp", LLAMA3, 1, 4096, tsp=16)  # 8 KV heads, each copied on 2 ranks
    with pytest.raises(ValueError, match="n_kv_heads=3 divisible by 4, or 4 a multiple of it"):
        predict_memory("tsp", torchtsp.ModelConfig(dim=96, n_heads=12, n_kv_heads=3), 1, 4096, tsp=4)
    predict_memory("tp", LLAMA3, 1, 4096, tp=16)  # TP copies KV heads too
    with pytest.raises(ValueError, match="n_kv_heads=3 divisible by 4, or 4 a multiple of it"):
        predict_memory("tp", torchtsp.ModelConfig(dim=96, n_heads=12, n_kv_heads=3), 1, 4096, tp=4)
    with pytest.raises(ValueError, match="divisible by the DP degree"):
        predict_memory("dp", PAPER, 1, 4096, dp=8)
    with pytest.raises(ValueError, match="zigzag"):
        predict_memory("sp", PAPER, 1, 4097, sp=2)
    with pytest.raises(ValueError, match="does not use"):
        predict_memory("tp", PAPER, 1, 4096, tsp=2)
    with pytest.raises(ValueError, match="unknown scheme"):
        predict_memory("pp", PAPER, 1, 4096)


# ---------------------------------------------------------------- torchtsp plan


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_prints_every_layout_a_recommendation_and_the_paper(capsys):
    assert run_plan(_args("--preset", "paper-7b", "--seq-len", "131072", "--gpus", "8")) == 0
    out = capsys.readouterr().out
    for label in ("TSP8", "TP8", "SP8", "TP4xSP2", "TP2xSP4", "DP8"):
        assert label in out
    assert "recommended: TSP8" in out
    for figure in ("38.8", "70.0", "85.0", "140.0", "31.0", "31.5"):
        assert figure in out
    assert "Assumptions that make the figures comparable" in out


def test_plan_json_parses(capsys):
    assert run_plan(_args("--json", "--gpus", "8", "--batch-size", "8", "--seq-len", "32768")) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["layout"]: r for r in data["rows"]}
    assert rows["DP8"]["memory_bytes"]["total"] > rows["TSP8"]["memory_bytes"]["total"]
    assert data["recommendation"]["layouts"]
    assert {p["layout"] for p in data["paper"]["figures"]} == {"TSP8", "TP8", "TP4xSP2", "TP2xSP4"}
    assert run_plan(_args("--json", "--sweep", "--preset", "llama3-8b", "--mode", "infer")) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert [s["seq_len"] for s in sweep] == [4096 * 2**k for k in range(7)]
    assert data["paper"] is not None and all(s["recommendation"]["layouts"] for s in sweep)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--gpus"):
        run_plan(_args("--gpus", "0"))
    with pytest.raises(ValueError, match="--seq-len"):
        run_plan(_args("--seq-len", "-4"))


def test_plan_runs_offline_in_under_two_seconds():
    """Interpreter start included; the planner must not import torch."""
    code = ("import argparse, sys\n"
            "from torchtsp.analysis.plan import add_plan_arguments, run_plan\n"
            "p = argparse.ArgumentParser(); add_plan_arguments(p)\n"
            "run_plan(p.parse_args(['--preset', 'paper-7b', '--seq-len', '131072', '--gpus', '8', '--sweep']))\n"
            "run_plan(p.parse_args(['--preset', 'paper-7b', '--seq-len', '131072', '--gpus', '8']))\n"
            "assert 'torch' not in sys.modules, 'the planner imported torch'\n")
    best = float("inf")
    for _ in range(3):  # the best of three runs: a loaded test machine should not fail a 0.1 s command
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        best = min(best, time.perf_counter() - start)
        assert result.returncode == 0, result.stderr
        if best < 2.0:
            break
    assert best < 2.0, f"torchtsp plan took {best:.2f}s"


# ---------------------------------------------------------------- against real runs

CALIBRATION = {
    "mha": dict(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=257, n_layers=2, max_seq_len=1024),
    "gqa": dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=257, n_layers=2, max_seq_len=1024),
    "weights": dict(dim=512, n_heads=8, n_kv_heads=8, ffn_dim=1024, vocab_size=257, n_layers=2, max_seq_len=1024),
    # Not used to fit the model (D = 2 and 4 were): six heads, run at D = 3.
    "mha6": dict(dim=96, n_heads=6, n_kv_heads=6, ffn_dim=288, vocab_size=257, n_layers=2, max_seq_len=1024),
    "gqa6": dict(dim=96, n_heads=6, n_kv_heads=3, ffn_dim=288, vocab_size=257, n_layers=2, max_seq_len=1024),
    "weights6": dict(dim=576, n_heads=6, n_kv_heads=6, ffn_dim=1152, vocab_size=257, n_layers=2, max_seq_len=1024),
    # Hybrid: 3 sliding layers (window 64) and a full one; at S = 2048 a sliding layer's window K/V is a small
    # share of the whole sequence's.
    "hybrid": dict(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=257, n_layers=4, max_seq_len=4096,
                   layer_types=("sliding_attention",) * 3 + ("full_attention",), sliding_window=64),
}


def peak_on_rank(scheme, world, name, batch, seq_len, recompute=False, degrees=None):
    """measure_peak of one forward + backward of ``scheme`` on this rank (``degrees``: the mesh, default
    {scheme: world})."""
    import torch

    from helpers import batch as make_batch
    from torchtsp.memory import measure_peak

    cfg = torchtsp.ModelConfig(**CALIBRATION[name])
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(**(degrees or {scheme: world})),
                                 scheme, recompute=recompute)
    tokens, labels = make_batch(cfg, batch, seq_len)
    return measure_peak(lambda: model.loss(tokens, labels).backward(), model)[1]


@pytest.mark.parametrize("scheme,degrees", [("sp", {"sp": 4}), ("tp_sp", {"sp": 2, "tp": 2})])
def test_predicted_peak_counts_only_the_window_keys_of_sliding_layers(pools, scheme, degrees):
    """SP and TP x SP keep a sliding layer's own and received window K/V, not the whole sequence's. Tighter than
    the 15% above: the walk is the calibrated one, and the window's K/V change the peak by 14% here (seen:
    SP +0.0%, TP x SP -1.4%; a model keeping the whole sequence's K/V predicts SP +14%)."""
    seq_len, world = 2048, 4
    measured = max(pools(world).run(peak_on_rank, scheme, world, "hybrid", 1, seq_len, False, degrees))
    predicted = predict_memory(scheme, torchtsp.ModelConfig(**CALIBRATION["hybrid"]), 1, seq_len, optimizer=None,
                               pruned_kv=True, **degrees).total
    print(f"\n{scheme} {degrees} hybrid S={seq_len}: measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted / 2**20:.2f} MiB ({predicted / measured:.3f})")
    assert abs(predicted - measured) <= 0.05 * measured


@pytest.mark.parametrize("scheme,batch", [("tsp", 1), ("dp", 2), ("sp", 1)])
@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_predicted_peak_memory_within_15_percent_of_measured(pools, scheme, batch, name):
    world, seq_len = 2, 1024
    measured = max(pools(world).run(peak_on_rank, scheme, world, name, batch, seq_len))
    predicted = predict_memory(scheme, torchtsp.ModelConfig(**CALIBRATION[name]), batch, seq_len, optimizer=None,
                               pruned_kv=True, **{scheme: world}).total  # gloo: the K/V exchange is pruned
    print(f"\n{scheme} D={world} {name} S={seq_len}: measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted / 2**20:.2f} MiB ({predicted / measured:.3f})")
    assert abs(predicted - measured) <= 0.15 * measured


@pytest.mark.parametrize("world", [2, 4])
def test_predicted_tsp_peak_under_recompute_within_15_percent(pools, world):
    """Under recompute a TSP layer's attention activations are rebuilt in backward, while its MLP's gate and up
    are projected again one shard at a time inside the backward ring (never all D at once). 15%, as for the other
    schemes (seen: +4% at D = 2, +5% at D = 4, where attention backward sets the peak)."""
    seq_len = 1024
    cfg = torchtsp.ModelConfig(**CALIBRATION["mha"])
    measured = max(pools(world).run(peak_on_rank, "tsp", world, "mha", 1, seq_len, True))
    predicted = predict_memory("tsp", cfg, 1, seq_len, optimizer=None, recompute=True, tsp=world, pruned_kv=True).total
    print(f"\ntsp recompute D={world} S={seq_len}: measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted / 2**20:.2f} MiB ({predicted / measured:.3f})")
    assert abs(predicted - measured) <= 0.15 * measured


@pytest.mark.parametrize("scheme,batch", [("tsp", 1), ("dp", 2), ("sp", 1)])
def test_predicted_peak_under_selective_recompute_within_15_percent(pools, scheme, batch):
    """Selective recompute (the MLP's hidden state recomputed; TSP's MLP keeps its input only) against the
    measured peak, the same 15% as the other policies."""
    world, seq_len = 2, 1024
    measured = max(pools(world).run(peak_on_rank, scheme, world, "mha", batch, seq_len, "selective"))
    predicted = predict_memory(scheme, torchtsp.ModelConfig(**CALIBRATION["mha"]), batch, seq_len, optimizer=None,
                               recompute="selective", pruned_kv=True, **{scheme: world}).total
    print(f"\n{scheme} selective D={world} S={seq_len}: measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted / 2**20:.2f} MiB ({predicted / measured:.3f})")
    assert abs(predicted - measured) <= 0.15 * measured


@pytest.mark.parametrize("world", [1, 2, 4])
def test_predicted_tsp_peak_holds_when_weights_dominate(pools, world):
    """With short sequences, weight-sized buffers set the peak: at D = 4 attention backward's shards in flight
    and the float32 partial gradients on their way to their owners (an owner holds every rank's until the
    reduce is waited for); at D = 1 and 2 the MLP backward's travelling float32 gradients. 10%: the walk's
    other terms are fits at D = 1, 2, 4 (seen here: +3%, -6%, -5%)."""
    seq_len = 64
    cfg = CALIBRATION["weights"]
    measured = max(pools(world).run(peak_on_rank, "tsp", world, "weights", 1, seq_len))
    predicted = predict_memory("tsp", torchtsp.ModelConfig(**cfg), 1, seq_len, optimizer=None, tsp=world,
                               pruned_kv=True).total
    print(f"\ntsp D={world} S={seq_len}: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB")
    assert abs(predicted - measured) <= 0.10 * measured


@pytest.mark.parametrize("scheme,batch", [("tsp", 1), ("dp", 3), ("sp", 1)])
@pytest.mark.parametrize("name", ["mha6", "gqa6"])
def test_predicted_peak_memory_holds_at_three_ranks_on_a_six_head_model(pools, scheme, batch, name):
    """Out of sample: D = 3 and six-head shapes were not among the runs the walk's terms were fitted on."""
    world, seq_len = 3, 1020  # zigzag over 3 ranks needs S divisible by 6
    measured = max(pools(world).run(peak_on_rank, scheme, world, name, batch, seq_len))
    predicted = predict_memory(scheme, torchtsp.ModelConfig(**CALIBRATION[name]), batch, seq_len, optimizer=None,
                               pruned_kv=True, **{scheme: world}).total
    print(f"\n{scheme} D={world} {name} S={seq_len}: measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted / 2**20:.2f} MiB ({predicted / measured:.3f})")
    assert abs(predicted - measured) <= 0.15 * measured


@pytest.mark.parametrize("name,seq_len,recompute", [("mha6", 1020, True), ("weights6", 60, False)])
def test_predicted_tsp_peak_holds_at_three_ranks_under_recompute_and_when_weights_dominate(pools, name, seq_len,
                                                                                          recompute):
    measured = max(pools(3).run(peak_on_rank, "tsp", 3, name, 1, seq_len, recompute))
    predicted = predict_memory("tsp", torchtsp.ModelConfig(**CALIBRATION[name]), 1, seq_len, optimizer=None,
                               recompute=recompute, tsp=3, pruned_kv=True).total
    print(f"\ntsp D=3 {name} S={seq_len} recompute={recompute}: measured {measured / 2**20:.2f} MiB, predicted "
          f"{predicted / 2**20:.2f} MiB ({predicted / measured:.3f})")
    assert abs(predicted - measured) <= 0.15 * measured


def traffic_on_rank(scheme, degrees, name, batch, seq_len, dtype=None):
    """Bytes this rank receives over every axis in one forward + backward."""
    import torch

    from helpers import batch as make_batch

    cfg = torchtsp.ModelConfig(**CALIBRATION[name])
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg).to(dtype or torch.float32), torchtsp.init_mesh(**degrees),
                                 scheme)
    tokens, labels = make_batch(cfg, batch, seq_len)
    with contextlib.ExitStack() as stack:
        stats = [stack.enter_context(comm.counting()) for comm in model.comms().values()]
        model.loss(tokens, labels).backward()
    return sum(s.total_recv for s in stats), model.traffic_seq_rank()


@pytest.mark.parametrize("scheme,degrees", [("tsp", {"tsp": 2}), ("dp", {"dp": 2}), ("sp", {"sp": 2}),
                                            ("tp", {"tp": 2})])
def test_step_traffic_equals_counted_bytes(pools, scheme, degrees):
    batch, seq_len = 2, 32
    cfg = torchtsp.ModelConfig(**CALIBRATION["gqa"])
    counted = pools(2).run(traffic_on_rank, scheme, degrees, "gqa", batch, seq_len)
    # On gloo the K/V exchange of a sequence axis is causally pruned: each rank's bytes depend on its rank there.
    assert [seq_rank for _, seq_rank in counted] == ([0, 1] if scheme in ("tsp", "sp") else [None, None])
    for got, seq_rank in counted:
        assert got == predict_comm(scheme, cfg, batch, seq_len, **degrees, seq_rank=seq_rank).total, seq_rank


def test_sp_traffic_in_bf16_counts_the_dkv_reduce_scatter_in_float32(pools):
    """K/V travel in bf16, their gradients in float32 (the zigzag kernel's dK/dV): the model must say so."""
    import torch

    batch, seq_len = 2, 32
    cfg = torchtsp.ModelConfig(**CALIBRATION["gqa"])
    counted = pools(2).run(traffic_on_rank, "sp", {"sp": 2}, "gqa", batch, seq_len, torch.bfloat16)
    for got, seq_rank in counted:
        assert got == predict_comm("sp", cfg, batch, seq_len, sp=2, dtype_bytes=2, seq_rank=seq_rank).total, seq_rank


# ---------------------------------------------------------------- plan's tables: fits first, columns hold, one format


def _table(out: str, first_header: str = "layout") -> tuple[str, list[str]]:
    """The header line and the row lines of the first table in ``out`` (rows end at a blank or unindented note)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_header])
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or line.lstrip().startswith(("(", "n/a", "ceiling", "peak GB")):
            break
        rows.append(line)
    return lines[start], rows


def _columns(header: str) -> list[str]:
    return [c for c in header.strip().split("  ") if c]


def _assert_aligned(header: str, rows: list[str]) -> None:
    """Every cell sits under its header: right-aligned numbers end where their header ends."""
    names = _columns(header)
    ends = {name: header.index(name) + len(name) for name in names}
    for row in rows:
        for name in ("peak GB", "tokens/s", "comm GB/step", "fwd GB/layer"):
            if name in ends:
                end = ends[name]
                assert row[end - 1] != " " and (end == len(row) or row[end] == " "), (name, row)


def test_plan_ranks_the_layouts_that_fit_first_and_keeps_the_columns(capsys):
    # llama3-8b at 32K on 8 GPUs of 80 GB: some layouts fit, some do not, DP8 cannot run a batch of 1.
    assert run_plan(_args("--preset", "llama3-8b", "--seq-len", "32768", "--gpus", "8")) == 0
    header, rows = _table(capsys.readouterr().out)
    assert "fits" in _columns(header)
    fits_at = header.index("fits")
    verdicts = [row[fits_at:fits_at + 4].strip() for row in rows]
    assert set(verdicts) == {"yes", "no", "n/a"} and verdicts == sorted(verdicts, key=["yes", "no", "n/a"].index)
    # The planner's own predictions, independently: each "yes" row's peak is within 80 GB, each "no" above.
    assert run_plan(_args("--preset", "llama3-8b", "--seq-len", "32768", "--gpus", "8", "--json")) == 0
    data = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for row, verdict in zip(rows, verdicts):
        label = row.split()[0]
        if verdict != "n/a":
            assert (data[label]["memory_bytes"]["total"] <= 80e9) == (verdict == "yes"), row
    dp8 = next(row for row in rows if row.startswith("DP8 "))
    assert len(dp8.split()) == len(_columns(header)) + 1  # "see (1)" is one cell of two words
    _assert_aligned(header, rows)


def test_plan_numbers_have_one_format(capsys):
    for argv in ((), ("--sweep",), ("--hardware", "h100")):
        assert run_plan(_args("--preset", "llama3-8b", "--seq-len", "131072", "--gpus", "16", *argv)) == 0
        out = capsys.readouterr().out
        assert "e+" not in out and "MB" not in out, out
        assert "131,072" in out and "131072" not in out, argv  # thousands separators on lengths
    assert run_plan(_args("--hardware", "mi300x", "--preset", "paper-7b", "--gpus", "1024", "--tsp", "8",
                          "--seq-len", "128k")) == 0
    out = capsys.readouterr().out
    assert "173,000,000" in out and "e+" not in out


def test_plan_hardware_has_a_fits_column_and_ranks_fitting_layouts_first(capsys):
    assert run_plan(_args("--hardware", "h100", "--preset", "llama3-8b", "--seq-len", "65536", "--gpus", "8")) == 0
    header, rows = _table(capsys.readouterr().out)
    assert {"peak GB", "fits", "step s"} <= set(_columns(header))
    fits_at, step_at = header.index("fits"), header.index("step s")
    verdicts = [row[fits_at:fits_at + 4].strip() for row in rows]
    assert "yes" in verdicts and "no" in verdicts and verdicts == sorted(verdicts, reverse=True)
    # TSP8's peak from the memory model itself, against the H100's 80 GB.
    tsp = predict_memory("tsp", LLAMA3, 1, 65536, tsp=8, dtype_bytes=2).total
    assert (tsp <= 80e9) == (verdicts[[row.split()[0] for row in rows].index("TSP8")] == "yes")
    steps = [float(row[:step_at + 6].split()[-1]) for row in rows]
    for group in ("yes", "no"):
        within = [s for s, v in zip(steps, verdicts) if v == group]
        assert within == sorted(within)
    _assert_aligned(header, rows)
