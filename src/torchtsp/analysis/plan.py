"""``torchtsp plan``: per-GPU memory and traffic of every parallel layout of a model on N GPUs, offline.

Pure arithmetic on the analytic models (``memory_model.predict_memory``, ``comm_model.predict_comm``);
no torch import, no devices, no network. Prints a table (or JSON), which layouts fit in the GPU's
memory, a recommendation, and, for the paper's 7B model, the paper's measured figures beside ours.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from ..argtypes import DTYPE_BYTES, dtype, length
from ..config import ModelConfig
from ..kv_layouts import KV_LAYOUT_HELP, KV_LAYOUTS, has_kv_layouts
from ..layout import Layout
from ..presets import PRESETS, get_preset
from ..recompute import POLICIES
from ..schemes import PIPELINE_SCHEDULES, SCHEMES, get_scheme
from ..sizes import tsp_tp_crossover_tokens
from .comm_model import predict_comm
from .hardware import add_hardware_arguments
from .memory_model import predict_memory
from .policies import PAPER_FIGURES, POLICY_WORDS, by_policy, paper_figure, policy_label, print_policies
from .table import count, gb, render
from .validation import axis_splits, check_gpu_mem, check_gpus, divisors, dumps

GB = 1e9  # decimal gigabytes, as GPU memory is quoted (an "80 GB" H100)
SWEEP_LENGTHS = tuple(2**k for k in range(12, 19))  # 4K .. 256K

# The paper's measured peak memory per GPU (PAPER_FIGURES, analysis/policies.py): one 8-GPU node, 7B model,
# batch 1 (docs/design.md, "Where we differ from the paper"), under these assumptions.
PAPER_ASSUMPTIONS = dict(batch=1, dtype_bytes=2, optimizer="adamw", recompute=True, foreach=True)


@dataclass
class Row:
    layout: Layout
    memory: object = None  # MemoryBreakdown
    comm: object = None  # CommBreakdown
    error: str | None = None
    fits: bool = False
    state_zero0: int | None = None  # weights + gradients + optimizer state without the distributed optimizer
    traced: dict | None = None  # plan --trace: the real code's step traced at this layout (torchtsp.trace)

    @property
    def label(self) -> str:
        """The layout's label, with TSP's decode cache layout in infer mode (e.g. "TSP8 [heads]")."""
        kv = self.memory.kv_layout if self.memory is not None else ""
        return f"{self.layout.label} [{kv}]" if kv else self.layout.label

    def to_dict(self) -> dict:
        out = {"layout": self.layout.label, "scheme": self.layout.scheme, **self.layout.degree_flags()}
        if self.memory is not None and self.memory.kv_layout:
            out["kv_layout"] = self.memory.kv_layout
        if self.error:
            return {**out, "error": self.error, "fits": False}
        traced = {"traced": self.traced} if self.traced is not None else {}
        return {**out, "fits": self.fits, "memory_bytes": self.memory.to_dict(), "comm_bytes": self.comm.to_dict(),
                "model_state_bytes_zero0": self.state_zero0, **traced}


def layouts(gpus: int) -> list[Layout]:
    """Every layout of ``gpus`` GPUs the planner compares: each modelled scheme of the registry on all of them
    (each factorization for schemes of several axes, with and without Megatron-SP where the scheme takes it),
    then data parallelism over each of them on fewer GPUs, and plain DP."""
    check_gpus(gpus)
    modelled = [s for s in SCHEMES.values() if s.memory_walk is not None and s.axes]
    # The baseline rows: the registry's whole-model data parallelism (a modelled scheme with no model axis).
    out = [Layout.of_degrees(s.name, dp=gpus) for s in SCHEMES.values() if s.memory_walk is not None and not s.axes]
    for dp in (d for d in divisors(gpus) if d <= gpus // 2):
        for spec in modelled:
            for split in axis_splits(gpus // dp, spec.axes):
                for seqpar in ((False, True) if "sequence_parallel" in spec.options and dp == 1 else (False,)):
                    out.append(Layout.of_degrees(spec.name, dp=dp, sequence_parallel=seqpar, **split))
    return out


def evaluate(cfg: ModelConfig, gpus: int, batch: int, seq_len: int, *, mode: str, gpu_mem_gb: float,
             dtype_bytes: int, recompute: str | bool, zero: int = 0, kv_layout: str = "auto") -> list[Row]:
    """Every layout's predicted memory and traffic; with ``zero`` (the distributed optimizer, on layouts with dp >
    1 whose scheme has it), also its model state without it (``Row.state_zero0``). ``kv_layout``: TSP's decode
    cache layout in infer mode (the other schemes have their own)."""
    rows = []
    for lay in layouts(gpus):
        row = Row(lay)
        level = zero if lay.sizes["dp"] > 1 and get_scheme(lay.scheme).zero else 0
        kv = {"kv_layout": kv_layout} if mode == "infer" and has_kv_layouts(lay.scheme) else {}
        try:
            memory = functools.partial(predict_memory, lay.scheme, cfg, batch, seq_len, dtype_bytes=dtype_bytes,
                                       recompute=recompute, mode=mode, **kv,
                                       optimizer="adamw" if mode == "train" else None, **lay.degree_flags())
            row.memory = memory(zero=level)
            plain = memory(zero=0) if level else row.memory
            row.state_zero0 = plain.params + plain.grads + plain.optimizer
            row.comm = predict_comm(lay.scheme, cfg, batch, seq_len, dtype_bytes=dtype_bytes, mode=mode,
                                    recompute=recompute, zero=level, **lay.degree_flags())
            row.fits = row.memory.total <= gpu_mem_gb * GB
        except ValueError as e:
            if lay.sizes["dp"] > 1 and get_scheme(lay.scheme).axes:
                continue  # data parallelism over a scheme that this batch cannot feed: not a candidate
            row.error = str(e)
        rows.append(row)
    return rows


def recommend(rows: list[Row], gpu_mem_gb: float) -> dict:
    """The layout(s) that fit with the least traffic per step, or the least memory if none fits."""
    valid = [r for r in rows if not r.error]
    if not valid:
        return {"layouts": [], "reason": "no layout can split this model over these GPUs"}
    fitting = [r for r in valid if r.fits]
    if fitting:
        least = min(r.comm.total for r in fitting)
        best = [r for r in fitting if r.comm.total == least]
        best.sort(key=lambda r: r.memory.total)
        return {"layouts": [r.label for r in best], "fits": True,
                "reason": f"fits in {gpu_mem_gb:g} GB with the least traffic per step ({least / GB:.2f} GB received "
                          f"per GPU)"}
    least = min(r.memory.total for r in valid)
    best = [r for r in valid if r.memory.total == least]
    return {"layouts": [r.label for r in best], "fits": False,
            "reason": f"nothing fits in {gpu_mem_gb:g} GB; this needs the least memory ({least / GB:.1f} GB); "
                      f"try --recompute (selective or full), more GPUs or a shorter sequence"}


def paper_comparison() -> list[dict]:
    """Our predictions for the paper's measured configurations, under PAPER_ASSUMPTIONS."""
    cfg = get_preset("paper-7b")
    out = []
    for label, scheme, degrees, seq_len, paper in PAPER_FIGURES:
        m = predict_memory(scheme, cfg, seq_len=seq_len, **degrees, **PAPER_ASSUMPTIONS)
        out.append({"layout": label, "seq_len": seq_len, "paper_gb": paper, "predicted_gb": round(m.total / GB, 1),
                    "difference_gb": round(m.total / GB - paper, 1), "peak_phase": m.phase})
    return out


PAPER_NOTES = (
    "Assumptions that make the figures comparable: paper-7b, 8 GPUs, batch 1, bf16 weights, gradients and "
    "activations, fp32 master weights and two fp32 AdamW moments (16 bytes per parameter, sharded like the "
    "weights), foreach AdamW (the CUDA default), full activation recompute of every layer, plain Megatron TP "
    "(no Megatron-SP) inside TP and TP x SP. The paper does not say which TP x SP factorization measured "
    "85.0 and which 140.0 GB; the pairing above is our guess.",
    "Ours counts live tensor bytes (what torchtsp.memory.measure_peak measures). The paper measured the "
    "GPUs, which adds the CUDA context, NCCL buffers, kernel workspaces and allocator fragmentation: at 16K, "
    "where TSP and TP hold the same sharded weights and little activation memory, both of the paper's "
    "figures sit about 5 GB above ours, which such overheads explain.",
    "Where they differ: at 128K our TP is within a few GB of the paper's, but our TSP is about 12 GB lower "
    "and our TP x SP 27-34 GB lower; the paper's implementations keep something ours do not (its TSP "
    "schedule saves more than one layer input per layer, or its TP x SP keeps gathered K/V), or measured "
    "without recompute for some schemes. Our TSP8 peaks at about 104 GB without recompute and 70 GB under "
    "selective recompute (the lines above). TSP is the leanest at 128K and about equal to TP at 16K in both; "
    "the paper has both TP x SP layouts above TP, we have TP4xSP2 below it.",
)


# ---------------------------------------------------------------- command line


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="paper-7b", choices=list(PRESETS), help="model shape (default: paper-7b)")
    parser.add_argument("--seq-len", type=length, default=131072, help="tokens per sequence; 32k = 32768 "
                        "(default: 128k)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs to spread the model over (default: 8)")
    parser.add_argument("--batch-size", type=int, help="sequences per step, all GPUs together (default: 1; with "
                        "--nodes or --pp, one sequence per microbatch of each data-parallel replica)")
    parser.add_argument("--mode", choices=["train", "infer"], default="train",
                        help="train: one AdamW step; infer: one prefill with its KV cache (default: train)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="auto",
                        help="--mode infer, the TSP rows: " + KV_LAYOUT_HELP)
    parser.add_argument("--gpu-mem", type=float, default=80.0, metavar="GB", help="memory per GPU in GB (default: 80)")
    parser.add_argument("--dtype", type=dtype, choices=list(DTYPE_BYTES), default="bfloat16",
                        help="model dtype, as train --dtype (bf16, fp32: the same); bfloat16 adds fp32 master "
                             "weights (default: bfloat16)")
    parser.add_argument("--recompute", nargs="?", const="full", choices=POLICIES, default="none",
                        help="activation recompute policy, as train --recompute: full (each layer's input saved), "
                             "selective (the MLP's elementwise hidden state recomputed) or none (default, as "
                             "torchtsp trains by default); a bare --recompute is full. The activation memory of "
                             "every policy is printed below the table")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=2,
                        help="distributed optimizer over dp, as torchtsp train --zero (3: FSDP2) (default: 2; the "
                             "table shows the model state without it beside)")
    parser.add_argument("--sweep", action="store_true", help="a table across sequence lengths 4K..256K")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="--trace on this device: cpu (default: fake tensors, any size) or cuda (one GPU's real "
                             "tensors for the traced rank; needs a CUDA GPU here, and is not implemented yet)")
    parser.add_argument("--trace", action="store_true",
                        help="also run each layout's real training step (infer mode: its generate, a prefill then one "
                             "decode step) at full size, one rank at a time, under fake tensors and a fake process "
                             "group (no memory, no arithmetic; imports torch; minutes per layout at paper scale), its "
                             "peak and bytes beside the model's")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    pipe = parser.add_argument_group("pipeline stages around TSP (a [pp, dp, tsp] mesh) and multi-node placement")
    pipe.add_argument("--pp", type=int, help="pipeline stages: predict per-stage memory, the bubble and the traffic of "
                      "each axis instead of the layout table")
    pipe.add_argument("--tsp", type=int, help="with --pp: TSP degree of a stage (default: --gpus-per-node, else "
                      "GPUs / pp); dp takes the rest")
    pipe.add_argument("--microbatches", type=int, help="with --pp: microbatches per step (default: pp)")
    pipe.add_argument("--schedule", choices=list(PIPELINE_SCHEDULES), default="1f1b",
                      help="with --pp: pipeline schedule (default: 1f1b)")
    pipe.add_argument("--gpus-per-node", type=int, help="GPUs per node (with --nodes: replaces --gpus); TSP is "
                      "placed inside a node, dp and pp across nodes")
    pipe.add_argument("--nodes", type=int, help="nodes (with --gpus-per-node)")
    pipe.add_argument("--inter-node-gbps", type=float, default=200.0, metavar="GBIT",
                      help="bandwidth of one node's link to the others, Gbit/s (default: 200)")
    add_hardware_arguments(parser.add_argument_group("step time and tokens/s on a GPU model"))


def _check_args(args) -> ModelConfig:
    cfg = get_preset(args.preset)
    if getattr(args, "kv_layout", "auto") != "auto" and args.mode != "infer":
        raise ValueError(f"--kv-layout applies to --mode infer (a prefill's KV cache), not --mode {args.mode}")
    for name in ("seq_len", "gpus", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    check_gpus(args.gpus)
    check_gpu_mem(args.gpu_mem)
    if getattr(args, "trace", False) and getattr(args, "sweep", False):
        raise ValueError("--trace traces the layout table's rows: not with --sweep")
    return cfg


def _inputs(args) -> dict:
    return {"preset": args.preset, "seq_len": args.seq_len, "gpus": args.gpus, "batch_size": args.batch_size,
            "mode": args.mode, "kv_layout": getattr(args, "kv_layout", "auto"), "gpu_mem_gb": args.gpu_mem,
            "dtype": args.dtype, "recompute": args.recompute, "zero": _zero(args)}


def _zero(args) -> int:
    return getattr(args, "zero", 0) if args.mode == "train" else 0


def _assumptions(args) -> list[str]:
    e = DTYPE_BYTES[args.dtype]
    lines = [f"{args.dtype} weights, gradients and activations"
             + (", fp32 master weights" if e == 2 else "")
             + (", AdamW (two fp32 moments), foreach step" if args.mode == "train" else ", prefill with KV cache")
             + (f", --zero {_zero(args)} where dp > 1 (AdamW state and masters 1/dp"
                + (", gradients too)" if _zero(args) == 2 else ")") if _zero(args) else ""),
             "activations: " + POLICY_WORDS[args.recompute],
             "memory: live tensor bytes at the peak; CUDA context, NCCL buffers, workspaces and fragmentation "
             "are not modelled (budget a few GB)",
             "traffic: bytes received per GPU per step, as torchtsp.distributed.comm counts them"]
    return lines


def ranked(rows: list[Row]) -> list[Row]:
    """The table's order: layouts that fit first, by traffic per step (as ``recommend`` picks), then those that
    do not, by peak memory, then those that cannot run."""
    def key(r):
        if r.error:
            return (2, 0.0, 0.0)
        return (0, r.comm.total, r.memory.total) if r.fits else (1, r.memory.total, r.comm.total)
    return sorted(rows, key=key)


LAYER_KINDS = {"sliding_attention": "local", "full_attention": "global"}  # plan's words for a hybrid's layers


def _layer_kinds(cfg) -> list[str]:
    """The layer types of a hybrid model (sliding first), or [] when every layer is alike."""
    kinds = [k for k in LAYER_KINDS if k in {spec.attention.name for spec in cfg.layer_specs}]
    return kinds if len(kinds) > 1 else []


def _layer_forward(c, cfg) -> list[str]:
    """One layer's forward traffic, per layer type for a hybrid model."""
    kinds = _layer_kinds(cfg)
    if not kinds:
        return [gb(c.layer_forward, 2)]
    return [gb(c.layer_types[k]["forward"], 2) if k in c.layer_types else "-" for k in kinds]


def _table_row(r: Row, train: bool, zero: int, cfg, traced: bool = False) -> list[str]:
    m, c = r.memory, r.comm
    first, second = (m.params + m.grads + m.optimizer, m.activations) if train else (m.params, m.kv_cache)
    plain = [gb(r.state_zero0)] if zero else []
    beside = [_traced_cell(r.traced)] if traced else []
    return [r.label, gb(first), *plain, gb(second), gb(m.total), *beside, "yes" if r.fits else "no", gb(c.total, 2),
            *_layer_forward(c, cfg), m.phase]


def _traced_cell(traced: dict | None) -> str:
    """The traced peak in GB, flagged "!" where it or its bytes differ from the model's by more than TRACE_FLAG."""
    if not traced or "peak_bytes" not in traced:
        return "-" if not traced or "skipped" in traced else "failed"
    return gb(traced["peak_bytes"]) + ("!" if traced["flagged"] else "")


def _print_table(cfg, args, rows, rec) -> None:
    e = DTYPE_BYTES[args.dtype]
    print(f"torchtsp plan: {args.preset} (h={cfg.dim:,}, L={cfg.n_layers}, g={cfg.group_size}, F={cfg.ffn_dim:,}, "
          f"V={cfg.vocab_size:,}), {args.mode}, B={args.batch_size}, S={count(args.seq_len)}, {args.gpus} GPUs of "
          f"{args.gpu_mem:g} GB, {args.dtype}{policy_label(args)}")
    train, zero = args.mode == "train", _zero(args)
    cols = ("w+g+opt GB", "activations GB") if train else ("weights GB", "KV cache GB")
    beside = ["(zero 0) GB"] if zero else []  # the model state without the distributed optimizer
    per_layer = [f"fwd GB/{LAYER_KINDS[k]} layer" for k in _layer_kinds(cfg)] or ["fwd GB/layer"]
    traced = bool(getattr(args, "trace", False))
    headers = ["layout", cols[0], *beside, cols[1], "peak GB", *(["traced GB"] if traced else []), "fits",
               "comm GB/step", *per_layer, "peak during"]
    cells, notes = [], []
    for r in ranked(rows):
        if r.error:  # every column keeps its place; the reason goes below the table
            notes.append(f"({len(notes) + 1}) {r.layout.label}: {r.error}")
            cells.append([r.layout.label, *["-"] * (len(headers) - 4 - len(per_layer)), "n/a", "-",
                          *["-"] * len(per_layer), f"see ({len(notes)})"])
        else:
            cells.append(_table_row(r, train, zero, cfg, traced))
    print("\n".join(render(headers, cells, left=(0, headers.index("fits"), len(headers) - 1))))
    for note in notes:
        print(note)
    if traced:
        print(_trace_notes(rows))
    print(f"(per GPU; GB = 1e9 bytes; fits: the peak within --gpu-mem {args.gpu_mem:g} GB; layouts that fit come "
          f"first, by traffic, the others by peak; comm: bytes received per step; fwd/layer: one layer's forward"
          + ("; local: a sliding-window layer, global: a full-attention layer" if len(per_layer) > 1 else "")
          + (f"; w+g+opt at --zero {zero} where dp > 1, (zero 0): the same without the distributed optimizer"
             if zero else "") + ")")
    if not train and len(per_layer) > 1:
        print(_kv_per_layer_type(cfg, args.batch_size, args.seq_len, e))
    print()
    print(f"recommended: {', '.join(rec['layouts']) or 'none'} - {rec['reason']}")
    bs = tsp_tp_crossover_tokens(cfg)
    tokens = args.batch_size * args.seq_len
    print(f"TSP's forward traffic per layer is at most TP's when B·S >= {count(float(bs))} tokens "
          f"(P/(4h - 2h/g)); here B·S = {count(tokens)} ({'TSP moves less' if tokens >= bs else 'TP moves less'}).")
    print("assumptions: " + "; ".join(_assumptions(args)) + f" ({e} bytes per element).")


TRACE_FLAG = 0.10  # plan --trace flags a row whose traced peak or bytes differ from the model's by more than this


def trace_rows(cfg: ModelConfig, args, rows: list[Row], log=None) -> None:
    """``--trace``: each row's training step run by the real code, one rank at a time, under fake tensors and a fake
    process group (``torchtsp.trace``, which imports torch: only here), its figures into ``Row.traced`` beside the
    model's. A trace that fails in the real code keeps its layout, rank, phase and first line; the others go on."""
    import sys

    from ..layout import Layout
    from ..trace import TraceError, trace_layout

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    for r in rows:
        if r.error:
            continue
        level = _zero(args) if r.layout.sizes["dp"] > 1 and get_scheme(r.layout.scheme).zero else 0
        if level == 3:
            r.traced = {"skipped": "--zero 3 (FSDP2) is not traced yet"}
            continue
        options = dict(r.layout.option_values)
        if args.recompute != "none" and "recompute" in r.layout.spec.options:
            options["recompute"] = args.recompute
        layout = Layout.resolve(r.layout.scheme, r.layout.world, **r.layout.sizes, **options)
        log(f"plan --trace: {r.label} ...")
        try:
            if args.mode == "infer":
                kv = {"kv_layout": args.kv_layout} if has_kv_layouts(r.layout.scheme) else {}
                traced = trace_layout(cfg, layout, args.batch_size, args.seq_len, dtype=args.dtype, mode="infer",
                                      **kv)
            else:
                traced = trace_layout(cfg, layout, args.batch_size, args.seq_len, dtype=args.dtype, zero=level)
        except TraceError as e:
            r.traced = {"error": str(e)}
            log(f"plan --trace: {r.label} failed: {e}")
            continue
        except ValueError as e:  # the real code refuses the layout (generate runs no TP+seqpar): not a failed trace
            r.traced = {"skipped": str(e)}
            log(f"plan --trace: {r.label} not traced: {e}")
            continue
        peak, comm = traced["peak_bytes"] / r.memory.total, traced["comm_bytes"] / max(r.comm.total, 1)
        traced.update(peak_vs_model=round(peak, 4), comm_vs_model=round(comm, 4),
                      flagged=abs(peak - 1) > TRACE_FLAG or abs(comm - 1) > TRACE_FLAG)
        r.traced = traced
        log(f"plan --trace: {r.label}: {gb(traced['peak_bytes'], 2)} GB ({peak:.3f}x the model's), "
            f"{gb(traced['comm_bytes'], 3)} GB received ({comm:.3f}x), {traced['wall_s']:.0f} s")


def _trace_notes(rows: list[Row]) -> str:
    """Below a --trace table: what the column is, the flagged rows, the failed traces."""
    lines = ["traced GB: the real code's step (infer: generate, a prefill then one decode step) at full size, one rank "
             "at a time under fake tensors and a fake process group (torchtsp.trace; NCCL's collectives; zigzag "
             "layouts the larger of the first and last sequence rank); '!': the traced peak or bytes differ from the "
             f"model's by more than {TRACE_FLAG:.0%}"]
    for r in rows:
        t = r.traced or {}
        if t.get("flagged"):
            lines.append(f"  ! {r.label}: traced peak {t['peak_vs_model']:.3f}x the model's, bytes "
                         f"{t['comm_vs_model']:.3f}x")
        elif "error" in t:
            lines.append(f"  trace failed: {t['error']}")
        elif "skipped" in t:
            lines.append(f"  not traced: {r.label}: {t['skipped']}")
    return "\n".join(lines)


def _kv_per_layer_type(cfg: ModelConfig, batch: int, seq_len: int, e: int) -> str:
    """A hybrid model's KV cache per layer type, whole model (every rank's share together): the KV cache column
    is generate's, which keeps every position of every layer; the paged server (serve/blocks.py) keeps a sliding
    layer's window only (its blocks, ``sequence_blocks``)."""
    from ..kv_layouts import DEFAULT_BLOCK_SIZE, sequence_blocks  # serve's default block, one rank

    per_token = 2 * e * cfg.n_kv_heads * cfg.head_dim * batch
    full = per_token * seq_len
    window = per_token * DEFAULT_BLOCK_SIZE * sequence_blocks(cfg.sliding_window, seq_len, DEFAULT_BLOCK_SIZE)
    return (f"KV cache of one layer, all ranks together: a global layer {gb(full, 3)} GB; a local layer "
            f"{gb(full, 3)} GB under generate, {gb(window, 3)} GB in serve's paged cache (its window of "
            f"{cfg.sliding_window} tokens, in blocks of {DEFAULT_BLOCK_SIZE})")


def _print_paper(paper: list[dict]) -> None:
    print()
    print("The paper's measured peak memory per GPU (7B, 8 GPUs, B=1) beside our prediction:")
    print(f"  {'layout':<9} {'S':>7} {'paper GB':>9} {'ours GB':>8} {'ours-paper':>10}  our peak during")
    for p in paper:
        print(f"  {p['layout']:<9} {count(p['seq_len']):>7} {p['paper_gb']:>9.1f} {p['predicted_gb']:>8.1f} "
              f"{p['difference_gb']:>+10.1f}  {p['peak_phase']}")
    for note in PAPER_NOTES:
        print(f"  - {note}")


def _sweep(cfg, args) -> list[dict]:
    out = []
    for S in SWEEP_LENGTHS:
        rows = evaluate(cfg, args.gpus, args.batch_size, S, mode=args.mode, gpu_mem_gb=args.gpu_mem,
                        dtype_bytes=DTYPE_BYTES[args.dtype], recompute=args.recompute, zero=_zero(args),
                        kv_layout=getattr(args, "kv_layout", "auto"))
        out.append({"seq_len": S, "rows": rows, "recommendation": recommend(rows, args.gpu_mem)})
    return out


def _print_sweep(cfg, args, sweep) -> None:
    labels = [r.label for r in sweep[0]["rows"]]
    print(f"torchtsp plan --sweep: {args.preset}, {args.mode}, B={args.batch_size}, {args.gpus} GPUs of "
          f"{args.gpu_mem:g} GB, {args.dtype}{policy_label(args)}: peak GB per GPU "
          f"('-': cannot split; '*': does not fit)")
    width = max(9, *(len(x) for x in labels)) + 1
    print(f"{'S':>7} " + "".join(f"{x:>{width}}" for x in labels) + "  recommended")
    for item in sweep:
        cells = []
        for r in item["rows"]:
            cells.append("-" if r.error else f"{r.memory.total / GB:.1f}" + ("" if r.fits else "*"))
        rec = item["recommendation"]
        print(f"{count(item['seq_len']):>7} " + "".join(f"{c:>{width}}" for c in cells) + "  "
              + (", ".join(rec["layouts"]) + ("" if rec.get("fits") else " (nothing fits)")))
    print("assumptions: " + "; ".join(_assumptions(args)) + ".")


def _check_trace_device(args) -> None:
    """``--device cuda``: only with --trace (which imports torch anyway), and only where a CUDA GPU is present."""
    if not getattr(args, "trace", False):
        raise ValueError(f"--device {args.device} applies to --trace (the model's arithmetic runs on no device)")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA GPU on this machine; --trace runs on the CPU by default "
                         "(fake tensors, any size)")
    raise ValueError(f"--device {args.device}: tracing with one GPU's real tensors is not implemented yet; --trace "
                     "runs on the CPU by default (fake tensors, any size)")


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan for parsed ``add_plan_arguments`` arguments; returns the exit status."""
    if getattr(args, "trace", False) and any(getattr(args, name, None) is not None
                                             for name in ("hardware", "pp", "nodes")):
        raise ValueError("--trace traces the layout table's rows: not with --hardware, --pp or --nodes yet")
    if getattr(args, "device", "cpu") != "cpu":
        _check_trace_device(args)
    if getattr(args, "hardware", None) is not None:
        from .hardware import run_hardware_plan

        return run_hardware_plan(args)
    if getattr(args, "pp", None) is not None or getattr(args, "nodes", None) is not None:
        from .pipeline_report import run_pipeline_plan

        return run_pipeline_plan(args)
    if args.batch_size is None:
        args.batch_size = 1
    cfg = _check_args(args)
    dtype_bytes = DTYPE_BYTES[args.dtype]
    paper = paper_comparison() if args.preset == "paper-7b" else None
    if args.sweep:
        sweep = _sweep(cfg, args)
        if args.json:
            print(dumps({"inputs": _inputs(args), "assumptions": _assumptions(args),
                         "sweep": [{"seq_len": s["seq_len"], "rows": [r.to_dict() for r in s["rows"]],
                                    "recommendation": s["recommendation"]} for s in sweep],
                         "paper": paper and {"figures": paper, "notes": list(PAPER_NOTES)}}))
        else:
            _print_sweep(cfg, args, sweep)
            if paper:
                _print_paper(paper)
        return 0
    rows = evaluate(cfg, args.gpus, args.batch_size, args.seq_len, mode=args.mode, gpu_mem_gb=args.gpu_mem,
                    dtype_bytes=dtype_bytes, recompute=args.recompute, zero=_zero(args),
                    kv_layout=getattr(args, "kv_layout", "auto"))
    if getattr(args, "trace", False):
        trace_rows(cfg, args, rows)
    rec = recommend(rows, args.gpu_mem)
    best = next((r for r in ranked(rows) if not r.error), None) if args.mode == "train" else None
    policies = _row_policies(cfg, args, best) if best else None
    if args.json:
        print(dumps({"inputs": _inputs(args), "assumptions": _assumptions(args),
                     "rows": [r.to_dict() for r in rows], "recommendation": rec,
                     "crossover_tokens": float(tsp_tp_crossover_tokens(cfg)),
                     "recompute_policies": policies and {"layout": best.label, **policies},
                     "paper": paper and {"figures": paper, "notes": list(PAPER_NOTES)}}))
    else:
        _print_table(cfg, args, rows, rec)
        if policies:
            lay = best.layout
            print_policies(policies, f"{best.label} (the table's first)",
                           paper_figure(args.preset, lay.scheme, lay.degree_flags(), args.seq_len,
                                        args.batch_size // lay.sizes["dp"]))
        if paper:
            _print_paper(paper)
    return 0


def _row_policies(cfg, args, row: Row) -> dict:
    """``by_policy`` of one row's layout, as ``evaluate`` predicts it."""
    lay = row.layout
    level = _zero(args) if lay.sizes["dp"] > 1 and get_scheme(lay.scheme).zero else 0
    return by_policy(lambda p: predict_memory(lay.scheme, cfg, args.batch_size, args.seq_len, recompute=p,
                                              dtype_bytes=DTYPE_BYTES[args.dtype], optimizer="adamw", zero=level,
                                              **lay.degree_flags()))


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtsp.analysis.plan`` (the ``torchtsp plan`` subcommand calls ``run_plan``)."""
    parser = argparse.ArgumentParser(prog="torchtsp plan", description="per-GPU memory and traffic of each layout")
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
