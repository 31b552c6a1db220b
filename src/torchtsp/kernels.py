"""Attention kernels: (output, log-sum-exp) of queries against keys, for every device.

``fused_attention`` runs a fused kernel that returns the LSE and never builds a score matrix of all queries
against all keys: PyTorch's flash kernel on the CPU, the fused SDPA kernels on CUDA (flash for bf16/fp16,
memory-efficient for fp32), and a portable block-wise kernel on any other device. GQA never expands K/V.
``masked_attention`` handles per-token positions and validity (a KV cache), block by block in float32;
``block_attention`` runs the fused kernel on the visible blocks of packed documents and sliding windows only.
Callers reach both through ``torchtsp.layers.attend``; hand-written backward passes call
``fused_attention_backward`` with the merged output and LSE.
"""

from __future__ import annotations

import torch

from .sizes import KEY_BLOCK  # keys per block: bounds a score matrix to [Lq, KEY_BLOCK]


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
    # The CUDA kernel's LSE has a multiple of 32 rows (padding sliced off in _cuda_forward); ROCm's has Lq
    # (torch's meta rule for the op, pytorch issue 146848): give the backward the length its forward made.
    rows = Lq if torch.version.hip else -(-Lq // 32) * 32
    padded = torch.nn.functional.pad(lse, (0, rows - Lq)).contiguous()
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


def fused_attention(q, k, v, causal: bool):
    """(out, lse float32) of q [B, Hq, Lq, d] (any strides) against k, v [B, Hkv, Lk, d], Hkv dividing Hq."""
    g = q.shape[1] // k.shape[1]
    if g == 1:
        return _flash_forward(q, k, v, causal)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i in range(g):
        out[:, i::g], lse[:, i::g] = _flash_forward(q[:, i::g], k, v, causal)
    return out, lse


def fused_attention_backward(dout, q, k, v, out, lse, causal: bool, dk, dv, accumulate: bool):
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


def masked_attention(q, k, v, q_pos, k_pos, k_valid, window: int | None = None):
    """Attention of queries q [B, Hq, T, d] against keys/values [B, Hkv, N, d] in float32.

    A query at position i sees the valid keys at positions <= i (and > i - window with a window). Returns
    (out [B, Hq, T, d] float32, lse [B, Hq, T] float32); a query that sees no key here gets out = 0,
    lse = -inf, which the merge weighs by exp(-inf) = 0. GQA: query head j uses KV head j // g, without expanding K/V.
    """
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    qf = q.float().reshape(B, Hkv, g * T, d) * d**-0.5
    out = torch.zeros(B, Hkv, g * T, d, dtype=torch.float32, device=q.device)
    run_max = torch.full((B, Hkv, g * T), float("-inf"), dtype=torch.float32, device=q.device)
    run_sum = torch.zeros_like(run_max)
    for a in range(0, k.shape[2], KEY_BLOCK):
        b = min(a + KEY_BLOCK, k.shape[2])
        s = qf @ k[:, :, a:b].float().transpose(-1, -2)  # [B, Hkv, gT, b-a]: the one score-sized buffer
        # The mask is per (query token, key), shared by the g query heads of a KV head: [B, 1, 1, T, b-a].
        hidden = k_pos[:, None, None, None, a:b] > q_pos[:, None, None, :, None]
        hidden |= ~k_valid[:, None, None, None, a:b]  # in place: one mask-sized buffer per block
        if window is not None:  # keys that left a sliding layer's window (the cache still holds them)
            hidden |= k_pos[:, None, None, None, a:b] <= q_pos[:, None, None, :, None] - window
        s.view(B, Hkv, g, T, b - a).masked_fill_(hidden, float("-inf"))
        new_max = torch.maximum(run_max, s.amax(dim=-1))
        # Rows that have seen no key yet keep max = -inf; a finite stand-in avoids -inf - -inf = NaN.
        shift = torch.where(torch.isfinite(new_max), new_max, 0.0)
        p = s.sub_(shift.unsqueeze(-1)).exp_()  # in place: online softmax (flash attention)
        rescale = torch.exp(run_max - shift)
        run_sum = run_sum * rescale + p.sum(dim=-1)
        out = out * rescale.unsqueeze(-1) + p @ v[:, :, a:b].float()
        run_max = new_max
        del s, p, hidden  # before the next block's scores: never two score buffers alive
    seen_any = run_sum > 0
    out = out / torch.where(seen_any, run_sum, 1.0).unsqueeze(-1)
    lse = torch.where(seen_any, torch.where(torch.isfinite(run_max), run_max, 0.0) + run_sum.log(), float("-inf"))
    return out.view(B, Hq, T, d), lse.view(B, Hq, T)


# Blocks (packed documents, sliding windows): each ``layers.Block`` is one kernel call, unmasked where every
# pair is visible, the fused kernel's causal mask on a square diagonal or (rows reversed) on a window's far edge,
# an explicit block-sized mask otherwise (a window cut by a document's start); blocks nobody sees are never
# computed and no mask of all queries x all keys is built.
# (A varlen / windowed kernel would take them in one call; on the CPU there is none.)


def _band(block, device):
    """The [Lq, Lk] visibility of a masked block: lo <= j - i <= hi."""
    nq, nk = block.q.stop - block.q.start, block.k.stop - block.k.start
    offset = torch.arange(nk, device=device)[None, :] - torch.arange(nq, device=device)[:, None]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if block.lo is not None:
        visible &= offset >= block.lo
    if block.hi is not None:
        visible &= offset <= block.hi
    return visible


def _band_scores(q, k, visible):
    """float32 scores [B, Hq, Lq, Lk] of q against k (KV heads expanded: blocks are small), hidden ones -inf."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~visible, float("-inf"))


def band_attention(q, k, v, block):
    """(out in q's dtype, lse float32) of one masked block, in plain differentiable ops; a query that sees no
    key of the block gets out = 0, lse = -inf."""
    s = _band_scores(q, k, _band(block, q.device))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = p @ v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
    return out.to(q.dtype), lse


def band_attention_backward(dout, q, k, v, out, lse, block, dk, dv):
    """dq of one masked block from the merged output and LSE; dK/dV (summed over each KV head's query heads)
    added to float32 ``dk``, ``dv``."""
    g = q.shape[1] // k.shape[1]
    p = torch.exp(_band_scores(q, k, _band(block, q.device)) - lse.unsqueeze(-1))  # 0 where hidden
    dout32 = dout.float()
    delta = (dout32 * out.float()).sum(-1, keepdim=True)
    ds = p * (dout32 @ v.repeat_interleave(g, dim=1).float().transpose(-1, -2) - delta) * q.shape[-1] ** -0.5
    fold = lambda t: t.view(t.shape[0], k.shape[1], g, *t.shape[2:]).sum(2)  # [B, Hq, ...] -> per KV head
    dv.add_(fold(p.transpose(-1, -2) @ dout32))
    dk.add_(fold(ds.transpose(-1, -2) @ q.float()))
    return (ds @ k.repeat_interleave(g, dim=1).float()).to(q.dtype)


# A window's far edge: query row i sees key rows j >= i. With both row orders reversed that is j' <= i', the fused
# kernel's causal square, so the edge runs fused instead of as an explicit block-sized mask (measured on the CPU:
# a 512 x 511 edge's forward and backward in 3.0 ms instead of 6.6 ms). Query rows past the last key see none.


def _reversed_rows(t):
    return t.flip(-2)


def anticausal_attention(q, k, v):
    """(out, lse float32) of an "anticausal" ``layers.Block``: q [B, Hq, Lq, d] against k, v [B, Hkv, Lk, d],
    Lq >= Lk, query i seeing keys j >= i; rows i >= Lk get out = 0, lse = -inf."""
    n = k.shape[-2]
    out, lse = fused_attention(_reversed_rows(q[..., :n, :]), _reversed_rows(k), _reversed_rows(v), True)
    out, lse = _reversed_rows(out), lse.flip(-1)
    if q.shape[-2] == n:
        return out, lse
    full_out = q.new_zeros(q.shape)
    full_lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    full_out[..., :n, :], full_lse[..., :n] = out, lse
    return full_out, full_lse


def anticausal_attention_backward(dout, q, k, v, out, lse, dk, dv):
    """dq of ``anticausal_attention`` from the merged output and LSE; dK/dV added to float32 ``dk``, ``dv``."""
    n = k.shape[-2]
    rows = lambda t: _reversed_rows(t[..., :n, :])
    dk_rev, dv_rev = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    dq_rev = fused_attention_backward(rows(dout), rows(q), _reversed_rows(k), _reversed_rows(v), rows(out),
                                      lse[..., :n].flip(-1), True, dk_rev, dv_rev, accumulate=False)
    dk.add_(_reversed_rows(dk_rev))
    dv.add_(_reversed_rows(dv_rev))
    if q.shape[-2] == n:
        return _reversed_rows(dq_rev)
    dq = q.new_zeros(q.shape)
    dq[..., :n, :] = _reversed_rows(dq_rev)
    return dq


def _run_block(q, k, v, block):
    kind = block.kind
    if kind == "masked":
        return band_attention(q, k, v, block)
    if kind == "anticausal":
        return anticausal_attention(q, k, v)
    return fused_attention(q, k, v, kind == "causal")


def _rows(rows, batch: int):
    """(batch-row slice, blocks) pairs: ``[None, blocks]`` is one list for every row, else one list per row."""
    if rows and rows[0] is None:
        return [(slice(0, batch), rows[1])]
    return [(slice(b, b + 1), blocks) for b, blocks in enumerate(rows)]


def _merge(parts):
    """One (out float32, lse) of partial attentions over disjoint key sets of the same queries."""
    out, lse = parts[0][0].float(), parts[0][1]
    for o, l_ in parts[1:]:
        merged = torch.logaddexp(lse, l_)
        shift = torch.where(torch.isfinite(merged), merged, 0.0)  # a query that saw no key yet: weights 0, not NaN
        out = out * torch.exp(lse - shift).unsqueeze(-1) + o.float() * torch.exp(l_ - shift).unsqueeze(-1)
        lse = merged
    return out, lse


def _row_attention(q, k, v, blocks):
    """(out float32, lse) of the rows of q against k, v on ``blocks`` (grouped by query slice, in order)."""
    n, H, Lq, d = q.shape
    pieces, piece_lses, at, i = [], [], 0, 0
    while i < len(blocks) or at < Lq:
        qs = blocks[i].q if i < len(blocks) else slice(Lq, Lq)
        if qs.start > at:  # queries that see no key in this part
            pieces.append(q.new_zeros(n, H, qs.start - at, d, dtype=torch.float32))
            piece_lses.append(torch.full((n, H, qs.start - at), float("-inf"), dtype=torch.float32, device=q.device))
        if i == len(blocks):
            break
        group = []
        while i < len(blocks) and blocks[i].q == qs:
            group.append(_run_block(q[:, :, qs], k[:, :, blocks[i].k], v[:, :, blocks[i].k], blocks[i]))
            i += 1
        out, lse = _merge(group)
        pieces.append(out)
        piece_lses.append(lse)
        at = qs.stop
    return torch.cat(pieces, dim=2), torch.cat(piece_lses, dim=2)


def block_attention(q, k, v, rows):
    """(out, lse float32) of q [B, Hq, Lq, d] against k, v [B, Hkv, Lk, d] on the ``layers.Block``s of each row
    (``layers.Mask.blocks``: blocks of one query slice are consecutive, query slices ascending and disjoint); the
    parts of a query are merged through their LSEs, and queries outside every block get out = 0 and lse = -inf.
    Differentiable (``out``; the LSE is not) by ``block_attention_backward``: the fused kernels' autograd
    does not carry a gradient through their LSE, which the merge of a query's blocks would need."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _BlockAttention.apply(q, k, v, rows)
    return _block_forward(q, k, v, rows)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rows):
        out, lse = _block_forward(q, k, v, rows)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rows = rows
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
        dq = block_attention_backward(dout, q, k, v, out, lse, ctx.rows, dk, dv, accumulate=False)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


def _block_forward(q, k, v, rows):
    outs, lses = [], []
    for r, blocks in _rows(rows, q.shape[0]):
        out, lse = _row_attention(q[r], k[r], v[r], blocks)
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    return out.to(q.dtype), lse


def block_attention_backward(dout, q, k, v, out, lse, rows, dk, dv, accumulate: bool):
    """dq of ``block_attention`` from the (merged) output and LSE; dK/dV added to (with ``accumulate``) or
    written into ``dk``, ``dv`` (zero where no query of this part sees the key)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if not accumulate:
        dk.zero_()
        dv.zero_()
    for r, blocks in _rows(rows, q.shape[0]):
        for block in blocks:
            args = (dout[r, :, block.q], q[r, :, block.q], k[r, :, block.k], v[r, :, block.k], out[r, :, block.q],
                    lse[r, :, block.q])
            if block.kind == "masked":
                part = band_attention_backward(*args, block, dk[r, :, block.k], dv[r, :, block.k])
            elif block.kind == "anticausal":
                part = anticausal_attention_backward(*args, dk[r, :, block.k], dv[r, :, block.k])
            else:
                part = fused_attention_backward(*args, block.kind == "causal", dk[r, :, block.k], dv[r, :, block.k],
                                                accumulate=True)
            dq[r, :, block.q] += part
    return dq.to(q.dtype)
