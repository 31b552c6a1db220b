"""``--kv-layout`` on generate, serve, bench --mode infer and plan --mode infer: it reaches the engine (the layout
used comes back in the summary, the ready message and the bench rows), and a layout the model does not allow is the
engine's one-line error before any rank starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from helpers import cli_in_process
from torchtsp.analysis.plan import add_plan_arguments, run_plan
from torchtsp.cli import build_parser, main
from torchtsp.presets import get_preset

TINY = get_preset("tiny")  # 8 heads, 4 KV heads, dim 128, 2 layers, head_dim 16


def test_every_command_offers_the_flag_with_its_rule():
    parser = build_parser()
    for argv in (["generate"], ["serve"], ["bench", "--mode", "infer"], ["plan", "--mode", "infer"]):
        assert parser.parse_args(argv).kv_layout == "auto", argv
        assert parser.parse_args([*argv, "--kv-layout", "sequence"]).kv_layout == "sequence", argv
    text = subprocess.run([sys.executable, "-m", "torchtsp", "generate", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--kv-layout {auto,heads,grouped,sequence}" in text and "n_kv % D == 0" in text and "D % n_kv == 0" in text


@pytest.mark.parametrize("command,args,message", [
    ("generate", ["--prompt-ids", "1,2", "--tsp", "2", "--kv-layout", "grouped"], "n_kv=4 KV heads on D=2 ranks"),
    ("generate", ["--prompt-ids", "1,2", "--scheme", "tp", "--tp", "2", "--kv-layout", "sequence"],
     "tp caches by heads"),
    ("bench", ["--mode", "infer", "--nproc", "2", "--kv-layout", "grouped", "--out", "unused"],
     "n_kv=4 KV heads on D=2 ranks"),
    ("bench", ["--mode", "train", "--kv-layout", "sequence", "--out", "unused"], "--kv-layout applies to --mode infer"),
    ("plan", ["--mode", "train", "--kv-layout", "heads"], "--kv-layout applies to --mode infer"),
])
def test_a_layout_the_model_does_not_allow_is_a_one_line_error_before_any_rank(capsys, command, args, message):
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtsp: error: ") and message in err and err.count("\n") == 1, err


def test_serve_checks_the_layout_before_any_rank_and_hands_it_to_the_ranks():
    from torchtsp.serve.server import _prepare

    with pytest.raises(ValueError, match="n_kv=4 KV heads on D=2 ranks"):
        _prepare(build_parser().parse_args(["serve", "--tsp", "2", "--kv-layout", "grouped"]))
    launch = _prepare(build_parser().parse_args(["serve", "--tsp", "2", "--kv-layout", "sequence"]))
    assert launch.settings["kv_layout"] == launch.kv_layout == "sequence"
    from torchtsp.serve.worker import ServeJob

    assert ServeJob(load=launch.load, address=(), authkey=b"", **launch.settings).kv_layout == "sequence"


@pytest.mark.multirank  # launches generate --tsp 2: two ranks of its own
def test_generate_reports_the_layout_it_decoded_with():
    # The command line's main in this process (its two ranks are processes): no interpreter start of its own.
    run = cli_in_process("generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--tsp", "2", "--kv-layout",
                         "sequence", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["kv_layout"] == "sequence" and len(out["tokens"][0]) == 6
    # TSP's sequence cache at D = 2: every KV head of half the tokens: 2 layers, K and V, 4 heads of 16, float32, the
    # prompt padded to 4 (2 each) and 1 of the 2 tokens written after it.
    assert out["kv_cache_bytes_per_rank"] == [2 * 2 * 4 * 16 * 4 * (2 + 1)] * 2


def _plan(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def _plan_rows(capsys, *argv) -> dict:
    assert run_plan(_plan("--json", "--mode", "infer", "--batch-size", "1", *argv)) == 0
    return {r["layout"]: r for r in json.loads(capsys.readouterr().out)["rows"]}


def test_plan_infer_models_the_chosen_layout(capsys):
    """llama3-8b (32 layers, 8 KV heads of 128, bf16), 16k tokens plus 1 new one: TSP8's cache per rank."""
    S, per_token_head = 16384, 32 * 2 * 2 * 128  # K and V of every layer, one head, one token, bf16
    heads = _plan_rows(capsys, "--preset", "llama3-8b", "--seq-len", "16k", "--gpus", "8", "--kv-layout", "heads")
    assert heads["TSP8"]["kv_layout"] == "heads"
    assert heads["TSP8"]["memory_bytes"]["kv_cache"] == per_token_head * 1 * S  # 8/8 heads, every token
    auto = _plan_rows(capsys, "--preset", "llama3-8b", "--seq-len", "16k", "--gpus", "8")
    assert auto["TSP8"]["memory_bytes"] == heads["TSP8"]["memory_bytes"]  # auto picks heads
    seq = _plan_rows(capsys, "--preset", "llama3-8b", "--seq-len", "16k", "--gpus", "8", "--kv-layout", "sequence")
    assert seq["TSP8"]["memory_bytes"]["kv_cache"] == per_token_head * 8 * (S // 8)  # every head, 1/8 of the tokens
    assert seq["TP8"] == heads["TP8"] and "kv_layout" not in seq["TP8"]  # the flag is TSP's
    grouped = _plan_rows(capsys, "--preset", "llama3-8b", "--seq-len", "16k", "--gpus", "16")
    assert grouped["TSP16"]["kv_layout"] == "grouped"  # 8 KV heads on 16 ranks: 2 per head, half its tokens each
    assert grouped["TSP16"]["memory_bytes"]["kv_cache"] == per_token_head * 1 * (S // 2)
    refused = _plan_rows(capsys, "--preset", "llama3-8b", "--seq-len", "16k", "--gpus", "16", "--kv-layout", "heads")
    assert "n_kv=8 KV heads on D=16 ranks" in refused["TSP16"]["error"]


def test_plan_table_names_the_layout(capsys):
    assert run_plan(_plan("--mode", "infer", "--preset", "llama3-8b", "--seq-len", "16k", "--gpus", "16")) == 0
    assert "TSP16 [grouped]" in capsys.readouterr().out


MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=257)


def test_bench_rows_carry_the_layout_used(pools):
    from torchtsp.bench.infer import format_infer_table, run_infer_bench

    rows = run_infer_bench(MODEL, 2, [32], new_tokens=3, repeats=1, kv_layout="sequence",
                           run=lambda fn, cell: pools(2).run(fn, cell)[0])
    by = {r["scheme"]: r for r in rows}
    assert {s: by[s]["kv_layout"] for s in ("tsp", "tp", "sp", "dp")} == {"tsp": "sequence", "tp": "heads",
                                                                          "sp": "sequence", "dp": "heads"}
    for r in rows:
        assert r["predicted_kv_bytes"] == r["kv_bytes_per_rank"], r["scheme"]
    assert "sequence" in format_infer_table(rows).splitlines()[1]
