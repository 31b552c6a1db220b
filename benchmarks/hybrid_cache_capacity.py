"""How many sequences the paged serving cache holds at once, hybrid block groups against one full group, in the
same ``--kv-cache-mb``, for sequences of a quarter, a half and all of ``--max-model-len`` tokens (issue #44 item 5's
capacity goal: >= 3x at max length; the shared pool's: >= 3x at half, >= 2.5x at a quarter).

The model is a toy of ``--layers`` layers, all sliding (window ``--window``) but ``--global-layers`` full ones (by
default 5 local layers of W = 64 and 1 global), against the same model with every layer full. Each pool is sized
as ``torchtsp serve`` sizes it on a rank (``worker.pool_sizing``: as many pages as the budget holds, shared by every
block group; the real ``KVPool`` is built and its bytes checked against the budget), then rank 0's real
``KVBlockManager`` is filled: sequence after sequence, each computed from position 0 to its last in prefill chunks of
``--chunk`` tokens (freeing its sliding blocks as the scheduler does before each chunk), until the next one no longer
reaches its last position. Prints both counts and their ratio per length (torch on the CPU; seconds).

    PYTHONPATH=src python benchmarks/hybrid_cache_capacity.py --kv-cache-mb 64 --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json

import torch

import torchtsp
from torchtsp.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from torchtsp.infer import make_engine
from torchtsp.serve.blocks import KVBlockManager
from torchtsp.serve.worker import pool_sizing


def sequences_held(manager: KVBlockManager, seq_len: int, chunk: int) -> int:
    """Sequences of ``seq_len`` positions computed one after another, all kept, until one does not fit."""
    chunk = min(chunk, manager.max_chunk_tokens(seq_len) or chunk)
    held = 0
    while True:
        seq, first = held, min(chunk, seq_len)
        if manager.allocate(seq, [seq + 1] * seq_len, first, use_cache=False) is None:
            return held
        computed = first
        while computed < seq_len:
            manager.free_out_of_window(seq, computed)  # as PagedScheduler does before each step
            n = min(chunk, seq_len - computed)
            if not manager.append_slots(seq, n):
                return held  # the half-computed one does not count
            computed += n
        manager.free_out_of_window(seq, computed)  # its next query (a decode) sees only its window
        held += 1


LENGTH_SHARES = (0.25, 0.5, 1.0)  # sequence lengths measured, as shares of --max-model-len


def measure(cfg: ModelConfig, budget: int, block_size: int, max_model_len: int, chunk: int,
            lengths: tuple[int, ...] | None = None) -> dict:
    """The pool ``torchtsp serve`` sizes for ``max_model_len`` in ``budget`` bytes, and how many sequences of each of
    ``lengths`` (default ``max_model_len``) positions it holds at once (a fresh pool per length)."""
    engine = make_engine(torchtsp.Transformer(cfg).eval())
    sizing = pool_sizing(cfg, engine, block_size, budget)
    sizing.check()
    pool = engine.kv_pool(sizing.pages, block_size, grouped=True)
    assert pool.nbytes <= budget, (pool.nbytes, budget)
    held = {}
    for n in lengths or (max_model_len,):
        manager = KVBlockManager(sizing.pages, pool.block_tokens, enable_prefix_caching=False,
                                 windows=sizing.windows)
        held[n] = sequences_held(manager, n, chunk)
    return {"pages": sizing.pages, "bytes_per_page": sizing.bytes_per_page, "group_size": sizing.group_size,
            "windows": list(sizing.windows), "pool_bytes": pool.nbytes, "sequences": held}


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
    lengths = tuple(int(args.max_model_len * share) for share in LENGTH_SHARES)
    full = measure(ModelConfig(**base), budget, args.block_size, args.max_model_len, args.chunk, lengths)
    hybrid = measure(ModelConfig(**base, layer_types=types, sliding_window=args.window), budget, args.block_size,
                     args.max_model_len, args.chunk, lengths)
    ratios = {n: hybrid["sequences"][n] / max(full["sequences"][n], 1) for n in lengths}
    if args.json:
        print(json.dumps({"full_only": full, "hybrid": hybrid, "ratios": ratios}))
        return
    print(f"{args.layers} layers ({args.layers - args.global_layers} sliding, W = {args.window}), --kv-cache-mb "
          f"{args.kv_cache_mb:g}, --max-model-len {args.max_model_len}, --block-size {args.block_size}, "
          f"chunks of {args.chunk}")
    for name, got in (("full-only cache", full), ("hybrid cache", hybrid)):
        groups = ", ".join("full" if w is None else f"W={w}" for w in got["windows"])
        print(f"  {name}: {got['pages']} pages of {got['group_size']} layers shared by {len(got['windows'])} "
              f"groups ({groups}); {got['pool_bytes'] / 2**20:.2f} MiB")
    for n in lengths:
        print(f"  sequences of {n:5d} tokens: full-only {full['sequences'][n]:4d}, hybrid {hybrid['sequences'][n]:4d}"
              f"  ratio {ratios[n]:.2f}x")


if __name__ == "__main__":
    main()
