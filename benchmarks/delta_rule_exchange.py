"""Bytes one TSP rank receives for one linear-attention (Gated DeltaNet) layer's state exchange, against the K/V
a full-attention layer of the same model receives, per sequence length (issue #60's exchange figure, counted from
the tensors, not measured on a wire).

Linear layer: every rank all-gathers the 2D zigzag chunks' summaries (A [B, Hv, dk, dk] and B [B, Hv, dk, dv],
float32: the state is accumulated in float32), and receives the 2D - 2 it does not compute; the backward
all-gathers the 2D chunks' G_c ([B, Hv, dk, dv], float32) the same way. Full layer: every rank all-gathers K and
V ([B, S/D, n_kv, head_dim] each, in ``--kv-dtype``) from the D - 1 others; the backward sends the same bytes of
dK/dV back. The summaries are built here by ``delta_rule.span_summary`` on one chunk of S/2D random tokens and the
K/V as tensors of their shape, and each count is their ``numel() * element_size()``. Defaults: Qwen3.5's text
config (linear layers: 16 key heads, 32 value heads, dk = dv = 128; full layers: 4 KV heads of 256).

    PYTHONPATH=src python benchmarks/delta_rule_exchange.py --world 4 --seq-lens 2048 8192
"""

from __future__ import annotations

import argparse

import torch

from torchtsp.delta_rule import span_summary


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def linear_layer_bytes(seq_len: int, world: int, batch: int, key_heads: int, value_heads: int, dk: int,
                       dv: int) -> tuple[int, int]:
    """(forward, backward) bytes a rank receives: the summaries, then the G_c, of the 2D - 2 chunks it does not
    hold. One chunk's summary is computed for real (every chunk's has its shape)."""
    tokens = seq_len // (2 * world)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch, tokens, key_heads, dk, generator=gen)
    v = torch.randn(batch, tokens, value_heads, dv, generator=gen)
    g = -torch.rand(batch, tokens, value_heads, generator=gen)
    beta = torch.rand(batch, tokens, value_heads, generator=gen)
    summary = span_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    state_grad = torch.zeros_like(summary.B)  # G_c: the gradient of a chunk's outputs w.r.t. its incoming state
    others = 2 * world - 2
    return others * nbytes(*summary), others * nbytes(state_grad)


def full_layer_bytes(seq_len: int, world: int, batch: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> int:
    """Bytes of K and V a rank receives from the D - 1 others (the same again as dK/dV in the backward)."""
    shard = torch.empty(batch, seq_len // world, kv_heads, head_dim, dtype=dtype)
    return (world - 1) * nbytes(shard, shard)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="D, the TSP axis")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--linear-key-heads", type=int, default=16)
    parser.add_argument("--linear-value-heads", type=int, default=32)
    parser.add_argument("--linear-key-dim", type=int, default=128)
    parser.add_argument("--linear-value-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=4, help="the full-attention layer's KV heads")
    parser.add_argument("--head-dim", type=int, default=256, help="the full-attention layer's head dim")
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.kv_dtype)
    mib = 2 ** 20
    print(f"D = {args.world}, B = {args.batch}; linear: {args.linear_key_heads} key / {args.linear_value_heads} "
          f"value heads, dk = {args.linear_key_dim}, dv = {args.linear_value_dim} (float32 summaries); full: "
          f"{args.kv_heads} KV heads of {args.head_dim} ({args.kv_dtype} K/V)")
    print(f"{'S':>7} | {'linear fwd (summaries)':>22} | {'linear bwd (G_c)':>16} | {'full fwd (K/V)':>14} | "
          f"{'full / linear fwd':>17}")
    for seq_len in args.seq_lens:
        if seq_len % (2 * args.world):
            parser.error(f"--seq-lens {seq_len} must be a multiple of 2*D = {2 * args.world}")
        fwd, bwd = linear_layer_bytes(seq_len, args.world, args.batch, args.linear_key_heads,
                                      args.linear_value_heads, args.linear_key_dim, args.linear_value_dim)
        kv = full_layer_bytes(seq_len, args.world, args.batch, args.kv_heads, args.head_dim, dtype)
        print(f"{seq_len:>7} | {fwd / mib:>18.2f} MiB | {bwd / mib:>12.2f} MiB | {kv / mib:>10.2f} MiB | "
              f"{kv / fwd:>17.2f}")


if __name__ == "__main__":
    main()
