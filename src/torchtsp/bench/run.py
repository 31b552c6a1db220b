"""``torchtsp bench``: every scheme on the same model, global batch and ranks, over a sweep of sequence lengths.

This is the driver; ``measure.py`` is what every rank runs. Each scheme spans all W ranks with the degrees the
registry gives it (``Scheme.degrees``: TP x SP takes the most square T x Σ). Per cell the driver records the
measured peak (max over ranks), the median step time (slowest rank per step) and tokens/s, and compares the
bytes every rank received with ``predict_comm`` (forward = L·layer_forward + embed_head_forward, step = total;
``bytes_match`` only if every rank received exactly the prediction) and the peak with ``predict_memory``.
Schemes whose collectives our comm layer does not count (torch_tp) have null bytes and predictions.

``--max-seq-under GB`` replaces the sweep: per scheme, S doubles from ``--max-seq-start`` until the measured
per-rank peak exceeds the budget (or S passes ``--max-seq-cap``); the answer is the longest S that fitted. Its
cells skip the timed steps and create the optimizer state with a zero-gradient AdamW step instead of a real one.

Locally, one ``WorkerPool`` of ``--nproc`` CPU ranks serves the whole run. Under torchrun the launched ranks run
the same loop in lockstep and rank 0 writes the outputs.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..analysis import predict_comm, predict_memory
from ..config import ModelConfig
from ..distributed import comm
from ..distributed.launch import WorkerPool
from ..distributed.mesh import default_device_type
from ..layout import Layout
from ..presets import get_preset, layer_pattern
from ..recompute import NONE, recompute_policy
from ..runenv import launched_by_torchrun
from ..schemes import SCHEMES, get_scheme
from . import report
from .args import BENCH_MODEL, MODEL_FLAGS
from .measure import CellSpec, cells_on_rank, longest_on_rank, paired_on_rank

MiB = 2**20
GiB = 2**30


# ---------------------------------------------------------------- what to run


def scheme_degrees(scheme: str, world: int) -> dict[str, int]:
    """Mesh degrees of ``scheme`` on ``world`` ranks (all ranks on the scheme's axes), as every command resolves
    them (``Layout.resolve``)."""
    return Layout.resolve(scheme, world).sizes


def mesh_label(scheme: str, degrees: dict[str, int]) -> str:
    return Layout.of_degrees(scheme, **degrees).mesh_label


def scheme_options(scheme: str, sequence_parallel: bool, recompute: str | bool = False) -> dict:
    """The options the bench applies alike to every scheme that takes them (sequence parallelism: tp and
    torch_tp; recompute: every scheme that takes it; a scheme without it is refused, never run unlike)."""
    spec = get_scheme(scheme)
    options = {"sequence_parallel": sequence_parallel} if "sequence_parallel" in spec.options else {}
    if recompute_policy(recompute) != NONE:
        options["recompute"] = recompute_policy(recompute)
    return options


def layout_error(spec: CellSpec) -> str | None:
    """Why ``spec`` cannot run (indivisible heads, FFN, sequence or batch, an option the scheme lacks), before
    any rank starts it."""
    try:
        Layout.resolve(spec.scheme, cfg=spec.cfg, batch=spec.batch, seq_len=spec.seq_len, **spec.degrees,
                       **spec.options)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


def predictions(spec: CellSpec, foreach: bool, seq_rank: int | None = None, point_to_point: bool | None = None) -> dict:
    """The analytic model's per-rank peak memory and received bytes for ``spec`` (None where not modelled);
    the bytes of the rank at ``seq_rank`` on the sequence axis where they depend on it, full layers' K/V moving
    point to point or not (``predict_comm``; None: where ``seq_rank`` is given)."""
    if get_scheme(spec.scheme).traffic is None:
        return {"memory": None, "comm": None, "peak_bytes": None, "forward_bytes": None, "step_bytes": None}
    flags = {"sequence_parallel": True} if spec.options.get("sequence_parallel") else {}
    flags["recompute"] = spec.options.get("recompute", NONE)
    mem = predict_memory(spec.scheme, spec.cfg, spec.batch, spec.seq_len, **spec.degrees, **flags,
                         pruned_kv=seq_rank is not None if point_to_point is None else point_to_point,
                         dtype_bytes=4, optimizer="adamw", foreach=foreach, zero=spec.zero)
    traffic = predict_comm(spec.scheme, spec.cfg, spec.batch, spec.seq_len, **spec.degrees, **flags, dtype_bytes=4,
                           seq_rank=seq_rank, point_to_point=point_to_point, zero=spec.zero)
    return {"memory": mem.to_dict(), "comm": traffic.to_dict(), "peak_bytes": mem.total,
            "forward_bytes": traffic.forward, "step_bytes": traffic.total,
            "routed_forward_bytes": traffic.routed_forward, "routed_step_bytes": traffic.routed}


# ---------------------------------------------------------------- the driver


def _model_config(args) -> ModelConfig:
    cfg = get_preset(args.preset) if args.preset else ModelConfig(**BENCH_MODEL)
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k, None) is not None}
    window, every = getattr(args, "sliding_window", None), getattr(args, "global_every", None)
    if (window is None) != (every is None):
        raise ValueError("--sliding-window W and --global-every N go together: a hybrid model needs both the "
                         "window and which layers keep the whole context")
    if window is not None:
        n_layers = overrides.get("n_layers", cfg.n_layers)
        overrides.update(sliding_window=window, layer_types=layer_pattern(n_layers, every))
    elif "n_layers" in overrides and cfg.layer_types:  # keep the preset's pattern at the new depth
        overrides["layer_types"] = layer_pattern(overrides["n_layers"], _global_every(cfg))
    return cfg.replace(**overrides) if overrides else cfg


def _global_every(cfg: ModelConfig) -> int:
    """The period of ``cfg``'s full layers (Gemma 3's pattern), for a depth override; refuses another pattern."""
    for every in range(1, cfg.n_layers + 2):  # n_layers + 1: every layer sliding (Mistral)
        if layer_pattern(cfg.n_layers, every) == cfg.layer_types:
            return every
    raise ValueError(f"--n-layers cannot keep this preset's layer types {cfg.layer_types}; give --sliding-window "
                     "and --global-every too")


# Every integer flag's least value: none is silently replaced by a default (a 0 read as "not given").
_AT_LEAST = {"batch_size": 1, "steps": 1, "warmup": 1, "max_seq_start": 1, "max_seq_cap": 1, "nproc": 1,
             "new_tokens": 1, "pp": 2, "microbatches": 1, "seed": 0,
             "sliding_window": 1, "global_every": 1, **dict.fromkeys(MODEL_FLAGS, 1)}


def _check_args(args) -> None:
    for name, low in _AT_LEAST.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if not str(getattr(args, "out", "-")).strip():  # Path("") is the current folder, never what was meant
        raise ValueError("--out is an empty path; give the folder for the results (an unset variable?)")
    if getattr(args, "microbatches", None) is not None and getattr(args, "pp", None) is None:
        raise ValueError("--microbatches applies to pipeline stages; give --pp N (N >= 2) or drop it")
    if getattr(args, "documents", None) is not None:
        if args.documents < 1:
            raise ValueError(f"--documents must be at least 1 (a mean document length), got {args.documents}")
        if args.mode != "train" or args.max_seq_under is not None or getattr(args, "pp", None) is not None:
            raise ValueError("--documents times training steps: use it with --mode train, without --max-seq-under "
                             "or --pp")
    if getattr(args, "compile", False):
        if args.mode != "train" or getattr(args, "pp", None) is not None:
            raise ValueError("--compile applies to --mode train without --pp (training steps of each scheme)")
        from .. import compiled
        from ..distributed.mesh import default_device_type

        compiled.check_backend(default_device_type())
    if args.max_seq_under is not None and args.max_seq_start > args.max_seq_cap:
        raise ValueError(f"--max-seq-start {args.max_seq_start} exceeds --max-seq-cap {args.max_seq_cap}")


def _check_kv_layout(args, cfg: ModelConfig) -> None:
    """--kv-layout: --mode infer's, and one the model allows on the tsp rows' ranks, refused before any rank starts."""
    layout = getattr(args, "kv_layout", "auto")
    if layout == "auto":
        return
    if args.mode != "infer":
        raise ValueError(f"--kv-layout applies to --mode infer (generate's KV cache), not --mode {args.mode}")
    from ..kv_layouts import has_kv_layouts, resolve_kv_layout

    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else args.nproc or 4  # as _Runner's
    for scheme in filter(has_kv_layouts, args.schemes):
        resolve_kv_layout(layout, cfg.n_kv_heads, Layout.resolve(scheme, world, cfg=cfg).sizes["tsp"], scheme)


def _aggregate(spec: CellSpec, result: dict, foreach: bool) -> dict:
    """One cell's record for results.json: measured, predicted, and how they compare."""
    base = {"scheme": spec.scheme, "mesh": mesh_label(spec.scheme, spec.degrees), "degrees": spec.degrees,
            "seq_len": spec.seq_len, "batch": spec.batch, "options": spec.options}
    if result.get("error"):
        return {**base, "status": f"n/a: {result['error']}"}
    seq_ranks = result.get("seq_rank_per_rank") or [None] * len(result["peak_bytes_per_rank"])
    per_rank = {r: predictions(spec, foreach, r, result.get("kv_point_to_point")) for r in set(seq_ranks)}
    pred = per_rank[seq_ranks[0]]  # rank 0's, next to rank 0's measured bytes
    peak = max(result["peak_bytes_per_rank"])
    rec = {**base, "status": "ok", "loss": result["loss"],
           "peak_bytes": peak, "peak_bytes_per_rank": result["peak_bytes_per_rank"],
           "predicted_peak_bytes": pred["peak_bytes"],
           "peak_error_pct": None if pred["peak_bytes"] is None else 100.0 * (pred["peak_bytes"] - peak) / peak,
           "predicted_memory": pred["memory"]}
    if spec.mode == "sweep":
        median = statistics.median(result["step_times_s"])
        fwd, whole = result["forward_bytes_per_rank"], result["step_bytes_per_rank"]
        # Exact on the deterministic bytes; a mixture of experts' all-to-alls carry what routing sent, so they are
        # reported against their expectation under uniform routing (tests/test_moe.py checks them exactly).
        routed_fwd, routed_step = result["routed_forward_bytes_per_rank"], result["routed_step_bytes_per_rank"]
        # The deterministic bytes each rank should have received (they differ by rank where the K/V exchange is
        # pruned: causally on gloo, and a sliding layer's to its window everywhere; ``predict_comm(seq_rank=...)``).
        expected_fwd = expected_step = None
        if fwd is not None and pred["forward_bytes"] is not None:
            fwd = [b - r for b, r in zip(fwd, routed_fwd)]
            whole = [b - r for b, r in zip(whole, routed_step)]
            expected_fwd = [per_rank[r]["forward_bytes"] - per_rank[r]["routed_forward_bytes"] for r in seq_ranks]
            expected_step = [per_rank[r]["step_bytes"] - per_rank[r]["routed_step_bytes"] for r in seq_ranks]
            pred = {**pred, "forward_bytes": expected_fwd[0], "step_bytes": expected_step[0]}
        rec.update({
            "step_times_s": result["step_times_s"], "median_step_s": median,
            "exposed_comm_fraction": result.get("exposed_comm_fraction"),
            "tokens_per_s": spec.batch * spec.seq_len / median,
            "forward_bytes": None if fwd is None else fwd[0], "forward_bytes_per_rank": fwd,
            "predicted_forward_bytes": pred["forward_bytes"],
            "predicted_forward_bytes_per_rank": expected_fwd,
            "bytes_match": None if expected_fwd is None else fwd == expected_fwd,
            "step_bytes": None if whole is None else whole[0], "step_bytes_per_rank": whole,
            "predicted_step_bytes": pred["step_bytes"],
            "predicted_step_bytes_per_rank": expected_step,
            "step_bytes_match": None if expected_step is None else whole == expected_step,
            "routed_step_bytes_per_rank": routed_step,
            "routed_vs_expected": (None if not routed_step or not pred.get("routed_step_bytes")
                                   else statistics.mean(routed_step) / pred["routed_step_bytes"]),
            "forward_bytes_by_op_rank0": result["forward_bytes_by_op_rank0"],
            "step_bytes_by_op_rank0": result["step_bytes_by_op_rank0"],
            "predicted_comm": pred["comm"],
        })
    return rec


class _Runner:
    """Runs a cell on every rank: through a local WorkerPool, or in lockstep under torchrun."""

    def __init__(self, args):
        self.torchrun = launched_by_torchrun()
        if self.torchrun:
            self.world = int(os.environ["WORLD_SIZE"])
            if args.nproc is not None and args.nproc != self.world:
                raise ValueError(f"--nproc {args.nproc} does not match the torchrun world of {self.world} ranks; "
                                 f"omit --nproc or launch {args.nproc} ranks")
            self.owns_group = not comm.is_initialized()
            comm.init_process_group("nccl" if default_device_type() == "cuda" else "gloo", args.timeout_s)
            self.pool = None
            self.rank = comm.global_rank()
        else:
            self.world = args.nproc or 4
            self.pool = (WorkerPool(self.world, timeout_s=args.timeout_s, preload=[__name__])
                         if self.world > 1 else None)
            self.rank = 0
        self.timeout_s = args.timeout_s
        self.device = default_device_type() if self.torchrun else "cpu"

    def __call__(self, fn, *args):
        """``fn(*args)`` on every rank; rank 0's result (the aggregates are identical on every rank)."""
        if self.pool is not None:
            return self.pool.run(fn, *args, timeout_s=self.timeout_s)[0]
        return fn(*args)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        elif self.torchrun and self.owns_group:
            comm.destroy_process_group()


def _meta(args, cfg: ModelConfig, runner: _Runner, elapsed_s: float) -> dict:
    return {"model": cfg.to_dict(), "batch": args.batch_size, "world": runner.world, "mode": args.mode,
            "new_tokens": args.new_tokens if args.mode == "infer" else None,
            "launcher": "torchrun" if runner.torchrun else "local WorkerPool",
            "device": runner.device if runner.device == "cpu" else torch.cuda.get_device_name(),
            "backend": "nccl" if runner.device == "cuda" else "gloo", "dtype": "float32",
            "sequence_parallel": args.sequence_parallel,
            "recompute": recompute_policy(getattr(args, "recompute", False)),
            "compile": getattr(args, "compile", False),
            "zero": getattr(args, "zero", 0),
            "warmup": args.warmup, "steps": args.steps,
            "threads_per_rank": 1 if not runner.torchrun else torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "elapsed_s": elapsed_s, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _sweep(args, cfg: ModelConfig, runner: _Runner) -> dict:
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, *args.seq_lens))
    foreach = runner.device == "cuda"
    recompute = getattr(args, "recompute", False)
    by_scheme = {s: [CellSpec(s, scheme_degrees(s, runner.world), cfg, args.batch_size, S, args.warmup, args.steps,
                              scheme_options(s, args.sequence_parallel, recompute), "sweep", args.seed,
                              args.timeout_s, zero=args.zero, compile=args.compile)
                     for S in args.seq_lens] for s in args.schemes}
    # A scheme against the outside implementation of its layout (its registry entry's ``bench_peer``: our tp and
    # PyTorch's own TP): besides each cell's timing, the two are timed interleaved per S.
    peers = [(s, get_scheme(s).bench_peer) for s in args.schemes if get_scheme(s).bench_peer in args.schemes]
    pairs = [(ours, peer, S) for ours, peer in peers for S in args.seq_lens]
    cells, paired = [], {}
    bar = tqdm(total=sum(map(len, by_scheme.values())) + len(pairs), desc="bench", unit="cell", dynamic_ncols=True,
               file=sys.stderr, disable=runner.rank != 0)
    for scheme, specs in by_scheme.items():
        bar.set_postfix_str(scheme)
        runnable = [spec for spec in specs if layout_error(spec) is None]
        results = iter(runner(cells_on_rank, runnable) if runnable else [])
        for spec in specs:
            why = layout_error(spec)
            cells.append(_aggregate(spec, {"error": why} if why else next(results), foreach))
        bar.update(len(specs))
    ok = {(c["scheme"], c["seq_len"]) for c in cells if c["status"] == "ok"}
    for ours, peer, S in pairs:
        bar.set_postfix_str(f"{ours} vs {peer} S={S}")
        if (ours, S) in ok and (peer, S) in ok:
            paired.setdefault((ours, peer), {})[S] = runner(
                paired_on_rank, [next(spec for spec in by_scheme[s] if spec.seq_len == S) for s in (ours, peer)])
        bar.update(1)
    bar.close()
    return {"cells": cells, **{f"{s.name}_vs_{s.bench_peer}": peer_ratios(cells, paired.get((s.name, s.bench_peer), {}),
                                                                          s.name, s.bench_peer)
                               for s in SCHEMES.values() if s.bench_peer}}


def _documents(args, cfg: ModelConfig, runner: _Runner) -> dict:
    """--documents L: per scheme and sequence length, steps on packed rows with and without the document mask,
    timed interleaved on the same ranks and batch, and each one's per-rank peak."""
    import dataclasses

    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, *args.seq_lens))
    recompute = getattr(args, "recompute", False)
    rows = []
    bar = tqdm(total=len(args.schemes) * len(args.seq_lens), desc=f"bench documents={args.documents}", unit="cell",
               dynamic_ncols=True, file=sys.stderr, disable=runner.rank != 0)
    for scheme in args.schemes:
        for S in args.seq_lens:
            bar.set_postfix_str(f"{scheme} S={S}")
            plain = CellSpec(scheme, scheme_degrees(scheme, runner.world), cfg, args.batch_size, S, args.warmup,
                             args.steps, scheme_options(scheme, args.sequence_parallel, recompute), "sweep",
                             args.seed, args.timeout_s, zero=args.zero, compile=args.compile)
            masked = dataclasses.replace(plain, documents=args.documents)
            why = layout_error(plain)
            result = {"error": why} if why else runner(paired_on_rank, [plain, masked], True)
            row = {"scheme": scheme, "mesh": mesh_label(scheme, plain.degrees), "seq_len": S, "batch": args.batch_size,
                   "mean_document_len": args.documents, "status": f"n/a: {result['error']}" if result["error"]
                   else "ok"}
            if not result["error"]:
                a, b = result[plain.label], result[masked.label]
                row.update(unmasked=a, masked=b, speedup=a["median_step_s"] / b["median_step_s"])
            rows.append(row)
            bar.update(1)
    bar.close()
    return {"documents": rows}


def peer_ratios(cells: list[dict], paired: dict[int, dict], ours: str, peer: str) -> dict | None:
    """``ours``'s median step time over ``peer``'s (our tp over torch_tp) per sequence length: from the interleaved
    timing (``paired``, the figure to quote) and from the two schemes' own cells (timed minutes apart)."""
    times = {(c["scheme"], c["seq_len"]): c["median_step_s"] for c in cells if c["status"] == "ok"
             and "median_step_s" in c}
    cell_ratios = {S: times[ours, S] / times[peer, S] for (s, S) in times if s == ours and (peer, S) in times}
    if not cell_ratios:
        return None
    pair = {S: p for S, p in paired.items() if not p.get("error")}
    ratios = {S: p[ours]["median_step_s"] / p[peer]["median_step_s"] for S, p in sorted(pair.items())}
    return {
        "method": f"interleaved steps ({ours}, {peer}, {peer}, {ours}, ...) on the same ranks, median per scheme",
        "ratio_by_seq_len": {str(S): r for S, r in ratios.items()},
        "max_ratio": max(ratios.values()) if ratios else None,
        "total_ratio": (sum(p[ours]["median_step_s"] for p in pair.values())
                        / sum(p[peer]["median_step_s"] for p in pair.values())) if pair else None,
        "interleaved": {str(S): p for S, p in sorted(pair.items())},
        "cell_ratio_by_seq_len": {str(S): r for S, r in sorted(cell_ratios.items())},
    }


def _max_seq(args, cfg: ModelConfig, runner: _Runner) -> dict:
    budget = int(args.max_seq_under * GiB)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, args.max_seq_cap))
    foreach = runner.device == "cuda"
    recompute = getattr(args, "recompute", False)
    out = {"budget_gib": args.max_seq_under, "budget_bytes": budget, "start": args.max_seq_start,
           "cap": args.max_seq_cap, "schemes": {}}
    lengths = []
    S = args.max_seq_start
    while S <= args.max_seq_cap:
        lengths.append(S)
        S *= 2
    bar = tqdm(total=len(args.schemes), desc=f"max seq under {args.max_seq_under:g} GiB", unit="scheme",
               dynamic_ncols=True, file=sys.stderr, disable=runner.rank != 0)
    for scheme in args.schemes:
        bar.set_postfix_str(scheme)
        degrees = scheme_degrees(scheme, runner.world)
        specs = [CellSpec(scheme, degrees, cfg, args.batch_size, S, 0, 0,
                          scheme_options(scheme, args.sequence_parallel, recompute), "memory", args.seed,
                          args.timeout_s, zero=args.zero, compile=args.compile) for S in lengths]
        # Every length the layout allows, up to the first it refuses (which stops the search with its reason).
        first_bad = next((i for i, spec in enumerate(specs) if layout_error(spec)), len(specs))
        results = runner(longest_on_rank, specs[:first_bad], budget) if first_bad else []
        if len(results) < len(specs) and len(results) == first_bad and first_bad < len(specs):
            results = [*results, {"error": layout_error(specs[first_bad])}]
        tried, longest, stop = [], None, "cap reached"
        for spec, result in zip(specs, results):
            rec = _aggregate(spec, result, foreach)
            tried.append({k: rec.get(k) for k in ("seq_len", "status", "peak_bytes", "predicted_peak_bytes",
                                                  "peak_error_pct")})
            if rec["status"] != "ok":
                stop = rec["status"]
                break
            if rec["peak_bytes"] > budget:
                stop = f"S={spec.seq_len} measured {rec['peak_bytes'] / MiB:.1f} MiB > budget"
                break
            longest = spec.seq_len
        out["schemes"][scheme] = {"mesh": mesh_label(scheme, degrees), "longest_seq_len": longest, "stopped": stop,
                                  "tried": tried}
        bar.update(1)
    bar.close()
    return out


def _infer(args, cfg: ModelConfig, runner: _Runner) -> dict:
    """--mode infer: every scheme that generate runs, timed interleaved per prompt length (--steps runs each); or
    the longest prompt each fits in --max-context-under GiB per rank."""
    from .infer import INFER_SCHEMES, max_context_under, run_infer_bench

    schemes = [s for s in args.schemes if s in INFER_SCHEMES]
    model = {**cfg.to_dict()}
    bar = tqdm(desc="bench infer", unit="cell", dynamic_ncols=True, file=sys.stderr, disable=runner.rank != 0)
    progress = lambda scheme, n: (bar.set_postfix_str(f"{scheme} prompt={n}"), bar.update(1))
    try:
        if args.max_context_under is not None:
            budget = int(args.max_context_under * GiB)
            found = max_context_under(model, runner.world, budget, runner, schemes=schemes, new_tokens=args.new_tokens,
                                      batch=args.batch_size, progress=progress, timeout_s=args.timeout_s,
                                      kv_layout=args.kv_layout)
            return {"max_context": {"budget_gib": args.max_context_under, "longest_prompt": found}}
        rows = run_infer_bench(model, runner.world, args.prompt_lens, runner, schemes=schemes,
                               new_tokens=args.new_tokens, batch=args.batch_size, repeats=args.steps,
                               progress=progress, timeout_s=args.timeout_s, kv_layout=args.kv_layout)
        return {"infer": rows}
    finally:
        bar.close()


def run_bench(args) -> int:
    """Entry point of ``torchtsp bench`` (flags from ``add_bench_arguments``); returns the exit code.

    ValueError for bad flags (or --nproc that contradicts the torchrun world); layouts a scheme cannot split
    become "n/a: reason" cells instead of failing the run.
    """
    if args.mode == "serve":  # a client of `torchtsp serve` processes: no ranks of its own
        from .serve import run_serve_bench

        return run_serve_bench(args)
    _check_args(args)
    cfg = _model_config(args)
    _check_kv_layout(args, cfg)
    runner = _Runner(args)
    if getattr(args, "pp", None) is not None:
        from .pipeline import run_pipeline_bench

        try:
            return run_pipeline_bench(args, cfg, runner)
        finally:
            runner.close()
    start = time.perf_counter()
    try:
        if args.mode == "infer":
            result = _infer(args, cfg, runner)
        elif args.max_seq_under is not None:
            result = _max_seq(args, cfg, runner)
        elif args.documents is not None:
            result = _documents(args, cfg, runner)
        else:
            result = _sweep(args, cfg, runner)
    finally:
        runner.close()
    result = {"meta": _meta(args, cfg, runner, time.perf_counter() - start), **result}
    if runner.rank != 0:
        return 0
    out = Path(args.out)
    if args.mode == "infer":
        files = report.write_infer(result, out, plots=args.plots)
    elif args.max_seq_under is not None:
        files = report.write_max_seq(result, out, plots=args.plots)
    elif args.documents is not None:
        files = report.write_documents(result, out)
    else:
        files = report.write_sweep(result, out, plots=args.plots)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print((out / files[1].name).read_text() if len(files) > 1 else "")
        print("wrote " + ", ".join(str(f) for f in files))
    return 0
