"""Decode time per output token, TSP (one engine per KV-cache layout) vs TP, interleaved step by step on the same
ranks; plus, per engine, its KV-cache bytes, decode and prefill peaks per rank, prefill time and the collectives and
bytes of a decode step against the analytic model. Bench model by default (dim 256, 4 layers, 4 heads, ffn 768,
vocab 257), CPU ranks over gloo.

Every engine (TP, and TSP with each layout of ``--kv-layouts``, by default every layout the model allows on these
ranks: ``kv_layouts.allowed_kv_layouts``) is built side by side. Each prefills the same prompts twice, from a fresh
cache each time: under the live-tensor tracker (prefill peak: weights, cache and working set), then timed (TTFT, from
a barrier to the first token's ids on every rank). One decode step runs under the tracker (decode peak: that step's
working set on top of the weights, plus the whole cache), counting the step's collectives and received bytes
(``Engine.decode``; the token choice adds one all-gather to the collectives) against
``analysis.comm_model.decode_step_traffic``. Then the engines' decode steps alternate (A B C, C B A, ...), each timed
from a barrier to the next token's ids on every rank (the slowest rank): a load that comes and goes on a shared host
hits them alike. The steps are cut into ``--runs`` consecutive blocks; per block the ratio of a TSP layout's median
to TP's is one "run", and the table gives the median and range of those ratios and of each engine's TPOT.

The default run is small (prompt 256, 20 steps). The goal configurations of issue 35 (4 ranks, 4 prompts of 2048,
median of 5 blocks; heads: TSP/TP <= 1.05 at B = 1, 4 and 16; grouped: <= 1.20 with half TP's KV bytes per rank):

    PYTHONPATH=src python benchmarks/decode_ab.py --batch 4 --prompt 2048 --steps 40 --runs 5 --kv-heads 4
    PYTHONPATH=src python benchmarks/decode_ab.py --batch 1 --prompt 2048 --steps 40 --runs 5 --kv-heads 4
    PYTHONPATH=src python benchmarks/decode_ab.py --batch 16 --prompt 2048 --steps 20 --runs 5 --kv-heads 4
    PYTHONPATH=src python benchmarks/decode_ab.py --batch 4 --prompt 2048 --steps 40 --runs 5 --kv-heads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torchtsp
from torchtsp.distributed import WorkerPool
from torchtsp.distributed import comm as comm_module

BENCH_MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=257)
BASELINE = "tp"


def _build(kind: str, cfg, world: int):
    """(model, engine) of one kind: "tp", or "tsp:<layout>"."""
    from torchtsp.infer.api import make_engine
    from torchtsp.layout import Layout

    scheme, _, kv_layout = kind.partition(":")
    layout = Layout.resolve(scheme, world, cfg=cfg)
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg, device="meta"), torchtsp.init_mesh(layout), layout)
    return model, make_engine(model, kv_layout or "auto")


def _timed(fn, *args):
    """fn(*args) from a barrier to its result on every rank: (result, seconds, CPU seconds of this process)."""
    comm_module.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    cpu = time.process_time() - start_cpu
    comm_module.barrier()
    return out, time.perf_counter() - start, cpu


def _prepare(kind, cfg, world, batch, prompt, steps):
    """One engine built, prefilled twice (timed; then measured) and one decode step measured and counted."""
    from torchtsp.analysis.comm_model import decode_step_traffic
    from torchtsp.infer.sampling import TokenSelector
    from torchtsp.memory import measure_peak

    model, engine = _build(kind, cfg, world)
    tokens = torch.randint(cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((batch,), prompt)
    engine.choose_schedule("auto", batch, prompt)
    select = TokenSelector(engine.vocab_comm, cfg.vocab_size, engine.vocab_start, batch, slice(0, batch), 0.0,
                           None, None, 0, engine.device)

    def prefill():
        engine.start(batch, prompt, steps + 2)  # the measured step, then the timed ones
        return select(engine.prefill(tokens, lengths, prompt))

    with torch.inference_mode():
        _, prefill_peak = measure_peak(prefill, model)  # also the first calls of the kernels and collectives
        ids, ttft, _ = _timed(prefill)
        with engine.comm.counting() as stats:
            logits, decode_work = measure_peak(lambda: engine.decode(ids, lengths), model)
        with engine.comm.counting() as choice:
            ids = select(logits)
    model_traffic = None
    if engine.schedule["decode"] != "weights":  # the model counts the step with the weights in place
        model_traffic = decode_step_traffic(kind.partition(":")[0], cfg, batch, world, engine.kv_layout, e=4,
                                            point_to_point=engine.comm.point_to_point)
    chosen = sum(choice.calls.values())  # the token choice's all-gather
    figures = {"kv_layout": engine.kv_layout, "schedule": dict(engine.schedule), "ttft_s": ttft,
               "prefill_peak": prefill_peak, "decode_peak": decode_work + engine.kv_cache_bytes,
               "kv_bytes": engine.kv_cache_bytes, "collectives": sum(stats.calls.values()) + chosen,
               "decode_recv": sum(stats.bytes_recv.values()),
               "model_collectives": model_traffic and model_traffic.collectives + chosen,
               "model_recv": model_traffic and model_traffic.recv_bytes}
    return engine, ids, lengths, select, figures


def _step(built, ids, t):
    """Decode step t of one prepared engine: the next ids."""
    engine, _, lengths, select, _ = built
    return select(engine.decode(ids, lengths + t))


def on_rank(kinds, cfg_fields, batch, prompt, steps):
    cfg = torchtsp.ModelConfig(**cfg_fields)
    world = comm_module.world_size()
    built = {k: _prepare(k, cfg, world, batch, prompt, steps) for k in kinds}
    ids = {k: built[k][1] for k in kinds}
    times, cpu = ({k: [] for k in kinds} for _ in range(2))
    with torch.inference_mode():
        for t in range(1, steps + 1):
            for k in kinds if t % 2 else reversed(kinds):
                ids[k], seconds, used = _timed(_step, built[k], ids[k], t)
                times[k].append(seconds)
                cpu[k].append(used)
    return {"times": times, "cpu": cpu, "figures": {k: built[k][4] for k in kinds},
            "tokens": {k: ids[k].tolist() for k in kinds}}


def summarise(times: dict, kinds, runs: int) -> dict:
    """Per kind the TPOT's median and range over the blocks' medians; per TSP kind its per-block ratio to TP."""
    steps = len(times[kinds[0]])
    per = max(steps // runs, 1)
    blocks = [slice(k * per, (k + 1) * per) for k in range(min(runs, steps))]
    med = {k: [statistics.median(times[k][blk]) for blk in blocks] for k in kinds}
    out = {"tpot_ms": {k: {"median": 1e3 * statistics.median(med[k]), "min": 1e3 * min(med[k]),
                           "max": 1e3 * max(med[k])} for k in kinds}, "ratio": {}}
    for k in kinds:
        if k != BASELINE and BASELINE in med:
            ratios = [x / y for x, y in zip(med[k], med[BASELINE])]
            out["ratio"][k] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                               "runs": ratios}
    return out


def _kinds(layouts: str | None, n_kv: int, ranks: int) -> list[str]:
    """TP first, then TSP with each requested layout (default: every layout the model allows on these ranks)."""
    from torchtsp.kv_layouts import allowed_kv_layouts, resolve_kv_layout

    wanted = layouts.split(",") if layouts else list(allowed_kv_layouts(n_kv, ranks))
    return [BASELINE] + [f"tsp:{resolve_kv_layout(w.strip(), n_kv, ranks)}" for w in wanted]


def report(result: dict, args) -> None:
    s, per_rank = result["summary"], result["per_rank_figures"]
    print(f"B={args.batch} prompt={args.prompt} kv_heads={args.kv_heads} ranks={args.ranks} steps={args.steps} "
          f"({args.runs} blocks)")
    print(f"  {'engine':<13} {'TPOT ms [range]':>21} {'TSP/TP [range]':>20} {'KV MiB/rank':>11} "
          f"{'decode peak MiB':>15} {'prefill ms':>10} {'prefill peak MiB':>16} {'coll/step':>9} "
          f"{'bytes/step (model)':>20} {'CPU ms/step/rank':>18}")
    mib = lambda key, k: max(f[k][key] for f in per_rank) / 2**20
    for k in result["kinds"]:
        t, f, r = s["tpot_ms"][k], per_rank[0][k], s["ratio"].get(k)
        ratio = f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]" if r else ""
        model = "" if f["model_recv"] is None else f" ({f['model_recv']})"
        cpu = "-".join(f"{c:.1f}" for c in (min(result["cpu_ms_per_step"][k]), max(result["cpu_ms_per_step"][k])))
        print(f"  {k:<13} {t['median']:>8.2f} [{t['min']:.2f}-{t['max']:.2f}] {ratio:>20} {mib('kv_bytes', k):>11.3f} "
              f"{mib('decode_peak', k):>15.2f} {1e3 * max(f[k]['ttft_s'] for f in per_rank):>10.1f} "
              f"{mib('prefill_peak', k):>16.2f} {f['collectives']:>9} {f['decode_recv']:>10}{model:>10} "
              f"{cpu:>18}")
    print(f"  same greedy tokens: {result['same_tokens']}; bytes/step match the model on every rank: "
          f"{result['bytes_match']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per engine (interleaved)")
    parser.add_argument("--runs", type=int, default=5, help="blocks of consecutive steps, one ratio each")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--kv-layouts", help="comma-separated TSP layouts (heads, grouped, sequence, auto); "
                        "default: every layout the model allows on --ranks ranks")
    parser.add_argument("--json", help="write the raw times and the summary here")
    args = parser.parse_args()
    try:
        kinds = _kinds(args.kv_layouts, args.kv_heads, args.ranks)
    except ValueError as e:  # a layout the model does not allow, before any rank starts
        parser.error(str(e))
    cfg = dict(BENCH_MODEL, n_kv_heads=args.kv_heads, max_seq_len=args.prompt + args.steps + 2)
    with WorkerPool(args.ranks, timeout_s=1200) as pool:
        per_rank = pool.run(on_rank, kinds, cfg, args.batch, args.prompt, args.steps)
    times = {k: [max(r["times"][k][t] for r in per_rank) for t in range(args.steps)] for k in kinds}
    figures = [r["figures"] for r in per_rank]
    tokens = per_rank[0]["tokens"]
    result = {**vars(args), "kinds": kinds, "times": times, "per_rank_figures": figures,
              "cpu_ms_per_step": {k: [1e3 * statistics.median(r["cpu"][k]) for r in per_rank] for k in kinds},
              "same_tokens": all(tokens[k] == tokens[kinds[0]] for k in kinds),
              "bytes_match": all(f[k]["model_recv"] in (None, f[k]["decode_recv"]) for f in figures for k in kinds),
              "summary": summarise(times, kinds, args.runs)}
    report(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
