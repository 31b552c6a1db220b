"""Predicted step time and tokens/s of each layout on a named GPU (``torchtsp plan --hardware``).

A roofline of one training step per GPU: the step's FLOPs (GEMMs and causal attention) at a fraction
``mfu`` of the GPU's peak dense bf16 FLOP/s, plus the communication the code cannot hide. Each axis's bytes
are the analytic comm model's (``comm_model.predict_comm``, what torchtsp's comm layer counts), moved at
the bandwidth of the link that axis crosses: the scheme's own axis (tsp, tp, sp; at most one node) over the
intra-node link, the data-parallel gradient sums over the inter-node NIC. Overlap follows what the
modules implement (docs/design.md section 4):

* TSP: a layer's weight traffic (broadcast shards, ring shards, weight-gradient reduces) and its K/V
  all-gather / dK/dV reduce-scatter are issued before the GEMMs they hide behind, so a layer costs
  max(GEMM time, traffic time); the vocabulary ring of the head likewise hides behind the head GEMMs. Norm
  gradient sums and the loss statistics stay exposed.
* TP: the forward all-reduces (and their re-run under recompute) wait before the next GEMM: exposed. The
  backward's input-gradient all-reduces run while the weight-gradient GEMMs compute: hidden behind those.
* SP, TP x SP: the K/V all-gather is waited on before attention and the gradient all-reduces inside the
  backward hooks: exposed.
* Data parallelism: the fp32 gradient all-reduce after backward: exposed.

Pure Python like the rest of ``torchtsp.analysis``. Peak figures are the vendors' published ones (sources in
docs/analysis.md); nothing here was measured.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from ..argtypes import DTYPE_BYTES
from ..config import ModelConfig
from ..presets import get_preset
from ..recompute import FULL, recompute_policy
from ..schemes import AXES, SCHEMES, get_scheme
from ..sizes import layer_weight_elements
from .comm_model import predict_comm
from .memory_model import predict_memory
from .table import count, gb, render
from .validation import axis_splits

TERA, GIGA = 1e12, 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU's published peaks. Bandwidths are per direction, per GPU (what one GPU can receive)."""

    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s (no sparsity)
    hbm_bytes_per_s: float
    hbm_bytes: float
    intra_node_bytes_per_s: float  # to the other GPUs of its node (NVLink / Infinity Fabric), one direction
    inter_node_bytes_per_s: float  # its share of the network: one NIC per GPU, as these clusters are built
    gpus_per_node: int = 8


HARDWARE = {
    # AMD Instinct MI300X: 1307.4 TFLOPS dense bf16, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of
    # 128 GB/s bidirectional (448 GB/s out of one GPU per direction); one 400 Gb/s NIC per GPU.
    "mi300x": Hardware("mi300x", 1307.4 * TERA, 5.3e12, 192 * GIGA, 448 * GIGA, 50 * GIGA),
    # NVIDIA H100 SXM5: 989.4 TFLOPS dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s bidirectional.
    "h100": Hardware("h100", 989.4 * TERA, 3.35e12, 80 * GIGA, 450 * GIGA, 50 * GIGA),
    # NVIDIA H200 SXM: the H100's compute and NVLink, 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware("h200", 989.4 * TERA, 4.8e12, 141 * GIGA, 450 * GIGA, 50 * GIGA),
    # NVIDIA A100 SXM4 80 GB: 312 TFLOPS dense bf16, HBM2e at 2.039 TB/s, NVLink 3 at 600 GB/s bidirectional;
    # one 200 Gb/s HDR NIC per GPU.
    "a100": Hardware("a100", 312 * TERA, 2.039e12, 80 * GIGA, 300 * GIGA, 25 * GIGA),
}

# The paper's cluster throughput (1,024 MI300X, paper-7b, 128K tokens, D = 8), tokens/s, by the scheme measured
# (data the paper reports, not a list of schemes: TSP and its TP x SP baseline).
PAPER_CLUSTER = {"setting": dict(hardware="mi300x", preset="paper-7b", gpus=1024, group=8, seq_len=131072),
                 "tokens_per_s": {"tsp": 173e6, "tp_sp": 66.3e6}}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE)}")
    return HARDWARE[name]


# ---------------------------------------------------------------- FLOPs


@dataclass
class Flops:
    """FLOPs of one forward over ``tokens`` tokens (whole model, all GPUs together)."""

    layer_gemm: float  # one decoder layer's projections and MLP
    attention: float  # one layer's causal scores and weighted values (flash kernels skip masked blocks)
    head: float  # the LM head GEMM (the embedding is a lookup)
    layers: int

    @property
    def forward(self) -> float:
        return self.layers * (self.layer_gemm + self.attention) + self.head


def forward_flops(cfg: ModelConfig, batch: int, seq_len: int) -> Flops:
    """2 FLOPs per multiply-add: 2·P per token per layer for the GEMMs, 2·S²·n_heads·d per sequence per layer
    for causal attention (QK^T and PV, 4·S²·n_heads·d over the full square, half of it under the mask)."""
    if cfg.moe:
        raise ValueError("--hardware models dense models; this preset is a mixture of experts")
    tokens = batch * seq_len
    attention = batch * 2 * seq_len * seq_len * cfg.n_heads * cfg.head_dim
    return Flops(layer_gemm=2 * layer_weight_elements(cfg) * tokens, attention=attention,
                 head=2 * cfg.dim * cfg.vocab_size * tokens, layers=cfg.n_layers)


def _full(recompute: str | bool) -> bool:
    """Whether the policy re-runs each layer's forward (full). Selective's recomputed elementwise ops (and TSP's
    gate and up projections) are not priced: its step is priced as none's."""
    return recompute_policy(recompute) == FULL


def step_multiplier(recompute: str | bool) -> int:
    """Forwards' worth of FLOPs in a training step: forward, backward (twice the forward), and the re-run."""
    return 3 + int(_full(recompute))


# ---------------------------------------------------------------- step time


@dataclass
class StepTime:
    layout: str
    scheme: str
    group: int  # GPUs of one replica (the scheme's axes)
    dp: int
    compute_s: float
    comm_s: float  # every byte at its link's bandwidth, hidden or not
    exposed_s: float  # the communication on the critical path
    step_s: float
    tokens_per_s: float  # the whole cluster's
    mfu_effective: float  # model FLOPs / (GPUs x peak x step time)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepParts:
    """One replica's step, in seconds at the link's bandwidth or the GEMMs' rate, for a scheme's step-cost model."""

    layers: int
    recompute: bool
    gemm_forward_s: float  # one layer's forward GEMMs
    head_gemm_s: float  # the head's GEMMs over the whole step
    layer_forward_s: float  # one layer's forward traffic
    layer_backward_s: float  # one layer's backward traffic (with the re-run under recompute)
    head_s: float  # the embedding and head traffic, forward and backward
    sync_s: float  # the gradient sums over the scheme's own axes


# Step-cost models: the exposed communication of a step under each scheme's overlap (the registry's ``step_cost``).

def overlapped_exposed_s(p: StepParts) -> float:
    """TSP: each layer's traffic behind that layer's GEMMs (forward: 1x, backward: 2x, plus the re-run), the
    vocabulary ring behind the head GEMMs; the gradient sums exposed."""
    bwd_gemm_s = (2 + int(p.recompute)) * p.gemm_forward_s
    exposed = p.layers * (max(0.0, p.layer_forward_s - p.gemm_forward_s) + max(0.0, p.layer_backward_s - bwd_gemm_s))
    return exposed + max(0.0, p.head_s - p.head_gemm_s) + p.sync_s


def tp_exposed_s(p: StepParts) -> float:
    """TP: the forward all-reduces (and their re-run) exposed; the backward's input-gradient all-reduces hidden
    behind the weight-gradient GEMMs."""
    rerun = int(p.recompute) * p.layer_forward_s
    hidden_bwd = p.layer_backward_s - rerun
    return p.layers * (p.layer_forward_s + rerun + max(0.0, hidden_bwd - p.gemm_forward_s)) + p.head_s + p.sync_s


def serial_exposed_s(p: StepParts) -> float:
    """SP, TP x SP: every byte waited for (the K/V all-gather before attention, the sums in backward hooks)."""
    return p.layers * (p.layer_forward_s + p.layer_backward_s) + p.head_s + p.sync_s


def priced_schemes() -> tuple[str, ...]:
    """The schemes with a step-cost model over a replica of their own axes."""
    return tuple(s.name for s in SCHEMES.values() if s.step_cost and s.axes)


def predict_step(scheme: str, cfg: ModelConfig, hw: Hardware, *, gpus: int, degrees: dict, seq_len: int,
                 batch: int | None = None, mfu: float = 0.4, dtype_bytes: int = 2, recompute: str | bool = False,
                 sequence_parallel: bool = False) -> StepTime:
    """One training step of ``scheme`` over ``degrees`` (one replica, inside a node) replicated over
    gpus / group replicas. ``batch``: sequences per step over the cluster (default one per replica)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    recompute = _full(recompute)
    spec = get_scheme(scheme)
    if spec.step_cost is None:
        raise ValueError(f"no step-time model for scheme {scheme!r}; choose one of: {', '.join(priced_schemes())}")
    axes = {a: degrees.get(a, 1) for a in AXES if a != "dp"}  # an axis the scheme does not use: refused below
    group = math.prod(axes.values())
    if gpus % group:
        raise ValueError(f"{gpus} GPUs do not divide into replicas of {group}")
    if group > hw.gpus_per_node:
        raise ValueError(f"a replica of {group} GPUs spans nodes ({hw.gpus_per_node} GPUs per node): its axis "
                         "would cross the network, which this model does not price")
    dp = gpus // group
    batch = dp if batch is None else batch
    if batch % dp:
        raise ValueError(f"batch {batch} does not split over {dp} replicas")
    per_replica = batch // dp
    comm = predict_comm(scheme, cfg, per_replica, seq_len, dtype_bytes=dtype_bytes, recompute=recompute,
                        sequence_parallel=sequence_parallel, **axes)
    with_dp = predict_comm(scheme, cfg, batch, seq_len, dtype_bytes=dtype_bytes, recompute=recompute,
                           sequence_parallel=sequence_parallel, dp=dp, **axes)
    dp_bytes = with_dp.total - comm.total  # the fp32 gradient sums over replicas (and their loss statistics)

    rate = hw.bf16_flops * mfu * group  # one replica's FLOP/s
    f = forward_flops(cfg, per_replica, seq_len)
    mult = step_multiplier(recompute)
    link = hw.intra_node_bytes_per_s
    parts = StepParts(layers=cfg.n_layers, recompute=recompute, gemm_forward_s=f.layer_gemm / rate,
                      head_gemm_s=mult * f.head / rate, layer_forward_s=comm.layer_forward / link,
                      layer_backward_s=comm.layer_backward / link,
                      head_s=(comm.embed_head_forward + comm.embed_head_backward) / link, sync_s=comm.grad_sync / link)
    compute_s = mult * f.forward / rate
    exposed = spec.load("step_cost")(parts)
    dp_s = dp_bytes / hw.inter_node_bytes_per_s if dp > 1 else 0.0
    exposed += dp_s
    step_s = compute_s + exposed
    tokens = batch * seq_len
    model_flops = mult * forward_flops(cfg, batch, seq_len).forward
    return StepTime(layout=spec.label_for({**axes, "dp": dp}, sequence_parallel), scheme=scheme,
                    group=group, dp=dp, compute_s=compute_s, comm_s=comm.total / link + dp_s, exposed_s=exposed,
                    step_s=step_s, tokens_per_s=tokens / step_s,
                    mfu_effective=model_flops / (gpus * hw.bf16_flops * step_s))


def ceiling_tokens_per_s(cfg: ModelConfig, hw: Hardware, gpus: int, seq_len: int, *, train: bool = True,
                         recompute: str | bool = False) -> float:
    """Tokens/s of the cluster at 100% of peak FLOP/s, with no communication at all: the physical ceiling."""
    per_token = forward_flops(cfg, 1, seq_len).forward / seq_len
    if train:
        per_token *= step_multiplier(recompute)
    return gpus * hw.bf16_flops / per_token


def group_layouts(group: int) -> list[tuple[str, dict, bool]]:
    """(scheme, degrees, Megatron-SP) of one replica of ``group`` GPUs: every scheme with a step-cost model, on
    each split of the group over its axes (every axis at least 2 when it has several), with and without
    Megatron-SP where it takes that option."""
    out = []
    for name in priced_schemes():
        spec = SCHEMES[name]
        seqpar = (False, True) if "sequence_parallel" in spec.options else (False,)
        out += [(name, degrees, sp) for degrees in reversed(list(axis_splits(group, spec.axes))) for sp in seqpar]
    return out


def hardware_report(cfg: ModelConfig, hw: Hardware, *, gpus: int, group: int, seq_len: int, mfu: float,
                    batch: int | None, dtype_bytes: int, recompute: bool, zero: int = 0) -> dict:
    """Every layout's step (``rows``) and its per-GPU peak memory (``peak_bytes`` by layout, as ``plan`` predicts
    it, with the distributed optimizer at ``zero`` where dp > 1), or why it cannot run (``errors``)."""
    rows, errors, peaks = [], [], {}
    for scheme, degrees, seqpar in group_layouts(group):
        try:
            row = predict_step(scheme, cfg, hw, gpus=gpus, degrees=degrees, seq_len=seq_len, batch=batch,
                               mfu=mfu, dtype_bytes=dtype_bytes, recompute=recompute, sequence_parallel=seqpar)
            level = zero if row.dp > 1 and get_scheme(scheme).zero else 0
            peaks[row.layout] = predict_memory(scheme, cfg, batch or row.dp, seq_len, dp=row.dp, **degrees,
                                               sequence_parallel=seqpar, dtype_bytes=dtype_bytes,
                                               recompute=recompute, zero=level).total
            rows.append(row)
        except ValueError as e:
            errors.append({"scheme": scheme, **degrees, "error": str(e)})
    return {"rows": rows, "errors": errors, "peak_bytes": peaks,
            "ceiling_train": ceiling_tokens_per_s(cfg, hw, gpus, seq_len, recompute=False),
            "ceiling_forward": ceiling_tokens_per_s(cfg, hw, gpus, seq_len, train=False)}


def paper_cluster_comparison(report: dict, cfg: ModelConfig, seq_len: int) -> dict:
    """The paper's 1,024-GPU figures beside ours and the ceilings (only meaningful in the paper's setting)."""
    paper = PAPER_CLUSTER["tokens_per_s"]
    best = {s: max((r for r in report["rows"] if r.scheme == s), key=lambda r: r.tokens_per_s, default=None)
            for s in paper}
    train, fwd = report["ceiling_train"], report["ceiling_forward"]
    per_token = forward_flops(cfg, 1, seq_len)
    attention_share = cfg.n_layers * per_token.attention / per_token.forward
    group = PAPER_CLUSTER["setting"]["group"]
    # Ceilings under other ways of counting, to see which could hold 173M tokens/s.
    readings = {"training step, tokens once per sequence": train,
                f"training step, tokens once per GPU of a group (x{group})": train * group,
                "training step without attention FLOPs": train / (1 - attention_share),
                f"training step without attention FLOPs, x{group}": train / (1 - attention_share) * group,
                "forward only": fwd, f"forward only, x{group}": fwd * group}
    # The best layout with Megatron-SP (TP8 with sequence parallelism in the paper's setting).
    tp_seqpar = max((r for r in report["rows"] if "+seqpar" in r.layout), key=lambda r: r.tokens_per_s, default=None)
    return {"paper_tsp": paper["tsp"], "paper_tp_sp": paper["tp_sp"],
            "ours_tsp": best["tsp"] and best["tsp"].tokens_per_s,
            "ours_tp_sp": best["tp_sp"] and best["tp_sp"].tokens_per_s,
            "ours_tp_sp_layout": best["tp_sp"] and best["tp_sp"].layout,
            "ceiling_train": train, "ceiling_forward": fwd,
            "paper_tsp_over_train_ceiling": paper["tsp"] / train,
            "paper_tsp_over_forward_ceiling": paper["tsp"] / fwd,
            "attention_flops_share": attention_share, "ceilings_by_reading": readings,
            "ours_tp_seqpar": tp_seqpar and tp_seqpar.tokens_per_s}


# ---------------------------------------------------------------- command line


def _is_paper_setting(args) -> bool:
    s = PAPER_CLUSTER["setting"]
    return (args.hardware, args.preset, args.gpus, args.tsp or 8, args.seq_len) == (
        s["hardware"], s["preset"], s["gpus"], s["group"], s["seq_len"])


def run_hardware_plan(args: argparse.Namespace) -> int:
    """``torchtsp plan --hardware NAME``: predicted step time and tokens/s of each layout of one replica
    (``--tsp`` GPUs, default a node) replicated over ``--gpus``."""
    if args.mode != "train":
        raise ValueError("--hardware predicts training steps; drop --mode infer")
    if args.pp is not None or args.nodes is not None:
        raise ValueError("--hardware does not take --pp or --nodes; give --gpus and --tsp (GPUs per replica)")
    if not 0 < args.mfu <= 1:  # NaN fails both comparisons
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    cfg = get_preset(args.preset)
    hw = get_hardware(args.hardware)
    for name in ("seq_len", "gpus"):
        if not 1 <= getattr(args, name) <= 2**40:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer up to 2^40")
    group = args.tsp or hw.gpus_per_node
    if not 1 <= group <= hw.gpus_per_node or args.gpus % group:
        raise ValueError(f"--tsp (GPUs per replica) must be between 1 and {hw.gpus_per_node} (one node) and divide "
                         f"--gpus={args.gpus}; got {group}")
    batch = args.batch_size if (args.batch_size or 1) > 1 else None  # the default: one sequence per replica
    dtype_bytes = DTYPE_BYTES[args.dtype]
    report = hardware_report(cfg, hw, gpus=args.gpus, group=group, seq_len=args.seq_len, mfu=args.mfu,
                             batch=batch, dtype_bytes=dtype_bytes, recompute=args.recompute, zero=args.zero)
    peaks = report["peak_bytes"]
    paper = paper_cluster_comparison(report, cfg, args.seq_len) if _is_paper_setting(args) else None
    if args.json:
        rows = [{**r.to_dict(), "peak_bytes": peaks[r.layout], "fits": peaks[r.layout] <= hw.hbm_bytes}
                for r in report["rows"]]
        print(json.dumps({"hardware": asdict(hw), "mfu": args.mfu, "rows": rows,
                          "errors": report["errors"], "ceiling_train_tokens_per_s": report["ceiling_train"],
                          "ceiling_forward_tokens_per_s": report["ceiling_forward"], "paper": paper}, indent=1))
        return 0
    _print_hardware_table(args, hw, group, batch, report)
    if paper:
        _print_paper_cluster(paper)
    return 0


def ranked_steps(rows: list[StepTime], peaks: dict[str, int], hbm_bytes: float) -> list[StepTime]:
    """Layouts whose peak fits the GPU's memory first, fastest first; then the others, fastest first."""
    return sorted(rows, key=lambda r: (peaks[r.layout] > hbm_bytes, r.step_s))


def _print_hardware_table(args, hw: Hardware, group: int, batch: int | None, report: dict) -> None:
    print(f"torchtsp plan --hardware {hw.name}: {args.preset}, S={count(args.seq_len)}, {args.gpus:,} GPUs in "
          f"replicas of {group}, one sequence per replica{'' if batch is None else f' (batch {batch:,})'}, "
          f"{args.dtype}, MFU {args.mfu:g}{f', recompute {args.recompute}' if args.recompute != 'none' else ''}")
    print(f"  {hw.bf16_flops / TERA:,.0f} TFLOP/s bf16, HBM {hw.hbm_bytes / GIGA:,.0f} GB at "
          f"{hw.hbm_bytes_per_s / GIGA:,.0f} GB/s, intra-node {hw.intra_node_bytes_per_s / GIGA:,.0f} GB/s, "
          f"NIC {hw.inter_node_bytes_per_s / GIGA:,.0f} GB/s per GPU")
    peaks = report["peak_bytes"]
    headers = ["layout", "peak GB", "fits", "compute s", "comm s", "exposed s", "step s", "tokens/s", "MFU"]
    cells = [[r.layout, gb(peaks[r.layout]), "yes" if peaks[r.layout] <= hw.hbm_bytes else "no",
              f"{r.compute_s:,.3f}", f"{r.comm_s:,.3f}", f"{r.exposed_s:,.3f}", f"{r.step_s:,.3f}",
              count(r.tokens_per_s), f"{r.mfu_effective:.3f}"]
             for r in ranked_steps(report["rows"], peaks, hw.hbm_bytes)]
    print("\n".join(render(headers, cells, left=(0, 2), indent="  ")))
    for e in report["errors"]:
        print(f"  n/a: {e['error']}")
    print(f"  ceiling (100% of peak, no communication): {count(report['ceiling_train'])} tokens/s training, "
          f"{count(report['ceiling_forward'])} tokens/s forward only")
    print(f"  peak GB: per GPU (1e9 bytes), as plan predicts it; fits: within the GPU's {hw.hbm_bytes / GIGA:,.0f} "
          "GB (layouts that fit come first, fastest first); comm s: every byte at its link's bandwidth; exposed s: "
          "what the overlap rules leave on the critical path (torchtsp.analysis.hardware); MFU: model FLOPs / "
          "(GPUs x peak x step)")


def _print_paper_cluster(p: dict) -> None:
    print()
    print("The paper's cluster throughput (1,024 MI300X, paper-7b, 128K, D = 8) beside our prediction:")
    print(f"  {'tokens/s':<28} {'paper':>13} {'ours':>13}")
    print(f"  {'TSP':<28} {count(p['paper_tsp']):>13} {count(p['ours_tsp']):>13}")
    print(f"  {'TP+SP':<28} {count(p['paper_tp_sp']):>13} {count(p['ours_tp_sp']):>13}  (ours: best TP x SP, "
          f"{p['ours_tp_sp_layout']})")
    print(f"  {'TP8 with Megatron-SP':<28} {'':>13} {count(p['ours_tp_seqpar']):>13}")
    print(f"  {'ratio TSP / TP+SP':<28} {p['paper_tsp'] / p['paper_tp_sp']:>13.2f} "
          f"{p['ours_tsp'] / p['ours_tp_sp']:>13.2f}")
    print(f"  physical ceiling: {count(p['ceiling_train'])} tokens/s for a training step, "
          f"{count(p['ceiling_forward'])} for a forward alone (attention is {p['attention_flops_share']:.0%} of the "
          "FLOPs at this context)")
    print("  ceilings (100% of peak, no communication) under other ways of counting tokens:")
    for reading, ceiling in p["ceilings_by_reading"].items():
        verdict = "can hold" if ceiling >= p["paper_tsp"] else "cannot hold"
        print(f"    {reading:<58} {count(ceiling):>13}  {verdict} 173M")
    if p["paper_tsp_over_train_ceiling"] > 1:
        print(f"  The paper's 173M tokens/s is {p['paper_tsp_over_train_ceiling']:.1f}x the ceiling of a training "
              f"step of this model at 128K on 1,024 MI300X ({p['paper_tsp_over_forward_ceiling']:.1f}x that of a "
              "forward alone), so it cannot be training tokens per second counted once per sequence. It must count "
              "something else; of the readings above, only those marked 'can hold' stay under the hardware's "
              "limit. The paper's TSP / baseline ratio (2.6x) can be set beside ours; its absolute figures "
              "cannot.")


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", choices=list(HARDWARE), help="predict step time and tokens/s on this GPU "
                        "(a replica of --tsp GPUs, default one node, replicated over --gpus)")
    parser.add_argument("--mfu", type=float, default=0.4, help="with --hardware: fraction of peak FLOP/s the "
                        "GEMMs and attention reach (default: 0.4)")
