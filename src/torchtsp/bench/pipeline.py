"""``torchtsp bench --pp N``: pipeline stages around TSP, measured against the pipeline model's prediction.

On the same W ranks and global batch, per sequence length, two layouts run the same float operations per
rank: the pipeline [pp, tsp = W/pp] (each stage L/pp layers on all B rows, in M microbatches) and, as its
bubble-free baseline, TSP over the same tsp degree replicated pp times ([dp = pp, tsp]: the whole model
on B/pp rows). The pipeline model predicts the pipeline's step time as the baseline's divided by
(1 - bubble), bubble = (pp-1)/(M+pp-1), its per-stage peak memory (``predict_pipeline``), and the bytes of
the stage-boundary sends, which must equal what comm.py counted.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import torch

from ..analysis.pipeline_model import predict_pipeline
from ..distributed import comm
from ..distributed.comm import AxisComm, Traffic
from ..distributed.mesh import init_mesh, mesh_device
from ..memory import measure_peak
from ..model import Transformer
from ..parallel import parallelize, pipeline_parallelize
from ..train.optim import build_adamw

MiB = 2**20


def _layout_on_rank(cfg, pipeline: bool, pp: int, tsp: int, batch: int, seq_len: int, microbatches: int,
                    schedule: str, warmup: int, steps: int, seed: int, timeout_s: float) -> dict:
    gc.collect()
    mesh = init_mesh(pp=pp, tsp=tsp, timeout_s=timeout_s) if pipeline else init_mesh(dp=pp, tsp=tsp,
                                                                                       timeout_s=timeout_s)
    device = mesh_device(mesh)
    torch.manual_seed(seed)
    model = Transformer(cfg, device="meta")
    if pipeline:
        model = pipeline_parallelize(model, mesh, microbatches=microbatches, schedule=schedule, timeout_s=timeout_s)
    else:
        model = parallelize(model, mesh, "tsp", timeout_s=timeout_s)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g).to(device)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g).to(device)
    params = dict(model.named_parameters())
    refs = {n: [r for r, *_ in model.reference_parts(n, p)] for n, p in params.items()}
    optimizer = build_adamw(((refs[n], p) for n, p in params.items()), 1e-3, 0.0)

    def step():
        loss = model.forward_backward(tokens, labels)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    with Traffic(model.comms()) as traffic:
        step()
    for _ in range(max(warmup - 1, 0)):
        step()
    _, peak = measure_peak(step, model, optimizer)
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    world = AxisComm.world(timeout_s)
    slowest = world.all_gather(torch.tensor(times, dtype=torch.float64, device=device)).max(0).values.tolist()
    stage = model.pp.rank if pipeline else 0
    per_rank = world.all_gather(torch.tensor([float(peak), float(stage),
                                              float(traffic.stats.get("pp").bytes_recv["pipeline_p2p"]
                                                    if pipeline else 0)], dtype=torch.float64, device=device))
    peaks: dict[int, int] = {}
    for p, s, _ in per_rank.tolist():
        peaks[int(s)] = max(peaks.get(int(s), 0), int(p))
    return {"median_step_s": statistics.median(slowest), "stage_peak_bytes": [peaks[s] for s in sorted(peaks)],
            "p2p_recv_bytes_max": int(per_rank[:, 2].max().item())}


def pipeline_cells_on_rank(cfg, pp, tsp, batch, seq_lens, microbatches, schedule, warmup, steps, seed, timeout_s):
    out = []
    for S in seq_lens:
        cell = {"seq_len": S}
        for name, pipeline in (("pipeline", True), ("baseline", False)):
            cell[name] = _layout_on_rank(cfg.replace(max_seq_len=max(cfg.max_seq_len, S)), pipeline, pp, tsp, batch,
                                         S, microbatches, schedule, warmup, steps, seed, timeout_s)
        out.append(cell)
    return out


def run_pipeline_bench(args, cfg, runner) -> int:
    pp, world = args.pp, runner.world
    if pp < 2 or world % pp:
        raise ValueError(f"--pp {pp} must be at least 2 and divide the {world} ranks (--nproc)")
    tsp = world // pp
    microbatches = pp if args.microbatches is None else args.microbatches  # 0 is refused, never read as unset
    if microbatches < 1:
        raise ValueError(f"--microbatches must be at least 1, got {microbatches}")
    plans = {S: predict_pipeline(cfg, args.batch_size, S, pp=pp, tsp=tsp, microbatches=microbatches,
                                 schedule=args.schedule, dtype_bytes=4, foreach=runner.device == "cuda")
             for S in args.seq_lens}  # every bad split refused here, before any rank starts
    cells = runner(pipeline_cells_on_rank, cfg, pp, tsp, args.batch_size, list(args.seq_lens), microbatches,
                   args.schedule, args.warmup, args.steps, args.seed, args.timeout_s)
    rows = []
    for cell in cells:
        plan = plans[cell["seq_len"]]
        base, piped = cell["baseline"]["median_step_s"], cell["pipeline"]["median_step_s"]
        predicted = base / (1 - plan.bubble)
        rows.append({"seq_len": cell["seq_len"], "pp": pp, "tsp": tsp, "microbatches": plan.microbatches,
                     "schedule": args.schedule, "bubble": plan.bubble, "baseline_step_s": base,
                     "pipeline_step_s": piped, "predicted_step_s": predicted,
                     "step_time_vs_prediction": piped / predicted,
                     "stage_peak_bytes": cell["pipeline"]["stage_peak_bytes"],
                     "predicted_stage_peak_bytes": [s.total for s in plan.stages],
                     "p2p_recv_bytes": cell["pipeline"]["p2p_recv_bytes_max"],
                     "predicted_p2p_recv_bytes": plan.p2p_bytes_per_rank})
    if runner.rank != 0:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps({"model": cfg.to_dict(), "batch": args.batch_size,
                                                   "world": world, "rows": rows}, indent=2))
    lines = [f"pipeline pp={pp} x tsp={tsp}, {microbatches} microbatches, {args.schedule}, B={args.batch_size}, "
             f"{world} ranks ({runner.device}); baseline: dp={pp} x tsp={tsp}, same float operations per rank",
             "", "| S | bubble | baseline step | pipeline step | predicted | measured/predicted | stage peaks MiB "
             "(predicted) | p2p bytes/rank (predicted) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peaks = ", ".join(f"{m / MiB:.1f} ({p / MiB:.1f})" for m, p in zip(r["stage_peak_bytes"],
                                                                            r["predicted_stage_peak_bytes"]))
        lines.append(f"| {r['seq_len']} | {r['bubble']:.1%} | {r['baseline_step_s'] * 1e3:.0f} ms | "
                     f"{r['pipeline_step_s'] * 1e3:.0f} ms | {r['predicted_step_s'] * 1e3:.0f} ms | "
                     f"{r['step_time_vs_prediction']:.2f} | {peaks} | {r['p2p_recv_bytes']} "
                     f"({r['predicted_p2p_recv_bytes']}) |")
    (out / "pipeline.md").write_text("\n".join(lines) + "\n")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("\n".join(lines))
        print(f"wrote {out / 'pipeline.json'}, {out / 'pipeline.md'}")
    return 0
