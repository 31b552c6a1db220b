"""Causal attention of a local zigzag query shard against the full, gathered keys.

Rank p's queries are two chunks (global chunks p and 2D-1-p). Chunk i attends to all
keys of chunks < i (no mask) and causally to chunk i itself. Each part runs through a
fused attention kernel that returns its log-sum-exp (LSE) and never builds an S x S
score matrix; the parts are merged in float32 through their LSEs. Backward calls the
kernel's backward per part with the *merged* output and LSE, which is exact: the
softmax normaliser of every part is the merged one (as in flash/ring attention).
"""

from __future__ import annotations

import torch

from . import zigzag

KEY_BLOCK = 1024  # keys per block of the portable kernel: bounds its score matrix to [Lq, KEY_BLOCK]


def _block_scores(q, k, a: int, b: int, causal: bool):
    """float32 scaled scores of q against keys [a, b); causal masks key j > query i (square part)."""
    s = (q.float() @ k[..., a:b, :].float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        s = s.masked_fill(torch.arange(a, b, device=q.device)[None, :] > rows, float("-inf"))
    return s


def portable_forward(q, k, v, causal: bool):
    """Flash-style attention in plain PyTorch ops, any device: (out, lse float32), keys in blocks."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for a in range(0, k.shape[-2], KEY_BLOCK):
        b = min(a + KEY_BLOCK, k.shape[-2])
        s = _block_scores(q, k, a, b, causal)
        new_lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
        # Causal rows see key 0 in the first block, so new_lse is finite and no -inf - -inf arises.
        p = torch.exp(s - new_lse.unsqueeze(-1))
        out = out * torch.exp(lse - new_lse).unsqueeze(-1) + p @ v[..., a:b, :].float()
        lse = new_lse
    return out.to(q.dtype), lse


def portable_backward(dout, q, k, v, out, lse, causal: bool):
    """Gradients of ``portable_forward`` given the (merged) output and LSE, keys in blocks."""
    scale = q.shape[-1] ** -0.5
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for a in range(0, k.shape[-2], KEY_BLOCK):
        b = min(a + KEY_BLOCK, k.shape[-2])
        p = torch.exp(_block_scores(q, k, a, b, causal) - lse.unsqueeze(-1))
        dv[..., a:b, :] = p.transpose(-1, -2) @ dout.float()
        ds = p * (dout.float() @ v[..., a:b, :].float().transpose(-1, -2) - delta)
        dq += ds @ k[..., a:b, :].float() * scale
        dk[..., a:b, :] = ds.transpose(-1, -2) @ q.float() * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cuda_forward(q, k, v, causal: bool):
    """PyTorch's fused CUDA kernels that return the LSE: flash for bf16/fp16, memory-efficient for fp32.

    Written against the op schemas of torch 2.13 (``torch.ops.aten.<op>.default._schema``); not yet run
    on a GPU (see README). The efficient kernel pads its LSE to a multiple of 32 queries: sliced off here.
    """
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse[..., : q.shape[-2]]


def _cuda_backward(dout, q, k, v, out, lse, causal: bool):
    Lq, Lk = q.shape[-2], k.shape[-2]
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # read only with dropout > 0
    if q.dtype in (torch.float16, torch.bfloat16):
        # cum_seq_q / cum_seq_k undefined (None): not a nested (variable-length) batch.
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, Lq, Lk, 0.0, causal, no_rng, no_rng)[:3]
    padded = torch.nn.functional.pad(lse, (0, -(-Lq // 32) * 32 - Lq)).contiguous()
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, no_rng, no_rng, 0.0, [True, True, True, False], causal)[:3]


def _flash_forward(q, k, v, causal: bool):
    """(out [B,H,Lq,d], lse [B,H,Lq] float32) for same-head-count q, k, v of layout [B, H, L, d].

    CPU: PyTorch's fused flash kernel; CUDA: the fused SDPA kernels; any other device: the portable
    kernel (exact and memory-bounded, but unfused).
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, causal)
    return portable_forward(q, k, v, causal)


def _flash_backward(dout, q, k, v, out, lse, causal: bool):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if q.device.type == "cuda":
        return _cuda_backward(dout, q, k, v, out, lse, causal)
    return portable_backward(dout, q, k, v, out, lse, causal)


# GQA without expanded K/V: query head h uses KV head h // g, so the query heads i, g+i, 2g+i, ... (a strided
# view q[:, i::g]) pair one to one with the KV heads. The kernel runs once per i on the unexpanded K/V; only
# q-sized outputs are written. (The CPU flash kernel needs equal head counts; this works for every kernel.)


def _gqa_forward(q, k, v, causal: bool):
    g = q.shape[1] // k.shape[1]
    if g == 1:
        return _flash_forward(q, k, v, causal)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i in range(g):
        out[:, i::g], lse[:, i::g] = _flash_forward(q[:, i::g], k, v, causal)
    return out, lse


def _gqa_backward(dout, q, k, v, out, lse, causal: bool, dk, dv, accumulate: bool):
    """dq of this part; dK/dV summed over the g query heads of each KV head into float32 ``dk``, ``dv``
    (added to them with ``accumulate``, else written)."""
    g = q.shape[1] // k.shape[1]
    heads = [slice(None)] if g == 1 else [slice(i, None, g) for i in range(g)]
    dq = torch.empty_like(q) if g > 1 else None
    for i, h in enumerate(heads):
        dq_h, dk_p, dv_p = _flash_backward(dout[:, h], q[:, h], k, v, out[:, h], lse[:, h], causal)
        if accumulate or i:
            dk.add_(dk_p)
            dv.add_(dv_p)
        else:
            dk.copy_(dk_p)
            dv.copy_(dv_p)
        if dq is None:
            return dq_h
        dq[:, h] = dq_h
    return dq


def _key_parts(chunk: int, chunk_len: int):
    """(start, stop, causal) key ranges seen by query chunk ``chunk``."""
    parts = [(0, chunk * chunk_len, False)] if chunk else []
    return parts + [(chunk * chunk_len, (chunk + 1) * chunk_len, True)]


def _merge_into(out, lse, parts):
    """Write the combination of partial attention results (out_i, lse_i) over disjoint key sets into the
    views ``out`` and ``lse``; the weighted sum runs in float32."""
    if len(parts) == 1:
        out.copy_(parts[0][0])
        lse.copy_(parts[0][1])
        return
    torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0, out=lse)
    acc = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    for i, (part_out, part_lse) in enumerate(parts):
        weight = torch.exp(part_lse - lse).unsqueeze(-1)
        if i:
            acc.addcmul_(part_out.float(), weight)
        else:
            torch.mul(part_out, weight, out=acc)
    if acc is not out:
        out.copy_(acc)


def _sum_into(dst, parts):
    """dst = sum of ``parts``, added in float32."""
    if len(parts) == 1 or dst.dtype == torch.float32:
        dst.copy_(parts[0])
        for part in parts[1:]:
            dst.add_(part)
        return
    dst.copy_(torch.stack(parts).sum(0, dtype=torch.float32))


def zigzag_attention_forward(q, k, v, rank: int, world: int):
    """(out, lse float32) of local zigzag queries q [B, Hq, S/D, d] against full keys k, v [B, Hkv, S, d].

    Hkv may divide Hq (GQA): K/V are never expanded. Any strides: with token-major q (memory [B, S/D, Hq, d],
    as projections produce it) ``out`` is token-major too, so merging its heads is a view.
    """
    if world == 1:  # the local tokens are the sequence, in order: one causal call
        return _gqa_forward(q, k, v, True)
    chunk_len = k.shape[-2] // (2 * world)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for local, chunk in enumerate(zigzag.chunk_ids(rank, world)):
        rows = slice(local * chunk_len, (local + 1) * chunk_len)
        parts = [_gqa_forward(q[..., rows, :], k[..., a:b, :], v[..., a:b, :], causal)
                 for a, b, causal in _key_parts(chunk, chunk_len)]
        _merge_into(out[..., rows, :], lse[..., rows], parts)
    return out, lse


def zigzag_attention_backward(dout, q, k, v, out, lse, rank: int, world: int):
    """(dq, dkv) of ``zigzag_attention_forward`` from its (merged) output and LSE. dq is laid out like q;
    dkv [2, B, Hkv, S, d] float32 (memory token-major, [2, B, S, Hkv, d]) holds the key and value
    gradients summed over parts and query heads (they are summed over ranks next)."""
    B, Hkv, S, d = k.shape
    dkv = torch.empty(2, B, S, Hkv, d, dtype=torch.float32, device=k.device).transpose(2, 3)
    if world == 1:
        return _gqa_backward(dout, q, k, v, out, lse, True, dkv[0], dkv[1], accumulate=False), dkv
    chunk_len = S // (2 * world)
    dq = torch.empty_like(q)
    # The late chunk first: its key ranges cover keys [0, (chunk+1)·C), written once; the early chunk's add.
    (early, late) = list(enumerate(zigzag.chunk_ids(rank, world)))
    for local, chunk in (late, early):
        rows = slice(local * chunk_len, (local + 1) * chunk_len)
        q_c, o_c, do_c, lse_c = q[..., rows, :], out[..., rows, :], dout[..., rows, :], lse[..., rows]
        dq_parts = [_gqa_backward(do_c, q_c, k[..., a:b, :], v[..., a:b, :], o_c, lse_c, causal,
                                  dkv[0, ..., a:b, :], dkv[1, ..., a:b, :], accumulate=chunk != late[1])
                    for a, b, causal in _key_parts(chunk, chunk_len)]
        _sum_into(dq[..., rows, :], dq_parts)
        if chunk == late[1]:
            dkv[..., (chunk + 1) * chunk_len:, :].zero_()  # keys after the late chunk: no query here sees them
    return dq, dkv


class ZigzagAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rank: int, world: int):
        out, lse = zigzag_attention_forward(q, k, v, rank, world)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rank, ctx.world = rank, world
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dkv = zigzag_attention_backward(dout, q, k, v, out, lse, ctx.rank, ctx.world)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def zigzag_causal_attention(q, k, v, rank: int, world: int) -> torch.Tensor:
    """q: [B, Hq, S/D, d] local zigzag queries; k, v: [B, Hkv, S, d] full keys in global order."""
    return ZigzagAttention.apply(q, k, v, rank, world)


def gather_kv(comm, kv: torch.Tensor, async_op: bool = False, label="kv"):
    """[2, B, S/D, H, d] K/V of local zigzag tokens (token-major) -> every rank's, in global order:
    [2, B, S, H, d] (one copy after the transfer; none at D = 1).

    With ``async_op`` it returns a function that waits and returns the result, so the caller can
    compute (e.g. the queries) while the gather is in flight.
    """
    if comm.size == 1:
        return (lambda: kv) if async_op else kv
    pending = comm.all_gather(kv, async_op=True, label=label)
    finish = lambda: zigzag.unshard(pending.wait(), dim=2)
    return finish if async_op else finish()


def scatter_kv_grad(comm, dkv_full: torch.Tensor, async_op: bool = False, label="kv.grad"):
    """Inverse of ``gather_kv`` for gradients: each rank receives the sum over ranks for its own tokens.

    ``dkv_full``: [2, B, S, H, d] (token-major, global order) -> [2, B, S/D, H, d]. With ``async_op`` it
    returns the ``Pending`` reduce-scatter.
    """
    per_rank = dkv_full.unsqueeze(0) if comm.size == 1 else zigzag.shard_all(dkv_full, comm.size, dim=2)
    return comm.reduce_scatter(per_rank, async_op=async_op, label=label)


class GatherKV(torch.autograd.Function):
    """``gather_kv`` with its exact backward (reduce-scatter of the K/V gradients to their owners)."""

    @staticmethod
    def forward(ctx, kv, comm):
        ctx.comm = comm
        return gather_kv(comm, kv)

    @staticmethod
    def backward(ctx, dkv_full):
        return scatter_kv_grad(ctx.comm, dkv_full), None
