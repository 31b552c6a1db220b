"""Step time of ``--compile`` against eager for TSP and TP on CPU ranks, with the time the first compiled step takes.

One model per scheme, one process pool: the switch ``torchtsp.compiled.enable`` is per process and read at each
call, so the same ranks run an eager step and a compiled step in turn (the order alternates pair by pair), and the
noise of a shared machine falls on both alike. Reported per scheme: the first compiled step's wall time (it
compiles every region), then the median over the timed pairs of wall time (ended by the slowest rank) and of each
rank's own CPU time, compiled / eager.

    PYTHONPATH=src python benchmarks/compile_vs_eager.py --seq-lens 2048,8192 --ranks 4 --pairs 4
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from recompute_policies import timed_step  # benchmarks/, this script's folder

import torchtsp
from torchtsp import compiled
from torchtsp.bench.args import BENCH_MODEL
from torchtsp.distributed import WorkerPool


def on_rank(scheme, world, batch, seq_len, pairs):
    torch.manual_seed(0)
    cfg = torchtsp.ModelConfig(**BENCH_MODEL, max_seq_len=seq_len)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g) for _ in range(2))
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(**{scheme: world}), scheme)
    compiled.enable(False)
    timed_step(model, tokens, labels)  # eager warm-up
    compiled.enable(True)
    first_compiled_s, _ = timed_step(model, tokens, labels)  # compiles every region
    timed_step(model, tokens, labels)  # a second compiled step: nothing may compile again
    times = {"eager": [], "compiled": []}
    cpus = {"eager": [], "compiled": []}
    for pair in range(pairs):
        for mode in (("eager", "compiled") if pair % 2 == 0 else ("compiled", "eager")):
            compiled.enable(mode == "compiled")
            wall, cpu = timed_step(model, tokens, labels)
            times[mode].append(wall)
            cpus[mode].append(cpu)
    compiled.enable(False)
    return {"first_compiled_s": first_compiled_s, "times_s": times, "cpu_s": cpus}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--schemes", default="tsp,tp")
    args = parser.parse_args()
    out = []
    with WorkerPool(args.ranks, timeout_s=3600) as pool:
        for seq_len in map(int, args.seq_lens.split(",")):
            for scheme in args.schemes.split(","):
                ranks = pool.run(on_rank, scheme, args.ranks, args.batch, seq_len, args.pairs)
                wall = {m: statistics.median(ranks[0]["times_s"][m]) for m in ("eager", "compiled")}
                cpu = {m: statistics.median(statistics.mean(r["cpu_s"][m][i] for r in ranks)
                                            for i in range(args.pairs)) for m in ("eager", "compiled")}
                row = {"scheme": scheme, "seq_len": seq_len,
                       "first_compiled_step_s": round(max(r["first_compiled_s"] for r in ranks), 1),
                       "eager_ms": round(1e3 * wall["eager"]), "compiled_ms": round(1e3 * wall["compiled"]),
                       "wall_ratio": round(wall["compiled"] / wall["eager"], 3),
                       "eager_cpu_ms": round(1e3 * cpu["eager"]), "compiled_cpu_ms": round(1e3 * cpu["compiled"]),
                       "cpu_ratio": round(cpu["compiled"] / cpu["eager"], 3)}
                print(json.dumps(row), flush=True)  # each cell as it ends
                out.append(row)
    print(json.dumps({"args": vars(args), "results": out}, indent=1))


if __name__ == "__main__":
    main()
