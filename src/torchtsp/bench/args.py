"""Flags of ``torchtsp bench`` (torch-free: the command line must start instantly)."""

from __future__ import annotations

import argparse
import math

from ..argtypes import length, length_list
from ..kv_layouts import KV_LAYOUT_HELP, KV_LAYOUTS
from ..presets import PRESETS
from ..recompute import POLICIES
from ..schemes import PIPELINE_SCHEDULES, SCHEMES
from ..timeouts import BENCH_CELL_TIMEOUT_S

ALL_SCHEMES = tuple(SCHEMES)
DEFAULT_SCHEMES = ",".join(ALL_SCHEMES)
DEFAULT_SEQ_LENS = "256,512,1024,2048"
# The benchmark's model when no --preset is given: small enough that the default sweep at 4 CPU ranks
# takes minutes, large enough that weights, activations and logits all matter to the per-rank peak.
BENCH_MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=257)
MODEL_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def _scheme_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in ALL_SCHEMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scheme(s) {', '.join(unknown) or text!r}; "
                                         f"choose from: {', '.join(ALL_SCHEMES)}")
    return list(dict.fromkeys(names))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):  # NaN and infinity too: they would reach the ranks as timeouts
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``bench`` flags on ``parser``; ``torchtsp.bench.run.run_bench(args)`` consumes them."""
    add = parser.add_argument
    add("--preset", choices=list(PRESETS),
        help="model shape (default: the bench model, dim 256, 4 layers, 4 heads, 4 KV heads, ffn 768, vocab 257)")
    for flag in MODEL_FLAGS:
        add(f"--{flag.replace('_', '-')}", type=int, metavar="N", help=f"override the model's {flag}")
    add("--sliding-window", type=int, metavar="W", help="make the model hybrid: its sliding layers attend to the "
        "last W tokens (with --global-every; default: the preset's window, none for the bench model)")
    add("--global-every", type=int, metavar="N", help="with --sliding-window: every N-th layer attends to the "
        "whole context, the others to the window (Gemma 3's pattern: 6 gives 5 local : 1 global; 1: no window)")
    add("--schemes", type=_scheme_list, default=list(ALL_SCHEMES), metavar="LIST",
        help=f"comma-separated schemes (default: {DEFAULT_SCHEMES})")
    add("--nproc", type=int, metavar="N",
        help="ranks: local CPU ranks to spawn (default 4), or, under torchrun, must equal the world size")
    add("--batch-size", type=int, default=4, metavar="B", help="global batch in sequences, same for every scheme "
        "(default: 4)")
    add("--seq-lens", type=length_list, default=length_list(DEFAULT_SEQ_LENS), metavar="LIST",
        help=f"comma-separated sequence lengths to sweep, 4k = 4096 (default: {DEFAULT_SEQ_LENS})")
    add("--warmup", type=int, default=1, metavar="N",
        help="untimed steps before the memory step and the timed ones (default: 1; the first counts bytes)")
    add("--steps", type=int, default=3, metavar="N", help="timed steps per cell; the median is reported (--mode "
        "infer: generate runs per scheme, interleaved; median and range; default: 3)")
    add("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
        help="Megatron sequence parallelism for tp and torch_tp alike (default: off, plain TP)")
    add("--recompute", nargs="?", const="full", choices=POLICIES, default="none",
        help="the recompute policy of every scheme, as train --recompute: full (each layer's input kept, its "
             "forward re-run in backward; a bare --recompute), selective (the MLP's elementwise hidden state "
             "recomputed) or none (default: every scheme saves its activations); a scheme without recompute "
             "(torch_tp) is reported n/a")
    add("--compile", action="store_true",
        help="--mode train: torch.compile each block's math (norms, RoPE, the MLP's elementwise part; a dp block "
             "whole), collectives left eager; the --warmup steps compile (default: off, eager)")
    add("--zero", type=int, choices=[0, 1, 2], default=0,
        help="the distributed optimizer over dp (as train --zero; it changes only meshes with dp > 1, here the dp "
             "scheme): 1 shards AdamW state, 2 also gradients (default: 0, replicated AdamW, like the committed runs)")
    add("--documents", type=int, metavar="L",
        help="--mode train, instead of the sweep: rows packed with documents of mean length L (seeded), each "
             "scheme's step timed with and without the document mask, interleaved, with both per-rank peaks")
    add("--mode", choices=["train", "infer", "serve"], default="train",
        help="train: steps (forward + backward + AdamW) over --seq-lens; infer: generate over --prompt-lens, "
             "measuring time to first token, time per output token, per-rank peak and KV-cache bytes "
             "(schemes tsp, tp, sp, dp); serve: a load test of `torchtsp serve` per scheme (vllm bench serve's "
             "figures: TTFT, TPOT, ITL, E2EL, throughput, goodput)")
    add_serve_bench_arguments(parser)
    add("--prompt-lens", type=length_list, default=length_list("256,512,1024,2048"), metavar="LIST",
        help="--mode infer: comma-separated prompt lengths (default: 256,512,1024,2048)")
    add("--new-tokens", type=length, default=32, metavar="N", help="--mode infer: tokens generated (default: 32)")
    add("--kv-layout", choices=KV_LAYOUTS, default="auto",
        help="--mode infer, the tsp rows (the other schemes keep their own): " + KV_LAYOUT_HELP)
    add("--max-context-under", type=_positive_float, metavar="GB",
        help="--mode infer, instead of the sweep: per scheme, the longest prompt whose measured per-rank peak "
             "(prefill and decode) stays within GB GiB")
    add("--max-seq-under", type=_positive_float, metavar="GB",
        help="instead of the sweep: for each scheme, the longest sequence (doubling from --max-seq-start) whose "
             "measured per-rank peak stays within GB GiB (2^30 bytes)")
    add("--max-seq-start", type=length, default=256, metavar="S", help="first sequence length of the search "
        "(default: 256)")
    add("--max-seq-cap", type=length, default=65536, metavar="S", help="longest sequence the search tries "
        "(default: 65536)")
    add("--out", default="benchmarks/results/latest", metavar="DIR",
        help="where results.{json,md} and the plots go (max_seq.{json,md,png} with --max-seq-under; "
             "default: benchmarks/results/latest)")
    add("--json", action="store_true", help="also print the results as JSON on stdout")
    add("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    add("--seed", type=int, default=0, help="seed for weights and tokens (default: 0)")
    add("--pp", type=int, metavar="N", help="instead of the scheme sweep: pipeline stages around TSP, pp=N x tsp=W/N, "
        "against the same TSP replicated N times (dp=N), with the pipeline model's predicted step time, per-stage "
        "peak and stage-boundary bytes")
    add("--microbatches", type=int, metavar="M", help="with --pp: microbatches per step (default: N)")
    add("--schedule", choices=list(PIPELINE_SCHEDULES), default="1f1b", help="with --pp: schedule (default: 1f1b)")
    add("--timeout-s", type=_positive_float, default=BENCH_CELL_TIMEOUT_S, metavar="S",
        help="seconds one (scheme, sequence length) cell may take on all ranks, and each of its collectives: "
             "longer means a hung rank; a cell's warm-up, memory and timed steps at the longest S on loaded CPU "
             f"ranks stay within it (default: {BENCH_CELL_TIMEOUT_S:g})")



def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(math.isnan(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive rates (requests/s) or inf, got {text!r}")
    return values


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mode serve``'s flags, named as ``vllm bench serve`` names them."""
    add = parser.add_argument
    add("--hf", metavar="DIR", help="--mode serve: a Hugging Face checkpoint folder to serve (default: --preset, "
        "else the tiny preset)")
    add("--input-len", type=int, default=128, metavar="N", help="--mode serve: prompt tokens per request, seeded "
        "random ids (default: 128)")
    add("--output-len", type=int, default=32, metavar="N", help="--mode serve: tokens generated per request, "
        "past any EOS (default: 32)")
    add("--num-prompts", type=int, default=32, metavar="N", help="--mode serve: requests per scheme and rate "
        "(default: 32)")
    add("--dataset", metavar="JSONL", help="--mode serve: prompts instead of random ids, one "
        "{\"prompt\": text or ids, \"output_len\"?: N} per line")
    add("--request-rates", type=_rate_list, default=[math.inf], metavar="LIST", help="--mode serve: Poisson "
        "arrival rates in requests/s, comma-separated; inf sends every request at once (default: inf)")
    add("--random-prefix-len", type=length, default=0, metavar="N", help="--mode serve: every random prompt starts "
        "with the same N seeded random ids, then its --input-len own (vllm bench's meaning; default: 0)")
    add("--max-concurrency", type=int, metavar="N", help="--mode serve: requests in flight at most (default: all; "
        "the server's --max-num-seqs is this, or 16)")
    add_serve_cache_arguments(parser)
    add("--goodput", nargs="+", metavar="NAME:MS", help="--mode serve: SLOs for goodput, e.g. ttft:500 tpot:50 "
        "(milliseconds; names ttft, tpot, e2el)")


def add_serve_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The paged cache's flags of every server ``--mode serve`` starts, named as ``torchtsp serve`` (and vLLM)
    names them; unset, the server's own defaults hold."""
    add = parser.add_argument
    add("--max-model-len", type=length, metavar="N", help="--mode serve: the server's --max-model-len (default: "
        "the run's longest request, prompt + output)")
    add("--kv-cache-mb", type=_positive_float, metavar="MIB", help="--mode serve: the server's KV cache per rank "
        "in MiB (default: the server's)")
    add("--block-size", type=int, metavar="N", help="--mode serve: the server's tokens per KV cache block on each "
        "rank (default: the server's, 16)")
    add("--max-num-batched-tokens", type=length, metavar="N", help="--mode serve: the server's tokens per engine "
        "step at most (default: the server's)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="--mode serve: the "
        "server reuses cached blocks of shared prompt prefixes (default: on, as the server)")
