"""TSP vs TP step time (forward + backward, no optimizer), both activation policies, timed interleaved; and TSP
at D = 1 vs the reference model. Bench model by default (dim 256, 4 layers, 4 heads, 4 KV heads, ffn 768,
vocab 257), CPU ranks over gloo.

    PYTHONPATH=src python benchmarks/tsp_step_time.py --batch 4 --seq-len 2048 --ranks 4 --steps 8
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import torchtsp
from torchtsp.distributed import WorkerPool
from torchtsp.distributed import comm as comm_module

BENCH_MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=257)


def _batch(cfg, batch, seq_len):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g))


def _step(model, tokens, labels):
    for p in model.parameters():
        p.grad = None
    comm_module.barrier()
    start = time.perf_counter()
    model.loss(tokens, labels).backward()
    comm_module.barrier()  # the step ends when the slowest rank ends
    return time.perf_counter() - start


def _rotated(keys: list, step: int) -> list:
    """The timing order of step ``step``: it rotates, so each model follows each other one equally often (a step
    leaves the allocator and the caches in its own state for the next)."""
    return keys[step % len(keys):] + keys[:step % len(keys)]


def parallel_on_rank(world, batch, seq_len, steps, schemes):
    """Step times and exposed-communication fraction of each (scheme, recompute), interleaved step by step."""
    torch.manual_seed(0)
    cfg = torchtsp.ModelConfig(**BENCH_MODEL, max_seq_len=seq_len)
    ref = torchtsp.Transformer(cfg)
    tokens, labels = _batch(cfg, batch, seq_len)
    models = {}
    for scheme, recompute in schemes:
        mesh = torchtsp.init_mesh(**{scheme: world})
        models[scheme, recompute] = torchtsp.parallelize(copy.deepcopy(ref), mesh, scheme, recompute=recompute)
    times = {key: [] for key in models}
    waits = {key: [] for key in models}
    for step in range(steps + 1):  # step 0 warms up
        for key in _rotated(list(models), step):
            model = models[key]
            comm = next(iter(model.comms().values()))
            with comm.counting() as stats:
                t = _step(model, tokens, labels)
            if step:
                times[key].append(t)
                waits[key].append(stats.wait_s / t)
    return {f"{s}{'+recompute' if r else ''}": {"median_s": statistics.median(times[s, r]), "times_s": times[s, r],
                                               "exposed_comm": statistics.median(waits[s, r])} for s, r in models}


def single_on_rank(batch, seq_len, steps):
    """The reference model and TSP at D = 1 (both policies), interleaved."""
    torch.manual_seed(0)
    cfg = torchtsp.ModelConfig(**BENCH_MODEL, max_seq_len=seq_len)
    ref = torchtsp.Transformer(cfg)
    tokens, labels = _batch(cfg, batch, seq_len)
    mesh = torchtsp.init_mesh(tsp=1)
    models = {"reference": ref,
              "tsp_d1": torchtsp.parallelize(copy.deepcopy(ref), mesh, "tsp"),
              "tsp_d1+recompute": torchtsp.parallelize(copy.deepcopy(ref), mesh, "tsp", recompute=True)}
    times = {k: [] for k in models}
    for step in range(steps + 1):
        for k in _rotated(list(models), step):
            t = _step(models[k], tokens, labels)
            if step:
                times[k].append(t)
    return {k: {"median_s": statistics.median(v), "times_s": v} for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)  # a multiple of the 4 models: each order equally often
    parser.add_argument("--skip-single", action="store_true")
    args = parser.parse_args()
    schemes = [("tsp", False), ("tp", False), ("tsp", True), ("tp", True)]
    with WorkerPool(args.ranks, timeout_s=3600) as pool:
        par = pool.run(parallel_on_rank, args.ranks, args.batch, args.seq_len, args.steps, schemes)[0]
    out = {"parallel": par}
    out["tsp/tp"] = par["tsp"]["median_s"] / par["tp"]["median_s"]
    out["tsp/tp recompute"] = par["tsp+recompute"]["median_s"] / par["tp+recompute"]["median_s"]
    if not args.skip_single:
        with WorkerPool(1, timeout_s=3600) as pool:
            single = pool.run(single_on_rank, args.batch, args.seq_len, args.steps)[0]
        out["single"] = single
        out["tsp_d1/reference"] = single["tsp_d1"]["median_s"] / single["reference"]["median_s"]
        out["tsp_d1 recompute/reference"] = single["tsp_d1+recompute"]["median_s"] / single["reference"]["median_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
