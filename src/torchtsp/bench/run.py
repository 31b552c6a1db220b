"""``torchtsp bench``: every scheme on the same model, global batch and ranks, over a sweep of sequence lengths.

One *cell* is one (scheme, sequence length). On every rank of the world a cell

1. builds the model (same seed everywhere), applies the scheme on its mesh (``scheme_degrees``: every scheme
   spans all W ranks; TP x SP takes the most square T x Σ) and an AdamW over the rank's parameters;
2. runs one step (forward + backward + AdamW) whose forward, and separately the whole step, are counted by
   ``AxisComm.counting()`` on every axis of ``model.comms()``; then ``--warmup - 1`` more untimed steps;
3. measures the live-tensor peak of one whole step, optimizer state present (``measure_peak`` tracking the
   model and the optimizer);
4. times ``--steps`` steps, each started after a barrier.

The ranks' numbers are gathered over the world, so every rank returns the same aggregate: peak = max over
ranks, step time = max over ranks per step then the median over steps, tokens/s = B·S / median. Bytes are
compared per rank with ``predict_comm``: forward = L·layer_forward + embed_head_forward, step = total, and
``bytes_match`` is true only if every rank received exactly the predicted bytes. torch_tp runs PyTorch's own
collectives, which our comm layer does not see: its bytes and predictions are null.

``--max-seq-under GB`` replaces the sweep: per scheme, S doubles from ``--max-seq-start`` until the measured
per-rank peak exceeds the budget (or S passes ``--max-seq-cap``); the answer is the longest S that fitted. Its
cells skip the timed steps and create the optimizer state with a zero-gradient AdamW step instead of a real one.

Locally, one ``WorkerPool`` of ``--nproc`` CPU ranks serves the whole run. Under torchrun the launched ranks run
the same loop in lockstep and rank 0 writes the outputs.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..analysis import predict_comm, predict_memory
from ..analysis.memory_model import check_layout
from ..config import ModelConfig, get_preset
from ..distributed import comm
from ..distributed.comm import AxisComm
from ..distributed.launch import WorkerPool
from ..distributed.mesh import init_mesh
from ..memory import measure_peak
from ..model import Transformer
from ..parallel import parallelize
from ..train.optim import build_adamw
from . import report
from .args import BENCH_MODEL, MODEL_FLAGS

MiB = 2**20
GiB = 2**30
LR, WEIGHT_DECAY = 1e-4, 0.1  # the values do not matter: the bench measures, it does not train


# ---------------------------------------------------------------- what to run


def scheme_degrees(scheme: str, world: int) -> dict[str, int]:
    """Mesh degrees of ``scheme`` on ``world`` ranks: every scheme uses all of them on its own axis;
    TP x SP takes the most square factorisation T x Σ (T >= Σ: T = 2, Σ = 2 at 4 ranks; T = 4, Σ = 2 at 8)."""
    degrees = {"dp": 1, "tsp": 1, "tp": 1, "sp": 1}
    if scheme == "tp_sp":
        sp = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
        degrees.update(tp=world // sp, sp=sp)
    elif scheme == "torch_tp":
        degrees["tp"] = world
    else:
        degrees[scheme] = world
    return degrees


def mesh_label(degrees: dict[str, int]) -> str:
    used = [f"{k}={v}" for k, v in degrees.items() if v > 1]
    return " x ".join(used) or "1 rank"


@dataclass(frozen=True)
class CellSpec:
    """One (scheme, sequence length) on every rank; picklable for the worker pool."""

    scheme: str
    degrees: dict
    cfg: ModelConfig
    batch: int
    seq_len: int
    warmup: int
    steps: int
    options: dict = field(default_factory=dict)
    mode: str = "sweep"  # "sweep": count, measure, time; "memory": measure the peak only
    seed: int = 0
    timeout_s: float = 600.0


def scheme_options(scheme: str, sequence_parallel: bool) -> dict:
    return {"sequence_parallel": sequence_parallel} if scheme in ("tp", "torch_tp") else {}


def layout_error(spec: CellSpec) -> str | None:
    """Why ``spec`` cannot run (indivisible heads, FFN, sequence or batch), before any rank starts it."""
    try:
        if spec.scheme == "torch_tp":
            T = spec.degrees["tp"]
            for name in ("n_heads", "n_kv_heads", "ffn_dim"):
                if getattr(spec.cfg, name) % T:
                    raise ValueError(f"{name}={getattr(spec.cfg, name)} is not divisible by the TP degree {T}")
            if spec.options.get("sequence_parallel") and spec.seq_len % T:
                raise ValueError(f"sequence length {spec.seq_len} must be divisible by the TP degree {T} "
                                 f"with sequence parallelism")
        else:
            check_layout(spec.scheme, spec.cfg, spec.batch, spec.seq_len, **spec.degrees)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


def predictions(spec: CellSpec, foreach: bool) -> dict:
    """The analytic model's per-rank peak memory and received bytes for ``spec`` (None for torch_tp)."""
    if spec.scheme == "torch_tp":
        return {"memory": None, "comm": None, "peak_bytes": None, "forward_bytes": None, "step_bytes": None}
    sp_flag = {"sequence_parallel": True} if spec.options.get("sequence_parallel") else {}
    mem = predict_memory(spec.scheme, spec.cfg, spec.batch, spec.seq_len, **spec.degrees, **sp_flag,
                         dtype_bytes=4, optimizer="adamw", foreach=foreach)
    traffic = predict_comm(spec.scheme, spec.cfg, spec.batch, spec.seq_len, **spec.degrees, **sp_flag,
                           dtype_bytes=4)
    return {"memory": mem.to_dict(), "comm": traffic.to_dict(), "peak_bytes": mem.total,
            "forward_bytes": spec.cfg.n_layers * traffic.layer_forward + traffic.embed_head_forward,
            "step_bytes": traffic.total}


# ---------------------------------------------------------------- on every rank

_MESHES: dict = {}  # degrees -> DeviceMesh, reused by every cell a rank runs (subgroups are costly to create)


def _mesh(degrees: dict, timeout_s: float):
    key = tuple(sorted(degrees.items()))
    if key not in _MESHES:
        _MESHES[key] = init_mesh(**degrees, timeout_s=timeout_s)
    return _MESHES[key]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the bench's own timing; library code never synchronizes


class _Counting:
    """``counting()`` on several axes at once; ``.recv`` sums received bytes, ``.by_op`` per operation."""

    def __init__(self, comms: dict[str, AxisComm]):
        self.comms, self.stats, self._cms = comms, {}, []

    def __enter__(self):
        for name, c in self.comms.items():
            cm = c.counting()
            self.stats[name] = cm.__enter__()
            self._cms.append(cm)
        return self

    def __exit__(self, *exc):
        for cm in reversed(self._cms):
            cm.__exit__(*exc)

    @property
    def recv(self) -> int:
        return sum(s.total_recv for s in self.stats.values())

    @property
    def by_op(self) -> dict[str, dict[str, int]]:
        return {axis: dict(s.bytes_recv) for axis, s in self.stats.items() if s.bytes_recv}


def _add_by_op(a: dict, b: dict) -> dict:
    out = {axis: dict(ops) for axis, ops in a.items()}
    for axis, ops in b.items():
        for op, n in ops.items():
            out.setdefault(axis, {})[op] = out.get(axis, {}).get(op, 0) + n
    return out


class _Built:
    """One scheme's model, AdamW and global batch on this rank; ``step()`` is forward + backward + AdamW."""

    def __init__(self, spec: CellSpec):
        mesh = _mesh(spec.degrees, spec.timeout_s)  # first: under torchrun on GPUs it selects this rank's GPU
        self.device = _device()
        torch.manual_seed(spec.seed)
        with torch.device(self.device):
            reference = Transformer(spec.cfg)
        self.model = parallelize(reference, mesh, spec.scheme, timeout_s=spec.timeout_s, **spec.options)
        g = torch.Generator().manual_seed(spec.seed)
        shape = (spec.batch, spec.seq_len)
        self.tokens = torch.randint(0, spec.cfg.vocab_size, shape, generator=g).to(self.device)
        self.labels = torch.randint(0, spec.cfg.vocab_size, shape, generator=g).to(self.device)
        self.model.shard_batch(self.tokens)  # indivisible sequence or batch: a ValueError here, before any collective
        self.params = dict(self.model.named_parameters())
        refs = {name: [ref for ref, *_ in self.model.reference_parts(name, p)] for name, p in self.params.items()}
        self.optimizer = build_adamw(((refs[n], p) for n, p in self.params.items()), LR, WEIGHT_DECAY)

    def step(self) -> torch.Tensor:
        loss = self.model.loss(self.tokens, self.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def timed_step(self) -> float:
        """One step started after a barrier (so every rank starts together); its wall time on this rank."""
        _sync(self.device)
        comm.barrier()
        start = time.perf_counter()
        self.step()
        _sync(self.device)
        return time.perf_counter() - start


def _build(spec: CellSpec) -> _Built | str:
    """The built cell, or why the scheme refuses it (every rank refuses alike, before communicating)."""
    gc.collect()  # the previous cell's model and optimizer (reference cycles) go before this one is built
    try:
        return _Built(spec)
    except ValueError as e:
        return " ".join(str(e).split())


def cell_on_rank(spec: CellSpec) -> dict:
    """Run one cell on this rank; returns the aggregate over all ranks (identical on every rank), or
    ``{"error": reason}`` if the scheme refuses this layout."""
    built = _build(spec)
    if isinstance(built, str):
        return {"error": built}
    model, optimizer, step = built.model, built.optimizer, built.step
    comms = model.comms()
    fwd_by_op = step_by_op = {}
    fwd_bytes = step_bytes = -1
    times: list[float] = []
    if spec.mode == "sweep":
        # Two blocks one after the other, not nested: nested counting() blocks on one axis trip over
        # CommStats' value equality (comm.py removes the first *equal* stats object on exit).
        with _Counting(comms) as forward:
            loss = model.loss(built.tokens, built.labels)
        with _Counting(comms) as rest:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        fwd_bytes, step_bytes = forward.recv, forward.recv + rest.recv
        fwd_by_op, step_by_op = forward.by_op, _add_by_op(forward.by_op, rest.by_op)
        for _ in range(spec.warmup - 1):
            step()
    else:  # optimizer state without a forward/backward: one AdamW step on zero gradients
        for p in built.params.values():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss, peak = measure_peak(step, model, optimizer)
    if spec.mode == "sweep":
        times = [built.timed_step() for _ in range(spec.steps)]

    world = AxisComm.world(spec.timeout_s)  # a separate comm: not counted with the model's axes
    local = torch.tensor([peak, fwd_bytes, step_bytes, loss.item(), *times], dtype=torch.float64,
                         device=built.device)
    rows = world.all_gather(local).cpu().tolist()
    step_times = [max(r[4 + i] for r in rows) for i in range(spec.steps if spec.mode == "sweep" else 0)]
    return {
        "error": None,
        "peak_bytes_per_rank": [int(r[0]) for r in rows],
        "forward_bytes_per_rank": [int(r[1]) for r in rows] if comms_counted(spec) else None,
        "step_bytes_per_rank": [int(r[2]) for r in rows] if comms_counted(spec) else None,
        "loss": rows[0][3],
        "step_times_s": step_times,
        "forward_bytes_by_op_rank0": fwd_by_op if comm.global_rank() == 0 else None,
        "step_bytes_by_op_rank0": step_by_op if comm.global_rank() == 0 else None,
    }


def paired_on_rank(specs: list[CellSpec]) -> dict:
    """Time several schemes' steps interleaved (A B, B A, A B, ...) on the same ranks and batch, so that a
    background load that comes and goes hits them alike; returns per scheme the step times (slowest rank
    per step) and their median. Each scheme gets ``spec.warmup`` untimed steps first."""
    built = [_build(spec) for spec in specs]
    if any(isinstance(b, str) for b in built):
        return {"error": next(b for b in built if isinstance(b, str))}
    for b, spec in zip(built, specs):
        for _ in range(spec.warmup):
            b.step()
    steps = specs[0].steps
    times = [[0.0] * steps for _ in specs]
    for i in range(steps):
        order = list(range(len(specs)))
        for k in order if i % 2 == 0 else reversed(order):
            times[k][i] = built[k].timed_step()
    device = built[0].device
    rows = AxisComm.world(specs[0].timeout_s).all_gather(
        torch.tensor([t for per in times for t in per], dtype=torch.float64, device=device)).cpu().tolist()
    out = {"error": None}
    for k, spec in enumerate(specs):
        per_step = [max(r[k * steps + i] for r in rows) for i in range(steps)]
        out[spec.scheme] = {"step_times_s": per_step, "median_step_s": statistics.median(per_step)}
    return out


def comms_counted(spec: CellSpec) -> bool:
    return spec.mode == "sweep" and spec.scheme != "torch_tp"


# ---------------------------------------------------------------- the driver


def _model_config(args) -> ModelConfig:
    cfg = get_preset(args.preset) if args.preset else ModelConfig(**BENCH_MODEL)
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k, None) is not None}
    return cfg.replace(**overrides) if overrides else cfg


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_args(args) -> None:
    for name in ("batch_size", "steps", "warmup", "max_seq_start", "max_seq_cap"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_seq_under is not None and args.max_seq_start > args.max_seq_cap:
        raise ValueError(f"--max-seq-start {args.max_seq_start} exceeds --max-seq-cap {args.max_seq_cap}")


def _aggregate(spec: CellSpec, result: dict, foreach: bool) -> dict:
    """One cell's record for results.json: measured, predicted, and how they compare."""
    base = {"scheme": spec.scheme, "mesh": mesh_label(spec.degrees), "degrees": spec.degrees,
            "seq_len": spec.seq_len, "batch": spec.batch, "options": spec.options}
    if result.get("error"):
        return {**base, "status": f"n/a: {result['error']}"}
    pred = predictions(spec, foreach)
    peak = max(result["peak_bytes_per_rank"])
    rec = {**base, "status": "ok", "loss": result["loss"],
           "peak_bytes": peak, "peak_bytes_per_rank": result["peak_bytes_per_rank"],
           "predicted_peak_bytes": pred["peak_bytes"],
           "peak_error_pct": None if pred["peak_bytes"] is None else 100.0 * (pred["peak_bytes"] - peak) / peak,
           "predicted_memory": pred["memory"]}
    if spec.mode == "sweep":
        median = statistics.median(result["step_times_s"])
        fwd, whole = result["forward_bytes_per_rank"], result["step_bytes_per_rank"]
        rec.update({
            "step_times_s": result["step_times_s"], "median_step_s": median,
            "tokens_per_s": spec.batch * spec.seq_len / median,
            "forward_bytes": None if fwd is None else fwd[0], "forward_bytes_per_rank": fwd,
            "predicted_forward_bytes": pred["forward_bytes"],
            "bytes_match": None if fwd is None else all(b == pred["forward_bytes"] for b in fwd),
            "step_bytes": None if whole is None else whole[0], "step_bytes_per_rank": whole,
            "predicted_step_bytes": pred["step_bytes"],
            "step_bytes_match": None if whole is None else all(b == pred["step_bytes"] for b in whole),
            "forward_bytes_by_op_rank0": result["forward_bytes_by_op_rank0"],
            "step_bytes_by_op_rank0": result["step_bytes_by_op_rank0"],
            "predicted_comm": pred["comm"],
        })
    return rec


class _Runner:
    """Runs a cell on every rank: through a local WorkerPool, or in lockstep under torchrun."""

    def __init__(self, args):
        self.torchrun = _launched_by_torchrun()
        if self.torchrun:
            self.world = int(os.environ["WORLD_SIZE"])
            if args.nproc is not None and args.nproc != self.world:
                raise ValueError(f"--nproc {args.nproc} does not match the torchrun world of {self.world} ranks; "
                                 f"omit --nproc or launch {args.nproc} ranks")
            self.owns_group = not comm.is_initialized()
            comm.init_process_group("nccl" if torch.cuda.is_available() else "gloo", args.timeout_s)
            self.pool = None
            self.rank = comm.global_rank()
        else:
            self.world = args.nproc or 4
            self.pool = WorkerPool(self.world, timeout_s=args.timeout_s) if self.world > 1 else None
            self.rank = 0
        self.timeout_s = args.timeout_s
        self.device = "cuda" if torch.cuda.is_available() and self.torchrun else "cpu"

    def __call__(self, spec, fn=cell_on_rank) -> dict:
        if self.pool is not None:
            return self.pool.run(fn, spec, timeout_s=self.timeout_s)[0]
        return fn(spec)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        elif self.torchrun and self.owns_group:
            comm.destroy_process_group()


def _meta(args, cfg: ModelConfig, runner: _Runner, elapsed_s: float) -> dict:
    return {"model": cfg.to_dict(), "batch": args.batch_size, "world": runner.world,
            "launcher": "torchrun" if runner.torchrun else "local WorkerPool",
            "device": runner.device if runner.device == "cpu" else torch.cuda.get_device_name(),
            "backend": "nccl" if runner.device == "cuda" else "gloo", "dtype": "float32",
            "sequence_parallel": args.sequence_parallel, "warmup": args.warmup, "steps": args.steps,
            "threads_per_rank": 1 if not runner.torchrun else torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "elapsed_s": elapsed_s, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _sweep(args, cfg: ModelConfig, runner: _Runner) -> dict:
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, *args.seq_lens))
    foreach = runner.device == "cuda"
    specs = [CellSpec(s, scheme_degrees(s, runner.world), cfg, args.batch_size, S, args.warmup, args.steps,
                      scheme_options(s, args.sequence_parallel), "sweep", args.seed, args.timeout_s)
             for S in args.seq_lens for s in args.schemes]
    # Our tp against PyTorch's own TP: besides each cell's timing, the two are timed interleaved per S.
    pairs = [S for S in args.seq_lens] if {"tp", "torch_tp"} <= set(args.schemes) else []
    cells, paired = [], {}
    bar = tqdm(total=len(specs) + len(pairs), desc="bench", unit="cell", dynamic_ncols=True, file=sys.stderr,
               disable=runner.rank != 0)
    for spec in specs:
        bar.set_postfix_str(f"{spec.scheme} S={spec.seq_len}")
        why = layout_error(spec)
        cells.append(_aggregate(spec, {"error": why} if why else runner(spec), foreach))
        bar.update(1)
    ok = {(c["scheme"], c["seq_len"]) for c in cells if c["status"] == "ok"}
    for S in pairs:
        bar.set_postfix_str(f"tp vs torch_tp S={S}")
        if ("tp", S) in ok and ("torch_tp", S) in ok:
            pair = [next(spec for spec in specs if spec.scheme == s and spec.seq_len == S) for s in ("tp", "torch_tp")]
            paired[S] = runner(pair, paired_on_rank)
        bar.update(1)
    bar.close()
    return {"cells": cells, "tp_vs_torch_tp": tp_vs_torch_tp(cells, paired)}


def tp_vs_torch_tp(cells: list[dict], paired: dict[int, dict]) -> dict | None:
    """Our tp's median step time over torch_tp's per sequence length: from the interleaved timing
    (``paired``, the figure to quote) and from the two schemes' own cells (timed minutes apart)."""
    times = {(c["scheme"], c["seq_len"]): c["median_step_s"] for c in cells if c["status"] == "ok"
             and "median_step_s" in c}
    cell_ratios = {S: times["tp", S] / times["torch_tp", S] for (s, S) in times
                   if s == "tp" and ("torch_tp", S) in times}
    if not cell_ratios:
        return None
    pair = {S: p for S, p in paired.items() if not p.get("error")}
    ratios = {S: p["tp"]["median_step_s"] / p["torch_tp"]["median_step_s"] for S, p in sorted(pair.items())}
    return {
        "method": "interleaved steps (tp, torch_tp, torch_tp, tp, ...) on the same ranks, median per scheme",
        "ratio_by_seq_len": {str(S): r for S, r in ratios.items()},
        "max_ratio": max(ratios.values()) if ratios else None,
        "total_ratio": (sum(p["tp"]["median_step_s"] for p in pair.values())
                        / sum(p["torch_tp"]["median_step_s"] for p in pair.values())) if pair else None,
        "interleaved": {str(S): p for S, p in sorted(pair.items())},
        "cell_ratio_by_seq_len": {str(S): r for S, r in sorted(cell_ratios.items())},
    }


def _max_seq(args, cfg: ModelConfig, runner: _Runner) -> dict:
    budget = int(args.max_seq_under * GiB)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, args.max_seq_cap))
    foreach = runner.device == "cuda"
    out = {"budget_gib": args.max_seq_under, "budget_bytes": budget, "start": args.max_seq_start,
           "cap": args.max_seq_cap, "schemes": {}}
    bar = tqdm(desc=f"max seq under {args.max_seq_under:g} GiB", unit="cell", dynamic_ncols=True, file=sys.stderr,
               disable=runner.rank != 0)
    for scheme in args.schemes:
        degrees, tried, longest, stop = scheme_degrees(scheme, runner.world), [], None, "cap reached"
        S = args.max_seq_start
        while S <= args.max_seq_cap:
            bar.set_postfix_str(f"{scheme} S={S}")
            spec = CellSpec(scheme, degrees, cfg, args.batch_size, S, 0, 0,
                            scheme_options(scheme, args.sequence_parallel), "memory", args.seed, args.timeout_s)
            why = layout_error(spec)
            rec = _aggregate(spec, {"error": why} if why else runner(spec), foreach)
            bar.update(1)
            tried.append({k: rec.get(k) for k in ("seq_len", "status", "peak_bytes", "predicted_peak_bytes",
                                                  "peak_error_pct")})
            if rec["status"] != "ok":
                stop = rec["status"]
                break
            if rec["peak_bytes"] > budget:
                stop = f"S={S} measured {rec['peak_bytes'] / MiB:.1f} MiB > budget"
                break
            longest = S
            S *= 2
        out["schemes"][scheme] = {"mesh": mesh_label(degrees), "longest_seq_len": longest, "stopped": stop,
                                  "tried": tried}
    bar.close()
    return out


def run_bench(args) -> int:
    """Entry point of ``torchtsp bench`` (flags from ``add_bench_arguments``); returns the exit code.

    ValueError for bad flags (or --nproc that contradicts the torchrun world); layouts a scheme cannot split
    become "n/a: reason" cells instead of failing the run.
    """
    _check_args(args)
    cfg = _model_config(args)
    runner = _Runner(args)
    start = time.perf_counter()
    try:
        result = _max_seq(args, cfg, runner) if args.max_seq_under is not None else _sweep(args, cfg, runner)
    finally:
        runner.close()
    result = {"meta": _meta(args, cfg, runner, time.perf_counter() - start), **result}
    if runner.rank != 0:
        return 0
    out = Path(args.out)
    if args.max_seq_under is not None:
        files = report.write_max_seq(result, out, plots=args.plots)
    else:
        files = report.write_sweep(result, out, plots=args.plots)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print((out / files[1].name).read_text() if len(files) > 1 else "")
        print("wrote " + ", ".join(str(f) for f in files))
    return 0
