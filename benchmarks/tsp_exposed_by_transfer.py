"""Where TSP's exposed communication goes: the time each rank blocks in ``Pending.wait``, per transfer kind and
label (attention.forward / attention.backward / mlp.forward / mlp.grad ...), as a share of the step (forward +
backward, no optimizer), bench model, CPU ranks over gloo. The waits are timed by wrapping ``Pending.wait`` in
this script only; the library is unchanged.

    PYTHONPATH=src python benchmarks/tsp_exposed_by_transfer.py 4 2048 3     # B S steps
    PYTHONPATH=src python benchmarks/tsp_exposed_by_transfer.py 1 8192 3
"""
from __future__ import annotations

import collections
import sys
import time

import torch

import torchtsp
from torchtsp.distributed import WorkerPool
from torchtsp.distributed import comm as comm_module

BENCH = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=257)


def on_rank(B, S, steps):
    from torchtsp.distributed.comm import axis
    waits = collections.Counter()
    orig = axis.Pending.wait

    def wait(self):
        done = self._done
        t = time.perf_counter()
        r = orig(self)
        if not done:
            lab = self._label[0] if isinstance(self._label, tuple) else self._label
            waits[f"{self._op}:{lab}"] += time.perf_counter() - t
        return r
    axis.Pending.wait = wait
    torch.manual_seed(0)
    cfg = torchtsp.ModelConfig(**BENCH, max_seq_len=S)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(tsp=4), "tsp")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (B, S), generator=g)
    labels = torch.randint(0, 257, (B, S), generator=g)
    total = 0.0
    for k in range(steps + 1):
        if k == 1:
            waits.clear()
            total = 0.0
        for p in model.parameters():
            p.grad = None
        comm_module.barrier()
        t = time.perf_counter()
        model.loss(tokens, labels).backward()
        total += time.perf_counter() - t
    return total / steps, {k: v / steps for k, v in waits.items()}


if __name__ == "__main__":
    B, S, steps = map(int, sys.argv[1:4])
    with WorkerPool(4, timeout_s=3600) as pool:
        res = pool.run(on_rank, B, S, steps)
    for r, (t, w) in enumerate(res):
        tot = sum(w.values())
        top = sorted(w.items(), key=lambda kv: -kv[1])[:6]
        print(f"rank {r}: step {t:.2f}s exposed {tot / t:.1%}: " + ", ".join(f"{k} {v / t:.1%}" for k, v in top))
