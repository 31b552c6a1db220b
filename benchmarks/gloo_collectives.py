"""CPU time per rank of each collective torchtsp issues, as gloo runs it and as point-to-point transfers
(``torchtsp.distributed.comm``'s choice on gloo for all but all_reduce), at the sizes of the TSP step-time
benchmark (bench model, B = 4, S = 2048, D = 4, float32): one rank's K/V of one head group (1 MiB), a
layer's attention shard (256 KiB), a norm weight's gradient (1 KiB), TP's activation all-reduce (8 MiB).

On a host whose cores the ranks share, a transfer's CPU time is step time. Each cell is the mean over 40
calls of the CPU seconds this process used (its gloo threads included), averaged over ranks, and the wall
time of one call.

    PYTHONPATH=src python benchmarks/gloo_collectives.py --ranks 4 \
        --out benchmarks/results/cpu-4ranks/gloo_collectives.md
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import torchtsp
from torchtsp.distributed import WorkerPool
from torchtsp.distributed import comm as comm_module
from torchtsp.distributed.comm import AxisComm

KIB = 256  # float32 elements per KiB


def cases(comm: AxisComm):
    """(name, call) pairs: every call builds its inputs, issues one operation and waits for it."""
    D = comm.size
    kv, shard, norm, activation = torch.ones(1024 * KIB), torch.ones(256 * KIB), torch.ones(KIB), torch.ones(8192 * KIB)
    return [
        ("all_gather 1 MiB", lambda: comm.all_gather(kv)),
        ("reduce_scatter 1 MiB", lambda: comm.reduce_scatter(torch.ones(D, 1024 * KIB))),
        ("broadcast 256 KiB", lambda: comm.broadcast(shard, src=0)),
        ("reduce 256 KiB", lambda: comm.reduce(shard.clone(), dst=0)),
        ("all_reduce 1 KiB (gloo's ring either way)", lambda: comm.all_reduce(norm.clone())),
        ("all_reduce 8 MiB (gloo's ring either way)", lambda: comm.all_reduce(activation)),
    ]


def on_rank(world: int, calls: int):
    mesh = torchtsp.init_mesh(tsp=world)
    group = mesh.get_group("tsp")
    results = {}
    for way, p2p in (("gloo", False), ("point-to-point", True)):
        comm = AxisComm(group, "tsp", point_to_point=p2p)
        for name, call in cases(comm):
            for _ in range(3):
                call()
            comm_module.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(calls):
                call()
            comm_module.barrier()
            results[name, way] = ((time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out", help="write the table (markdown) here too")
    args = parser.parse_args()
    with WorkerPool(args.ranks, timeout_s=600) as pool:
        per_rank = pool.run(on_rank, args.ranks, args.calls)
    lines = [f"CPU ms per call and rank (wall ms of one call), {args.ranks} ranks, gloo on loopback, "
             f"torch {torch.__version__}.", "", "| operation | gloo | point-to-point | ratio |", "|---|---:|---:|---:|"]
    for name in dict.fromkeys(name for name, _ in per_rank[0]):
        cpu = {way: 1e3 * sum(r[name, way][0] for r in per_rank) / len(per_rank) for way in ("gloo", "point-to-point")}
        wall = {way: 1e3 * per_rank[0][name, way][1] for way in ("gloo", "point-to-point")}
        lines.append(f"| {name} | {cpu['gloo']:.2f} ({wall['gloo']:.1f}) | {cpu['point-to-point']:.2f} "
                     f"({wall['point-to-point']:.1f}) | {cpu['gloo'] / cpu['point-to-point']:.2f} |")
    lines += ["", "The all_reduce rows run the same gloo ring in both columns: their difference is the noise of this "
              "measurement on this machine."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# gloo collectives vs point-to-point transfers\n\n`python {' '.join(sys.argv)}`\n\n{table}\n")


if __name__ == "__main__":
    main()
