"""Decode time per output token, TSP vs TP, interleaved step by step on the same ranks; plus each scheme's KV-cache
bytes per rank. Bench model by default (dim 256, 4 layers, 4 heads, ffn 768, vocab 257), CPU ranks over gloo.

Both schemes are built side by side and prefill the same prompts (untimed); then their decode steps alternate
(TSP, TP, TP, TSP, ...), each step timed from a barrier to the next token's ids on every rank (the slowest rank).
A load that comes and goes on a shared host hits both alike. The steps are cut into ``--runs`` consecutive blocks;
per block the ratio of the two medians is one "run", and the table gives the median and range of those ratios
and of each scheme's TPOT.

Also per scheme: the collectives one decode step issues on a rank (embedding, every layer, the token choice), and
the CPU time a rank's process uses per step (its gloo threads included): where the ranks share the host's cores,
that CPU time, not the bytes, sets the step.

    PYTHONPATH=src python benchmarks/decode_ab.py --batch 4 --prompt 2048 --steps 40 --runs 5
    PYTHONPATH=src python benchmarks/decode_ab.py --batch 4 --prompt 2048 --kv-heads 2
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


def _engine(scheme, cfg, world, batch, prompt, steps):
    """(engine, next ids after the prompt, prompt lengths, token selector) of one scheme, prefilled."""
    from torchtsp.infer.api import make_engine
    from torchtsp.infer.sampling import TokenSelector
    from torchtsp.layout import Layout

    layout = Layout.resolve(scheme, world, cfg=cfg)
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg, device="meta"), torchtsp.init_mesh(layout), layout)
    engine = make_engine(model)
    tokens = torch.randint(cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((batch,), prompt)
    engine.choose_schedule("auto", batch, prompt)
    engine.start(batch, prompt, steps + 1)
    select = TokenSelector(engine.vocab_comm, cfg.vocab_size, engine.vocab_start, batch, slice(0, batch), 0.0,
                           None, None, 0, engine.device)
    with torch.inference_mode():
        ids = select(engine.prefill(tokens, lengths, prompt))
    return engine, ids, lengths, select


def on_rank(schemes, cfg_fields, batch, prompt, steps):
    cfg = torchtsp.ModelConfig(**cfg_fields)
    world = comm_module.world_size()
    built = {s: _engine(s, cfg, world, batch, prompt, steps) for s in schemes}
    ids = {s: built[s][1] for s in schemes}
    times, cpu, calls = ({s: [] for s in schemes} for _ in range(3))
    with torch.inference_mode():
        for t in range(steps):
            for s in schemes if t % 2 == 0 else reversed(schemes):
                engine, _, lengths, select = built[s]
                comm_module.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                with engine.comm.counting() as stats:
                    ids[s] = select(engine.decode(ids[s], lengths + t, t))
                cpu[s].append(time.process_time() - start_cpu)
                comm_module.barrier()
                times[s].append(time.perf_counter() - start)
                calls[s].append(sum(stats.calls.values()))
    return {"times": times, "cpu": cpu, "collectives": {s: max(calls[s]) for s in schemes},
            "kv_bytes": {s: built[s][0].kv_cache_bytes for s in schemes},
            "tokens": {s: ids[s].tolist() for s in schemes}}


def summarise(result, runs):
    a, b = result["schemes"]
    steps = len(result["times"][a])
    per = steps // runs
    blocks = [slice(k * per, (k + 1) * per) for k in range(runs)]
    med = {s: [statistics.median(result["times"][s][blk]) for blk in blocks] for s in (a, b)}
    ratios = [x / y for x, y in zip(med[a], med[b])]
    return {"tpot_ms": {s: {"median": 1e3 * statistics.median(med[s]), "min": 1e3 * min(med[s]),
                            "max": 1e3 * max(med[s])} for s in (a, b)},
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": ratios}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40, help="decode steps per scheme (interleaved)")
    parser.add_argument("--runs", type=int, default=5, help="blocks of consecutive steps, one ratio each")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--schemes", default="tsp,tp")
    parser.add_argument("--json", help="write the raw times and the summary here")
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    cfg = dict(BENCH_MODEL, n_kv_heads=args.kv_heads, max_seq_len=args.prompt + args.steps + 1)
    with WorkerPool(args.ranks, timeout_s=1200) as pool:
        per_rank = pool.run(on_rank, schemes, cfg, args.batch, args.prompt, args.steps)
    times = {s: [max(r["times"][s][t] for r in per_rank) for t in range(args.steps)] for s in schemes}
    cpu_ms = {s: [1e3 * statistics.median(r["cpu"][s]) for r in per_rank] for s in schemes}  # per rank
    result = {**vars(args), "schemes": schemes, "times": times, "kv_bytes": per_rank[0]["kv_bytes"],
              "cpu_ms_per_step": cpu_ms, "collectives_per_step": per_rank[0]["collectives"],
              "same_tokens": per_rank[0]["tokens"][schemes[0]] == per_rank[0]["tokens"][schemes[-1]]}
    result["summary"] = summarise(result, args.runs)
    s = result["summary"]
    print(f"B={args.batch} prompt={args.prompt} kv_heads={args.kv_heads} ranks={args.ranks} steps={args.steps}")
    for name in schemes:
        t = s["tpot_ms"][name]
        print(f"  {name}: TPOT {t['median']:.2f} ms [{t['min']:.2f}-{t['max']:.2f}] over {args.runs} blocks, "
              f"KV {result['kv_bytes'][name] / 2**20:.3f} MiB/rank, {result['collectives_per_step'][name]} "
              f"collectives/step, CPU/step per rank {', '.join(f'{c:.1f}' for c in cpu_ms[name])} ms")
    r = s["ratio"]
    print(f"  {schemes[0]}/{schemes[1]} TPOT: median {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]; "
          f"same greedy tokens: {result['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
