"""Attention kernels: (output, log-sum-exp) of queries against keys, for every device.

``fused_attention`` runs a fused kernel that returns the LSE and never builds a score matrix of all queries
against all keys: PyTorch's flash kernel on the CPU, the fused SDPA kernels on CUDA (flash for bf16/fp16,
memory-efficient for fp32), and a portable block-wise kernel on any other device. GQA never expands K/V.
``masked_attention`` handles per-token positions and validity (a KV cache), block by block in float32;
``document_attention`` runs the fused kernel on the blocks of packed documents only.
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


def masked_attention(q, k, v, q_pos, k_pos, k_valid):
    """Attention of queries q [B, Hq, T, d] against keys/values [B, Hkv, N, d] in float32.

    A query at position i sees the valid keys at positions <= i. Returns (out [B, Hq, T, d] float32,
    lse [B, Hq, T] float32); a query that sees no key here gets out = 0, lse = -inf, which the merge
    weighs by exp(-inf) = 0. GQA: query head j uses KV head j // g, without expanding K/V.
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


# Packed documents: each (row, document) block is one call of the fused kernel above, causal on a document's
# diagonal and unmasked where its keys all precede its queries; blocks outside every document are never computed
# and no mask tensor is built. (A varlen kernel would take all documents in one call; on the CPU there is none.)


def document_attention(q, k, v, blocks):
    """(out, lse float32) of q [B, Hq, Lq, d] against k, v [B, Hkv, Lk, d] on the ``blocks`` of each row
    (``Documents.blocks``: (query slice, key slice, causal)); queries outside every block get out = 0 and
    lse = -inf. Differentiable by autograd through the fused kernel."""
    B, _, Lq, _ = q.shape
    outs, lses = [], []
    for b, row in enumerate(blocks):
        pieces, piece_lses, at = [], [], 0
        for qs, ks, causal in row + [(slice(Lq, Lq), None, False)]:
            if qs.start > at:  # queries that see no key in this part
                pieces.append(q.new_zeros(1, q.shape[1], qs.start - at, q.shape[-1]))
                piece_lses.append(torch.full((1, q.shape[1], qs.start - at), float("-inf"), dtype=torch.float32,
                                             device=q.device))
            if ks is not None:
                o, lse = fused_attention(q[b:b + 1, :, qs], k[b:b + 1, :, ks], v[b:b + 1, :, ks], causal)
                pieces.append(o)
                piece_lses.append(lse)
            at = qs.stop
        outs.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
        lses.append(piece_lses[0] if len(piece_lses) == 1 else torch.cat(piece_lses, dim=2))
    if B == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def document_attention_backward(dout, q, k, v, out, lse, blocks, dk, dv, accumulate: bool):
    """dq of ``document_attention`` from the (merged) output and LSE; dK/dV added to (with ``accumulate``) or
    written into ``dk``, ``dv`` (zero where no query of this part sees the key)."""
    dq = torch.zeros_like(q)
    if not accumulate:
        dk.zero_()
        dv.zero_()
    for b, row in enumerate(blocks):
        for qs, ks, causal in row:
            r = slice(b, b + 1)
            dq[r, :, qs] = fused_attention_backward(dout[r, :, qs], q[r, :, qs], k[r, :, ks], v[r, :, ks],
                                                    out[r, :, qs], lse[r, :, qs], causal, dk[r, :, ks],
                                                    dv[r, :, ks], accumulate=True)
    return dq
