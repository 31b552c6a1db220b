"""Inference side by side: time to first token, time per output token, per-rank peak memory and KV-cache
bytes of each scheme against prompt length, and the longest prompt each scheme fits in a per-rank budget.

``infer_on_rank`` is what every rank runs for one (scheme, prompt length) cell; ``run_infer_bench`` drives
a pool of local ranks, interleaving the schemes per prompt length so that they see the same machine load.
Wiring into ``torchtsp bench --mode infer`` is left to the command line (bench/run.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

INFER_SCHEMES = ("tsp", "tp", "sp", "dp")


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
    from ..memory import measure_peak
    from ..model import Transformer
    from ..parallel import parallelize
    from ..schemes import get_scheme

    cfg = ModelConfig(**{**cell.model, "max_seq_len": max(cell.model.get("max_seq_len", 0),
                                                           cell.prompt_len + cell.new_tokens)})
    scheme = get_scheme(cell.scheme)
    degrees = scheme.degrees(cell.world)
    try:
        scheme.check_model(cfg, degrees)
    except ValueError as e:
        return {"error": str(e)}
    mesh = init_mesh(**degrees, timeout_s=cell.timeout_s)
    torch.manual_seed(cell.seed)
    model = parallelize(Transformer(cfg, device="meta"), mesh, cell.scheme, timeout_s=cell.timeout_s)
    g = torch.Generator().manual_seed(cell.seed)
    prompts = torch.randint(cfg.vocab_size, (cell.batch, cell.prompt_len), generator=g).tolist()
    options = dict(schedule=cell.schedule, prefill_chunk=cell.prefill_chunk)
    generate(model, [p[:8] for p in prompts], 2, **options)  # warm-up: first calls of kernels and collectives
    result, peak = measure_peak(lambda: generate(model, prompts, cell.new_tokens, **options), model)
    return {"ttft_s": result.prefill_s, "tpot_s": result.decode_s_per_token, "peak_bytes": peak,
            "kv_bytes": result.kv_cache_bytes, "schedule": result.schedule}


def aggregate(cell: InferCell, per_rank: list[dict]) -> dict:
    """One row: the cell's settings, the slowest rank's times, the largest per-rank peak and KV bytes."""
    row = {k: v for k, v in asdict(cell).items() if k not in ("model", "timeout_s")}
    if "error" in per_rank[0]:
        return {**row, "error": per_rank[0]["error"]}
    return {**row, "ttft_s": max(r["ttft_s"] for r in per_rank),
            "tpot_s": max(r["tpot_s"] or 0.0 for r in per_rank),
            "peak_bytes_per_rank": max(r["peak_bytes"] for r in per_rank),
            "kv_bytes_per_rank": max(r["kv_bytes"] for r in per_rank),
            "schedule": per_rank[0]["schedule"]}


def run_infer_bench(model: dict, world: int, prompt_lens, schemes=INFER_SCHEMES, new_tokens: int = 32,
                    batch: int = 1, repeats: int = 1, pool=None, **cell_options) -> list[dict]:
    """Every scheme at every prompt length on ``world`` local ranks, interleaved; the best of ``repeats`` runs."""
    from ..distributed.launch import WorkerPool

    own_pool = pool is None
    pool = pool or WorkerPool(world)
    rows = []
    try:
        for prompt_len in prompt_lens:
            best: dict[str, dict] = {}
            for _ in range(repeats):
                for scheme in schemes:  # interleaved: every scheme sees the same load
                    cell = InferCell(scheme, world, model, prompt_len, new_tokens, batch, **cell_options)
                    row = aggregate(cell, pool.run(infer_on_rank, cell))
                    kept = best.get(scheme)
                    if kept is None or ("error" not in row and row["tpot_s"] + row["ttft_s"]
                                        < kept["tpot_s"] + kept["ttft_s"]):
                        best[scheme] = row
            rows.extend(best[s] for s in schemes)
    finally:
        if own_pool:
            pool.close()
    return rows


def max_context_under(model: dict, world: int, budget_bytes: int, schemes=INFER_SCHEMES, new_tokens: int = 32,
                      batch: int = 1, start: int = 256, limit: int = 1 << 20, pool=None, **cell_options) -> dict:
    """Per scheme, the longest prompt (a multiple of ``start``) whose per-rank peak stays within the budget
    while prefilling it and decoding ``new_tokens``: doubling, then bisection. None if even ``start`` fails."""
    from ..distributed.launch import WorkerPool

    own_pool = pool is None
    pool = pool or WorkerPool(world)
    found = {}

    def fits(scheme, prompt_len):
        cell = InferCell(scheme, world, model, prompt_len, new_tokens, batch, **cell_options)
        row = aggregate(cell, pool.run(infer_on_rank, cell))
        return "error" not in row and row["peak_bytes_per_rank"] <= budget_bytes

    try:
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
    finally:
        if own_pool:
            pool.close()
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
