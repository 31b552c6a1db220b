"""How many sequences of ``--max-model-len`` tokens the paged serving cache holds at once, hybrid block groups
against one full group, in the same ``--kv-cache-mb`` (issue #44 item 5's capacity goal: >= 3x).

The model is a toy of ``--layers`` layers, all sliding (window ``--window``) but ``--global-layers`` full ones (by
default 5 local layers of W = 64 and 1 global), against the same model with every layer full. Each pool is sized
as ``torchtsp serve`` sizes it on a rank (``worker.pool_sizing``: a sliding group's null block and one prefill
chunk set aside, the rest split between groups by one max-length decoding sequence's need; the real ``KVPool`` is
built and its bytes checked against the budget), then rank 0's real ``KVBlockManager`` is filled: sequence after
sequence, each computed from position 0 to max_model_len - 1 in prefill chunks of ``--chunk`` tokens (freeing its
sliding blocks as the scheduler does before each chunk), until the next one no longer reaches its last position.
Prints both counts and their ratio (torch on the CPU; seconds).

    PYTHONPATH=src python benchmarks/hybrid_cache_capacity.py --kv-cache-mb 64 --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json

import torch

import torchtsp
from torchtsp.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from torchtsp.infer import make_engine
from torchtsp.serve.blocks import GroupSpec, KVBlockManager
from torchtsp.serve.worker import pool_sizing


def sequences_held(manager: KVBlockManager, max_model_len: int, chunk: int) -> int:
    """Sequences of ``max_model_len`` positions computed one after another, all kept, until one does not fit."""
    chunk = min(chunk, manager.max_chunk_tokens or chunk)
    held = 0
    while True:
        seq, first = held, min(chunk, max_model_len)
        if manager.allocate(seq, [seq + 1] * max_model_len, first, use_cache=False) is None:
            return held
        computed = first
        while computed < max_model_len:
            manager.free_out_of_window(seq, computed)  # as PagedScheduler does before each step
            n = min(chunk, max_model_len - computed)
            if not manager.append_slots(seq, n):
                return held  # the half-computed one does not count
            computed += n
        manager.free_out_of_window(seq, computed)  # its next query (a decode) sees only its window
        held += 1


def measure(cfg: ModelConfig, budget: int, block_size: int, max_model_len: int, chunk: int) -> dict:
    engine = make_engine(torchtsp.Transformer(cfg).eval())
    sizing = pool_sizing(cfg, engine, block_size, budget, max_model_len, chunk)
    sizing.check()
    pool = engine.kv_pool(sizing.blocks, block_size, grouped=True)
    assert pool.nbytes <= budget, (pool.nbytes, budget)
    manager = KVBlockManager([GroupSpec(n, w) for n, w in zip(sizing.blocks, sizing.windows)], pool.block_tokens,
                             enable_prefix_caching=False)
    return {"groups": [{"window": w, "blocks": n, "bytes_per_block": b}
                       for n, w, b in zip(sizing.blocks, sizing.windows, sizing.bytes_per_block)],
            "pool_bytes": pool.nbytes, "sequences": sequences_held(manager, max_model_len, chunk)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-mb", type=float, default=64.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--global-layers", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens of one sequence per step)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    base = dict(dim=256, n_layers=args.layers, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=257,
                max_seq_len=args.max_model_len)
    types = (SLIDING_ATTENTION,) * (args.layers - args.global_layers) + (FULL_ATTENTION,) * args.global_layers
    budget = int(args.kv_cache_mb * 2**20)
    full = measure(ModelConfig(**base), budget, args.block_size, args.max_model_len, args.chunk)
    hybrid = measure(ModelConfig(**base, layer_types=types, sliding_window=args.window), budget, args.block_size,
                     args.max_model_len, args.chunk)
    ratio = hybrid["sequences"] / max(full["sequences"], 1)
    if args.json:
        print(json.dumps({"full_only": full, "hybrid": hybrid, "ratio": ratio}))
        return
    print(f"{args.layers} layers ({args.layers - args.global_layers} sliding, W = {args.window}), --kv-cache-mb "
          f"{args.kv_cache_mb:g}, --max-model-len {args.max_model_len}, --block-size {args.block_size}")
    for name, got in (("full-only cache", full), ("hybrid cache", hybrid)):
        groups = ", ".join(f"{g['blocks']} blocks {'full' if g['window'] is None else 'W=' + str(g['window'])}"
                           for g in got["groups"])
        print(f"  {name:16s} {got['sequences']:4d} sequences of {args.max_model_len} tokens  ({groups}; "
              f"{got['pool_bytes'] / 2**20:.1f} MiB)")
    print(f"  ratio {ratio:.2f}x")


if __name__ == "__main__":
    main()
