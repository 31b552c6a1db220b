"""Peak memory and step time of each recompute policy (none, full, selective) for TSP and TP on CPU ranks: the
policies of one scheme are timed interleaved step by step in one process pool (the order rotates), so the noise of
a shared machine falls on all of them alike; each rank's peak is the live tensor bytes of one forward + backward
(``torchtsp.memory.measure_peak``), beside ``predict_memory``'s prediction of it.

    PYTHONPATH=src python benchmarks/recompute_policies.py --preset tiny --seq-len 2048 --ranks 4 --steps 6
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import torchtsp
from torchtsp.analysis import predict_memory
from torchtsp.distributed import WorkerPool
from torchtsp.distributed import comm as comm_module
from torchtsp.memory import measure_peak
from torchtsp.recompute import POLICIES


def timed_step(model, tokens, labels) -> tuple[float, float]:
    """(wall seconds of the step, ended by the slowest rank; this rank's own CPU seconds in it, which a shared
    machine's other load disturbs less than the wall clock)."""
    for p in model.parameters():
        p.grad = None
    comm_module.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    model.loss(tokens, labels).backward()
    cpu = time.process_time() - cpu
    comm_module.barrier()  # the step ends when the slowest rank ends
    return time.perf_counter() - start, cpu


def on_rank(scheme, world, preset, batch, seq_len, steps, policies):
    torch.manual_seed(0)
    cfg = torchtsp.get_preset(preset).replace(max_seq_len=seq_len)
    ref = torchtsp.Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g) for _ in range(2))
    mesh = torchtsp.init_mesh(**{scheme: world})
    models = {p: torchtsp.parallelize(copy.deepcopy(ref), mesh, scheme, recompute=p) for p in policies}
    peaks = {}
    for p, model in models.items():
        timed_step(model, tokens, labels)  # warm-up
        for q in model.parameters():
            q.grad = None
        peaks[p] = measure_peak(lambda m=model: m.loss(tokens, labels).backward(), model)[1]
    times, cpus = {p: [] for p in policies}, {p: [] for p in policies}
    for step in range(steps):
        order = policies[step % len(policies):] + policies[:step % len(policies)]
        for p in order:
            wall, cpu = timed_step(models[p], tokens, labels)
            times[p].append(wall)
            cpus[p].append(cpu)
    pruned = models[policies[0]].traffic_seq_rank() is not None
    predicted = {p: predict_memory(scheme, cfg, batch, seq_len, optimizer=None, recompute=p, pruned_kv=pruned,
                                   **{scheme: world}).total for p in policies}
    return {p: {"peak_bytes": peaks[p], "predicted_bytes": predicted[p], "median_s": statistics.median(times[p]),
                "times_s": times[p], "cpu_s": statistics.median(cpus[p])} for p in policies}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)  # a multiple of 3: each policy first equally often
    parser.add_argument("--schemes", default="tsp,tp")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    policies = args.policies.split(",")
    out = {}
    with WorkerPool(args.ranks, timeout_s=3600) as pool:
        for scheme in args.schemes.split(","):
            ranks = pool.run(on_rank, scheme, args.ranks, args.preset, args.batch, args.seq_len, args.steps,
                             policies)
            out[scheme] = {p: {"peak_mib": max(r[p]["peak_bytes"] for r in ranks) / 2**20,
                               "predicted_mib": max(r[p]["predicted_bytes"] for r in ranks) / 2**20,
                               "step_ms": 1e3 * ranks[0][p]["median_s"],
                               "cpu_ms_per_rank": 1e3 * statistics.mean(r[p]["cpu_s"] for r in ranks),
                               "steps_ms": [round(1e3 * t, 1) for t in ranks[0][p]["times_s"]]} for p in policies}
            print(json.dumps({scheme: out[scheme]}), flush=True)  # each scheme as it ends
    print(json.dumps({"args": vars(args), "results": out}, indent=1))


if __name__ == "__main__":
    main()
