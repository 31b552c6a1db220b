"""Causal attention of a local zigzag query shard against every rank's keys, as gathered.

Rank p's queries are two chunks (global chunks p and 2D-1-p). Chunk i attends to all
keys of chunks < i (no mask) and causally to chunk i itself. The keys stay as the
all-gather delivers them, rank by rank (rank r's two chunks r and 2D-1-r): a query chunk
sees one contiguous slice of each rank's keys, so nothing is reordered into global order,
and the key gradients come out already split by owner for the reduce-scatter. Each
(query chunk, source rank) part runs through a fused attention kernel that returns its
log-sum-exp (LSE) and never builds an S x S score matrix; the parts are merged in float32
through their LSEs. Backward calls the
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


def _key_blocks(rank: int, world: int):
    """The attention parts of rank ``rank``'s queries: (query rows, source rank r, first half, end half, causal).

    Query rows are local chunk 0 (global chunk p = rank), 1 (global 2D-1-p) or both. Rank r's local tokens are
    its chunks r and 2D-1-r (halves 0 and 1 of its K/V), so each part is one contiguous slice of halves: both
    (every key precedes the queries), the first, or a causal diagonal block (the query chunk itself). A rank
    r < p's first chunk precedes both query chunks: one part serves both.
    """
    early, late = zigzag.chunk_ids(rank, world)
    blocks = []
    for r in range(world):
        first, second = zigzag.chunk_ids(r, world)  # first < world <= second
        if first < early:
            blocks.append(((0, 1), r, 0, 1, False))  # its second chunk follows both query chunks
        elif first == early:
            blocks += [((0,), r, 0, 1, True), ((1,), r, 0, 1, False), ((1,), r, 1, 2, True)]
        else:  # later than the early chunk: the late one sees both of its chunks
            blocks.append(((1,), r, 0, 2, False))
    return blocks


def _row_slice(chunks, chunk_len: int) -> slice:
    """The local query rows of chunks ``chunks`` ((0,), (1,) or (0, 1))."""
    return slice(chunks[0] * chunk_len, (chunks[-1] + 1) * chunk_len)


def _halves(kv, r: int, first: int, end: int, chunk_len: int):
    """Keys and values [B, Hkv, L, d] of halves [first, end) of rank r's local K/V ``kv[r]`` [2, B, S/D, Hkv, d]."""
    return kv[r][:, :, first * chunk_len:end * chunk_len].transpose(2, 3).unbind(0)


class _Sum:
    """Sums tensors into the view ``dst`` as they come, in float32 (in ``dst`` itself when it is float32).

    ``lse``: the parts are partial attention outputs over disjoint key sets, with their log-sum-exps; they are
    folded into ``dst`` and ``lse`` (views) online, weighted by the softmax normaliser of the keys so far.
    """

    def __init__(self, dst, lse=None):
        self.dst, self.lse, self.count = dst, lse, 0
        self.acc = dst if dst.dtype == torch.float32 else torch.empty(dst.shape, dtype=torch.float32,
                                                                     device=dst.device)

    def add(self, part, part_lse=None):
        if not self.count:
            self.acc.copy_(part)
            if self.lse is not None:
                self.lse.copy_(part_lse)
        elif self.lse is None:
            self.acc.add_(part)
        else:
            lse = torch.logaddexp(self.lse, part_lse)
            self.acc.mul_(torch.exp(self.lse - lse).unsqueeze(-1))
            self.acc.addcmul_(part, torch.exp(part_lse - lse).unsqueeze(-1))
            self.lse.copy_(lse)
        self.count += 1

    def finish(self):
        if self.acc is not self.dst:
            self.dst.copy_(self.acc)


def zigzag_attention_forward(q, kv, rank: int, world: int):
    """(out, lse float32) of local zigzag queries q [B, Hq, S/D, d] against every rank's keys and values
    ``kv``: D tensors [2, B, S/D, Hkv, d] (token-major, rank by rank: the all-gather's output, never reordered;
    those of ranks before ``rank`` may hold their first chunk only, the one these queries see).

    Hkv may divide Hq (GQA): K/V are never expanded. Any strides for q: with token-major q (memory
    [B, S/D, Hq, d], as projections produce it) ``out`` is token-major too, so merging its heads is a view.
    """
    chunk_len = q.shape[-2] // 2
    if world == 1:  # the local tokens are the sequence, in order: one causal call
        return _gqa_forward(q, *_halves(kv, 0, 0, 2, chunk_len), True)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    merged = [_Sum(out[..., _row_slice((c,), chunk_len), :], lse[..., _row_slice((c,), chunk_len)]) for c in (0, 1)]
    for chunks, r, first, end, causal in _key_blocks(rank, world):
        part_out, part_lse = _gqa_forward(q[..., _row_slice(chunks, chunk_len), :],
                                          *_halves(kv, r, first, end, chunk_len), causal)
        for i, c in enumerate(chunks):
            rows = _row_slice((i,), chunk_len)
            merged[c].add(part_out[..., rows, :], part_lse[..., rows])
    for m in merged:
        m.finish()
    return out, lse


def zigzag_attention_backward(dout, q, kv, out, lse, rank: int, world: int):
    """(dq, dkv) of ``zigzag_attention_forward`` from its (merged) output and LSE. dq is laid out like q;
    dkv, float32, holds the gradient of every rank's keys and values from these queries (summed
    over the g query heads of each KV head): the input of the reduce-scatter that sums it over ranks at the
    keys' owners. One [D, 2, B, S/D, Hkv, d] tensor when every rank's K/V came whole, else a list of D tensors
    shaped like ``kv``'s (first chunks only where ``kv`` has them; zero past a written part)."""
    shapes = [part.shape for part in kv]
    if all(shape == shapes[rank] for shape in shapes):
        dkv = torch.empty((len(kv), *shapes[rank]), dtype=torch.float32, device=q.device)
    else:
        dkv = [torch.empty(shape, dtype=torch.float32, device=q.device) for shape in shapes]
    chunk_len = q.shape[-2] // 2
    if world == 1:
        halves = (0, 0, 2, chunk_len)
        return _gqa_backward(dout, q, *_halves(kv, *halves), out, lse, True, *_halves(dkv, *halves),
                             accumulate=False), dkv
    dq = torch.empty_like(q)
    summed = [_Sum(dq[..., _row_slice((c,), chunk_len), :]) for c in (0, 1)]
    written = set()  # (rank, half) of dkv already holding a gradient: later parts add to it
    for chunks, r, first, end, causal in _key_blocks(rank, world):
        rows = _row_slice(chunks, chunk_len)
        keys = (r, first, end, chunk_len)
        seen = [(r, h) in written for h in range(first, end)]
        if any(seen) != all(seen):  # _key_blocks never overlaps a part only partly with earlier ones
            raise AssertionError(f"key part {(r, first, end)} of rank {rank} overlaps earlier parts only partly")
        written.update((r, h) for h in range(first, end))
        part_dq = _gqa_backward(dout[..., rows, :], q[..., rows, :], *_halves(kv, *keys), out[..., rows, :],
                                lse[..., rows], causal, *_halves(dkv, *keys), accumulate=any(seen))
        for i, c in enumerate(chunks):
            summed[c].add(part_dq[..., _row_slice((i,), chunk_len), :])
    for m in summed:
        m.finish()
    for r in range(world):
        for h in range(dkv[r].shape[2] // chunk_len):
            if (r, h) not in written:  # keys after every local query
                dkv[r][:, :, h * chunk_len:(h + 1) * chunk_len].zero_()
    return dq, dkv


def first_chunk(kv: torch.Tensor) -> tuple[int, int]:
    """Where a rank's first chunk lies in its local K/V [2, B, S/D, Hkv, d]: (dim, length), a ``prefix`` of comm."""
    return 2, kv.shape[2] // 2


def gather_kv(comm, kv: torch.Tensor, async_op: bool = False, label="kv"):
    """Every rank's local K/V [2, B, S/D, Hkv, d] (token-major) -> a list of D such tensors, rank by rank (the
    layout the zigzag attention reads; no reordering). Rank p never reads the second chunk (2D-1-r) of a rank
    r < p, which comes after both of its query chunks: where the backend moves tensors point to point, those
    ranks' entries hold their first chunk only (a quarter of the K/V traffic saved, evenly over the ranks:
    rank p receives p halves fewer and sends D-1-p halves fewer). At D = 1 ``[kv]``.

    With ``async_op`` it returns a function that waits and returns the result, so the caller can
    compute (e.g. the queries) while the gather is in flight.
    """
    if comm.size == 1:
        return (lambda: [kv]) if async_op else [kv]
    pending = comm.all_gather_prefixes(kv, first_chunk(kv), async_op=True, label=label)
    return pending.wait if async_op else pending.wait()


class ZigzagAttention(torch.autograd.Function):
    """Causal attention of local zigzag queries q [B, Hq, S/D, d] against the keys and values of every rank of
    ``comm``: the local kv [2, B, S/D, Hkv, d] (token-major) are all-gathered (and the gathered K/V saved);
    backward reduce-scatters their gradients to their owners."""

    @staticmethod
    def forward(ctx, q, kv, comm):
        gathered = gather_kv(comm, kv)
        out, lse = zigzag_attention_forward(q, gathered, comm.rank, comm.size)
        ctx.save_for_backward(q, out, lse, *gathered)
        ctx.comm = comm
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *gathered = ctx.saved_tensors
        comm = ctx.comm
        dq, dkv = zigzag_attention_backward(dout, q, gathered, out, lse, comm.rank, comm.size)
        dkv = comm.reduce_scatter(dkv, label="kv.grad", prefix=first_chunk(gathered[comm.rank]))
        return dq, dkv.to(gathered[0].dtype), None


def zigzag_causal_attention(q, kv, comm) -> torch.Tensor:
    """q: [B, Hq, S/D, d] local zigzag queries; kv: [2, B, S/D, Hkv, d] local keys and values, token-major."""
    return ZigzagAttention.apply(q, kv, comm)
