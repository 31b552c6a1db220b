"""Inference side by side: time to first token, time per output token, per-rank peak memory and KV-cache
bytes of each scheme against prompt length, and the longest prompt each scheme fits in a per-rank budget.

``interleaved_on_rank`` is what every rank runs for one prompt length: every scheme built side by side, then
timed in alternating order several times, so that they see the same machine load; ``run_infer_bench`` drives
it over a pool of local ranks. ``infer_on_rank`` runs one cell alone (the longest-prompt search).
``torchtsp bench --mode infer`` (bench/run.py) drives them.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import asdict, dataclass

from ..kv_layouts import has_kv_layouts
from ..schemes import SCHEMES, inference_schemes
from ..timeouts import COLLECTIVE_TIMEOUT_S

INFER_SCHEMES = inference_schemes()


@dataclass(frozen=True)
class InferCell:
    scheme: str
    world: int
    model: dict  # ModelConfig fields
    prompt_len: int
    new_tokens: int = 32
    batch: int = 1
    seed: int = 0
    schedule: str = "auto"
    prefill_chunk: int | None = None
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    kv_layout: str = "auto"  # tsp's KV-cache layout (kv_layouts.py); the other schemes take only "auto"


def _build(cell: InferCell):
    """(model, prompts, generate options) of one cell on this rank, or the layout's refusal (a string; no
    communication has started)."""
    import torch

    from ..config import ModelConfig
    from ..distributed.mesh import init_mesh
    from ..kv_layouts import resolve_kv_layout
    from ..layout import Layout
    from ..model import Transformer
    from ..parallel import parallelize

    cfg = ModelConfig(**{**cell.model, "max_seq_len": max(cell.model.get("max_seq_len", 0),
                                                           cell.prompt_len + cell.new_tokens)})
    try:
        layout = Layout.resolve(cell.scheme, cell.world, cfg=cfg)
        resolve_kv_layout(cell.kv_layout, cfg.n_kv_heads, layout.sizes.get("tsp", 1), cell.scheme)
    except ValueError as e:
        return str(e)
    mesh = init_mesh(layout, timeout_s=cell.timeout_s)
    torch.manual_seed(cell.seed)
    model = parallelize(Transformer(cfg, device="meta"), mesh, layout, timeout_s=cell.timeout_s)
    g = torch.Generator().manual_seed(cell.seed)
    prompts = torch.randint(cfg.vocab_size, (cell.batch, cell.prompt_len), generator=g).tolist()
    return model, prompts, dict(schedule=cell.schedule, prefill_chunk=cell.prefill_chunk, kv_layout=cell.kv_layout)


def infer_on_rank(cell: InferCell) -> dict:
    """One cell on this rank: build, generate (after one short warm-up), measure. Returns this rank's figures;
    a layout the scheme cannot split gives {"error": ...} on every rank (no communication has started)."""
    from ..infer import generate
    from ..memory import measure_peak

    built = _build(cell)
    if isinstance(built, str):
        return {"error": built}
    model, prompts, options = built
    generate(model, [p[:8] for p in prompts], 2, **options)  # warm-up: first calls of kernels and collectives
    result, peak = measure_peak(lambda: generate(model, prompts, cell.new_tokens, **options), model)
    return {"ttft_s": result.prefill_s, "tpot_s": result.decode_s_per_token, "peak_bytes": peak,
            "kv_bytes": result.kv_cache_bytes, "schedule": result.schedule, "kv_layout": result.kv_layout}


@dataclass(frozen=True)
class InferRound:
    """Several schemes' cells (same model, prompt length and batch) timed interleaved ``repeats`` times."""

    cells: tuple[InferCell, ...]
    repeats: int = 3


def interleaved_on_rank(job: InferRound) -> list[dict]:
    """Every cell's scheme built side by side on the same ranks; each generates once under the memory tracker
    (peak, KV bytes; untimed: the tracker slows every op), then ``repeats`` timed generate calls per scheme in
    alternating order (A B, B A, A B, ...) so that a load that comes and goes hits them alike. Returns per cell
    its row (``aggregate``) with the runs' TTFT and TPOT (slowest rank per run), their medians and ranges."""
    import torch

    from ..distributed.comm import AxisComm
    from ..infer import generate
    from ..memory import measure_peak

    built = [_build(cell) for cell in job.cells]
    live = [i for i, b in enumerate(built) if not isinstance(b, str)]
    figures: dict[int, dict] = {}
    for i in live:
        model, prompts, options = built[i]
        generate(model, [p[:8] for p in prompts], 2, **options)  # warm-up: first calls of kernels and collectives
        run = functools.partial(generate, model, prompts, job.cells[i].new_tokens, **options)
        result, peak = measure_peak(run, model)
        figures[i] = {"peak_bytes": peak, "kv_bytes": result.kv_cache_bytes, "schedule": result.schedule,
                      "kv_layout": result.kv_layout, "runs": [None] * job.repeats}
    for r in range(job.repeats):
        for i in live if r % 2 == 0 else reversed(live):
            model, prompts, options = built[i]
            result = generate(model, prompts, job.cells[i].new_tokens, **options)
            figures[i]["runs"][r] = (result.prefill_s, result.decode_s_per_token or 0.0)
    mine = [x for i in live for x in (figures[i]["peak_bytes"], figures[i]["kv_bytes"],
                                      *(t for run in figures[i]["runs"] for t in run))]
    world = AxisComm.world(job.cells[0].timeout_s)
    ranks = world.all_gather(torch.tensor(mine, dtype=torch.float64), label="bench.infer").tolist() if live else []
    rows, width = [], 2 + 2 * job.repeats
    for i, cell in enumerate(job.cells):
        if i not in figures:
            rows.append(aggregate(cell, [{"error": built[i]}]))
            continue
        at = live.index(i) * width
        per_rank = [r[at:at + width] for r in ranks]
        runs = [(max(r[2 + 2 * k] for r in per_rank), max(r[3 + 2 * k] for r in per_rank)) for k in range(job.repeats)]
        rows.append(aggregate(cell, [{"ttft_s": statistics.median(t for t, _ in runs),
                                      "tpot_s": statistics.median(t for _, t in runs), "peak_bytes": int(r[0]),
                                      "kv_bytes": int(r[1]), "schedule": figures[i]["schedule"],
                                      "kv_layout": figures[i]["kv_layout"]} for r in per_rank],
                              runs=runs))
    return rows


def infer_cell_on_rank(cell: InferCell) -> dict:
    """``infer_on_rank`` on every rank, then its figures gathered over the world: the same row on every rank
    (the slowest rank's times, the largest per-rank peak and KV bytes), or the scheme's refusal."""
    import torch

    from ..distributed.comm import AxisComm

    mine = infer_on_rank(cell)
    if "error" in mine:
        return aggregate(cell, [mine])
    numbers = torch.tensor([mine["ttft_s"], mine["tpot_s"] or 0.0, mine["peak_bytes"], mine["kv_bytes"]],
                           dtype=torch.float64)
    rows = AxisComm.world(cell.timeout_s).all_gather(numbers, label="bench.infer").tolist()
    return aggregate(cell, [{"ttft_s": r[0], "tpot_s": r[1], "peak_bytes": int(r[2]), "kv_bytes": int(r[3]),
                             "schedule": mine["schedule"], "kv_layout": mine["kv_layout"]} for r in rows])


def aggregate(cell: InferCell, per_rank: list[dict], runs: list[tuple[float, float]] | None = None) -> dict:
    """One row: the cell's settings, the slowest rank's times, the largest per-rank peak and KV bytes, and the
    analytic model's prediction of the peak and the KV bytes (``torchtsp.analysis``, mode infer, for the KV-cache
    layout the engine used: ``kv_layout``). ``runs``:
    (TTFT, TPOT) of each interleaved run (the times are then their medians), kept with their ranges."""
    from ..analysis import predict_memory
    from ..config import ModelConfig
    from ..layout import Layout

    row = {k: v for k, v in asdict(cell).items() if k not in ("model", "timeout_s")}
    if "error" in per_rank[0]:
        return {**row, "error": per_rank[0]["error"]}
    cfg = ModelConfig(**{**cell.model, "max_seq_len": max(cell.model.get("max_seq_len", 0),
                                                           cell.prompt_len + cell.new_tokens)})
    used = per_rank[0]["kv_layout"]
    predicted = predict_memory(cell.scheme, cfg, cell.batch, cell.prompt_len, mode="infer", optimizer=None,
                               new_tokens=cell.new_tokens, schedule=cell.schedule, prefill_chunk=cell.prefill_chunk,
                               kv_layout=used if has_kv_layouts(cell.scheme) else "auto",
                               **Layout.resolve(cell.scheme, cell.world).sizes)
    peak = max(r["peak_bytes"] for r in per_rank)
    return {**row, "ttft_s": max(r["ttft_s"] for r in per_rank),
            "tpot_s": max(r["tpot_s"] or 0.0 for r in per_rank),
            "peak_bytes_per_rank": peak, "kv_bytes_per_rank": max(r["kv_bytes"] for r in per_rank),
            **({} if runs is None else {"ttft_runs_s": [t for t, _ in runs], "tpot_runs_s": [t for _, t in runs],
                                        "tpot_range_s": [min(t for _, t in runs), max(t for _, t in runs)]}),
            "predicted_peak_bytes": predicted and predicted.total,
            "predicted_kv_bytes": predicted and predicted.kv_cache,
            "peak_error_pct": predicted and 100.0 * (predicted.total - peak) / peak,
            "schedule": per_rank[0]["schedule"], "kv_layout": used}


def run_infer_bench(model: dict, world: int, prompt_lens, run, schemes=INFER_SCHEMES, new_tokens: int = 32,
                    batch: int = 1, repeats: int = 3, progress=None, kv_layout: str = "auto",
                    **cell_options) -> list[dict]:
    """Every scheme at every prompt length on ``world`` ranks: per prompt length the schemes are built side by side
    and timed interleaved, ``repeats`` runs each (``interleaved_on_rank``); rows carry the medians, every run and
    the TPOT range, and the TSP row its per-run TPOT ratio to TP (``tpot_vs_tp``). ``run(fn, job)`` runs
    ``fn(job)`` on every rank and returns rank 0's result (``bench.run``'s runner, or a ``WorkerPool``'s
    ``run`` taking rank 0). ``kv_layout``: the tsp rows' KV-cache layout (the other schemes keep their own); every
    row carries the layout its engine used."""
    rows = []
    for prompt_len in prompt_lens:
        cells = tuple(InferCell(scheme, world, model, prompt_len, new_tokens, batch, **cell_options,
                                kv_layout=kv_layout if has_kv_layouts(scheme) else "auto") for scheme in schemes)
        found = run(interleaved_on_rank, InferRound(cells, repeats))
        by = {r["scheme"]: r for r in found if "error" not in r}
        for name, row in by.items():  # TSP against TP: the baseline its registry entry names
            base = SCHEMES[name].decode_baseline
            ratios = [a / b for a, b in zip(row["tpot_runs_s"], by[base]["tpot_runs_s"]) if b > 0] if base in by else []
            if ratios:  # run k of both was timed back to back: a like-for-like pair
                row[f"tpot_vs_{base}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                          "max": max(ratios), "runs": ratios}
        rows.extend(found)
        if progress:
            progress(",".join(schemes), prompt_len)
    return rows


def max_context_under(model: dict, world: int, budget_bytes: int, run, schemes=INFER_SCHEMES, new_tokens: int = 32,
                      batch: int = 1, start: int = 256, limit: int = 1 << 20, progress=None, kv_layout: str = "auto",
                      **cell_options) -> dict:
    """Per scheme, the longest prompt (a multiple of ``start``) whose per-rank peak stays within the budget
    while prefilling it and decoding ``new_tokens``: doubling, then bisection. None if even ``start`` fails.
    ``kv_layout``: tsp's KV-cache layout."""
    found = {}

    def fits(scheme, prompt_len):
        row = run(infer_cell_on_rank, InferCell(scheme, world, model, prompt_len, new_tokens, batch, **cell_options,
                                                kv_layout=kv_layout if has_kv_layouts(scheme) else "auto"))
        if progress:
            progress(scheme, prompt_len)
        return "error" not in row and row["peak_bytes_per_rank"] <= budget_bytes

    for scheme in schemes:
        if not fits(scheme, start):
            found[scheme] = None
            continue
        good, bad = start, None
        while bad is None and good * 2 <= limit:
            if fits(scheme, good * 2):
                good *= 2
            else:
                bad = good * 2
        while bad is not None and bad - good > start:
            mid = (good + bad) // 2 // start * start
            good, bad = (mid, bad) if fits(scheme, mid) else (good, mid)
        found[scheme] = good
    return found


def tpot_text(r: dict) -> str:
    """A row's TPOT in ms: the median, with the range over the interleaved runs when there were several."""
    text = f"{r['tpot_s'] * 1e3:.2f}"
    low, high = r.get("tpot_range_s") or (None, None)
    if low is not None and len(r.get("tpot_runs_s", ())) > 1:
        text += f" [{low * 1e3:.2f}-{high * 1e3:.2f}]"
    return text


def ratio_text(r: dict) -> str:
    """TSP's TPOT over TP's: the median per-run ratio and its range (empty for other rows)."""
    ratio = r.get("tpot_vs_tp")
    return "" if not ratio else f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"


def format_infer_table(rows: list[dict]) -> str:
    """A plain-text table of ``run_infer_bench`` rows (TPOT: median [range] over the interleaved runs)."""
    lines = [f"{'prompt':>7} {'scheme':<6} {'TTFT ms':>9} {'TPOT ms [range]':>22} {'peak MiB/rank':>14} "
             f"{'KV MiB/rank':>12}  {'TPOT/TP [range]':<18} {'KV layout':<9} schedule"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['prompt_len']:>7} {r['scheme']:<6}  {r['error']}")
            continue
        sched = "/".join(dict.fromkeys(r["schedule"].values()))
        lines.append(f"{r['prompt_len']:>7} {r['scheme']:<6} {r['ttft_s'] * 1e3:>9.1f} {tpot_text(r):>22} "
                     f"{r['peak_bytes_per_rank'] / 2**20:>14.2f} {r['kv_bytes_per_rank'] / 2**20:>12.3f}  "
                     f"{ratio_text(r):<18} {r.get('kv_layout', ''):<9} {sched}")
    return "\n".join(lines)
