"""Inference side by side: time to first token, time per output token, per-rank peak memory and KV-cache
bytes of each scheme against prompt length, and the longest prompt each scheme fits in a per-rank budget.

``infer_on_rank`` is what every rank runs for one (scheme, prompt length) cell; ``run_infer_bench`` drives
a pool of local ranks, interleaving the schemes per prompt length so that they see the same machine load.
``torchtsp bench --mode infer`` (bench/run.py) drives them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..schemes import inference_schemes

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
    timeout_s: float = 300.0


def infer_on_rank(cell: InferCell) -> dict:
    """One cell on this rank: build, generate (after one short warm-up), measure. Returns this rank's figures;
    a layout the scheme cannot split gives {"error": ...} on every rank (no communication has started)."""
    import torch

    from ..config import ModelConfig
    from ..distributed.mesh import init_mesh
    from ..infer import generate
    from ..layout import Layout
    from ..memory import measure_peak
    from ..model import Transformer
    from ..parallel import parallelize

    cfg = ModelConfig(**{**cell.model, "max_seq_len": max(cell.model.get("max_seq_len", 0),
                                                           cell.prompt_len + cell.new_tokens)})
    try:
        layout = Layout.resolve(cell.scheme, cell.world, cfg=cfg)
    except ValueError as e:
        return {"error": str(e)}
    mesh = init_mesh(layout, timeout_s=cell.timeout_s)
    torch.manual_seed(cell.seed)
    model = parallelize(Transformer(cfg, device="meta"), mesh, layout, timeout_s=cell.timeout_s)
    g = torch.Generator().manual_seed(cell.seed)
    prompts = torch.randint(cfg.vocab_size, (cell.batch, cell.prompt_len), generator=g).tolist()
    options = dict(schedule=cell.schedule, prefill_chunk=cell.prefill_chunk)
    generate(model, [p[:8] for p in prompts], 2, **options)  # warm-up: first calls of kernels and collectives
    result, peak = measure_peak(lambda: generate(model, prompts, cell.new_tokens, **options), model)
    return {"ttft_s": result.prefill_s, "tpot_s": result.decode_s_per_token, "peak_bytes": peak,
            "kv_bytes": result.kv_cache_bytes, "schedule": result.schedule}


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
                             "schedule": mine["schedule"]} for r in rows])


def aggregate(cell: InferCell, per_rank: list[dict]) -> dict:
    """One row: the cell's settings, the slowest rank's times, the largest per-rank peak and KV bytes, and the
    analytic model's prediction of the peak and the KV bytes (``torchtsp.analysis``, mode infer)."""
    from ..analysis import predict_memory
    from ..config import ModelConfig
    from ..layout import Layout

    row = {k: v for k, v in asdict(cell).items() if k not in ("model", "timeout_s")}
    if "error" in per_rank[0]:
        return {**row, "error": per_rank[0]["error"]}
    cfg = ModelConfig(**{**cell.model, "max_seq_len": max(cell.model.get("max_seq_len", 0),
                                                           cell.prompt_len + cell.new_tokens)})
    predicted = predict_memory(cell.scheme, cfg, cell.batch, cell.prompt_len, mode="infer", optimizer=None,
                               new_tokens=cell.new_tokens, schedule=cell.schedule, prefill_chunk=cell.prefill_chunk,
                               **Layout.resolve(cell.scheme, cell.world).sizes)
    peak = max(r["peak_bytes"] for r in per_rank)
    return {**row, "ttft_s": max(r["ttft_s"] for r in per_rank),
            "tpot_s": max(r["tpot_s"] or 0.0 for r in per_rank),
            "peak_bytes_per_rank": peak, "kv_bytes_per_rank": max(r["kv_bytes"] for r in per_rank),
            "predicted_peak_bytes": predicted and predicted.total,
            "predicted_kv_bytes": predicted and predicted.kv_cache,
            "peak_error_pct": predicted and 100.0 * (predicted.total - peak) / peak,
            "schedule": per_rank[0]["schedule"]}


def run_infer_bench(model: dict, world: int, prompt_lens, run, schemes=INFER_SCHEMES, new_tokens: int = 32,
                    batch: int = 1, repeats: int = 1, progress=None, **cell_options) -> list[dict]:
    """Every scheme at every prompt length on ``world`` ranks, interleaved per prompt length so that every scheme
    sees the same load; the best of ``repeats`` runs. ``run(fn, cell)`` runs ``fn(cell)`` on every rank and
    returns rank 0's result (``bench.run``'s runner, or a ``WorkerPool``'s ``run`` taking rank 0)."""
    rows = []
    for prompt_len in prompt_lens:
        best: dict[str, dict] = {}
        for _ in range(repeats):
            for scheme in schemes:
                row = run(infer_cell_on_rank, InferCell(scheme, world, model, prompt_len, new_tokens, batch,
                                                        **cell_options))
                kept = best.get(scheme)
                if kept is None or ("error" not in row and "error" not in kept
                                    and row["tpot_s"] + row["ttft_s"] < kept["tpot_s"] + kept["ttft_s"]):
                    best[scheme] = row
                if progress:
                    progress(scheme, prompt_len)
        rows.extend(best[s] for s in schemes)
    return rows


def max_context_under(model: dict, world: int, budget_bytes: int, run, schemes=INFER_SCHEMES, new_tokens: int = 32,
                      batch: int = 1, start: int = 256, limit: int = 1 << 20, progress=None,
                      **cell_options) -> dict:
    """Per scheme, the longest prompt (a multiple of ``start``) whose per-rank peak stays within the budget
    while prefilling it and decoding ``new_tokens``: doubling, then bisection. None if even ``start`` fails."""
    found = {}

    def fits(scheme, prompt_len):
        row = run(infer_cell_on_rank, InferCell(scheme, world, model, prompt_len, new_tokens, batch, **cell_options))
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


def format_infer_table(rows: list[dict]) -> str:
    """A plain-text table of ``run_infer_bench`` rows."""
    lines = [f"{'prompt':>7} {'scheme':<6} {'TTFT ms':>9} {'TPOT ms':>9} {'peak MiB/rank':>14} "
             f"{'KV MiB/rank':>12}  schedule"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['prompt_len']:>7} {r['scheme']:<6}  {r['error']}")
            continue
        sched = "/".join(dict.fromkeys(r["schedule"].values()))
        lines.append(f"{r['prompt_len']:>7} {r['scheme']:<6} {r['ttft_s'] * 1e3:>9.1f} {r['tpot_s'] * 1e3:>9.2f} "
                     f"{r['peak_bytes_per_rank'] / 2**20:>14.2f} {r['kv_bytes_per_rank'] / 2**20:>12.3f}  {sched}")
    return "\n".join(lines)
