"""Causal attention of a local zigzag query shard against every rank's keys, as gathered.

Documents and sliding windows come in one ``layers.Mask`` on global positions: a (query chunk, key chunk) part
that no query of it may see is skipped (neither computed nor merged), the others run their visible blocks.
Under a sliding layer's mask ``gather_kv`` moves only the window's keys (``distributed/window.py``) and the
attention reads them as they came (``WindowKV``).

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

from ..layers import CAUSAL, FULL, Mask, apply_sinks, attend, attend_backward, sinks_grad
from . import zigzag
from .window import (
    WindowGrad,
    WindowKV,
    exchange_window_kv,
    return_window_grad,
    window_attention_backward,
    window_attention_forward,
)


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


def _masked_parts(rank: int, world: int, chunk_len: int, mask: Mask):
    """The attention parts of rank ``rank``'s queries under documents or a window: one per (query chunk, key
    chunk) pair of which some query sees some key (key chunk not after the query chunk), with the mask of that
    pair; parts that no document spans or that lie wholly outside the window are skipped whole."""
    blocks = []
    for c, query_chunk in enumerate(zigzag.chunk_ids(rank, world)):
        for r in range(world):
            for h, key_chunk in enumerate(zigzag.chunk_ids(r, world)):
                part = mask.part(query_chunk * chunk_len, key_chunk * chunk_len)
                if key_chunk <= query_chunk and part.sees_any(chunk_len, chunk_len):
                    blocks.append(((c,), r, h, h + 1, part))
    return blocks


def _parts(rank: int, world: int, chunk_len: int, mask: Mask):
    """(query chunks, source rank, first half, end half, mask) of every attention part of these queries."""
    if mask.blockwise:
        return _masked_parts(rank, world, chunk_len, mask)
    return [(chunks, r, first, end, CAUSAL if causal else FULL)
            for chunks, r, first, end, causal in _key_blocks(rank, world)]


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
            # Queries that saw no key yet in either (packed documents) have lse -inf: weigh both by 0, not NaN.
            shift = torch.where(torch.isfinite(lse), lse, 0.0)
            self.acc.mul_(torch.exp(self.lse - shift).unsqueeze(-1))
            self.acc.addcmul_(part, torch.exp(part_lse - shift).unsqueeze(-1))
            self.lse.copy_(lse)
        self.count += 1

    def finish(self):
        if self.acc is not self.dst:
            self.dst.copy_(self.acc)


def zigzag_attention_forward(q, kv, rank: int, world: int, mask: Mask = CAUSAL):
    """(out, lse float32) of local zigzag queries q [B, Hq, S/D, d] against every rank's keys and values
    ``kv``: D tensors [2, B, S/D, Hkv, d] (token-major, rank by rank: the all-gather's output, never reordered;
    those of ranks before ``rank`` may hold their first chunk only, the one these queries see). ``mask``: what a
    query of the whole sequence sees (``layers.sequence_mask``: causal, packed rows' documents, the layer's
    window; every rank knows the whole rows' documents and positions are global, so no mask travels).

    Hkv may divide Hq (GQA): K/V are never expanded. Any strides for q: with token-major q (memory
    [B, S/D, Hq, d], as projections produce it) ``out`` is token-major too, so merging its heads is a view.
    ``kv`` may instead be a sliding layer's ``WindowKV`` (``gather_kv`` under a window): the keys the queries read.
    """
    if isinstance(kv, WindowKV):
        return window_attention_forward(q, kv, mask)
    chunk_len = q.shape[-2] // 2
    if world == 1:  # the local tokens are the sequence, in order: one causal call
        return attend(q, *_halves(kv, 0, 0, 2, chunk_len), mask)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    merged = [_Sum(out[..., _row_slice((c,), chunk_len), :], lse[..., _row_slice((c,), chunk_len)]) for c in (0, 1)]
    for chunks, r, first, end, part in _parts(rank, world, chunk_len, mask):
        part_out, part_lse = attend(q[..., _row_slice(chunks, chunk_len), :], *_halves(kv, r, first, end, chunk_len),
                                    part)
        for i, c in enumerate(chunks):
            rows = _row_slice((i,), chunk_len)
            merged[c].add(part_out[..., rows, :], part_lse[..., rows])
    for m in merged:
        m.finish()
    return out, lse


def zigzag_attention_backward(dout, q, kv, out, lse, rank: int, world: int, mask: Mask = CAUSAL):
    """(dq, dkv) of ``zigzag_attention_forward`` from its (merged) output and LSE. dq is laid out like q;
    dkv, float32, holds the gradient of every rank's keys and values from these queries (summed
    over the g query heads of each KV head): the input of the reduce-scatter that sums it over ranks at the
    keys' owners. One [D, 2, B, S/D, Hkv, d] tensor when every rank's K/V came whole, else a list of D tensors
    shaped like ``kv``'s (first chunks only where ``kv`` has them; zero past a written part); a ``WindowGrad``
    for a ``WindowKV`` (what ``scatter_kv_grad`` sends back)."""
    if isinstance(kv, WindowKV):
        return window_attention_backward(dout, q, kv, out, lse, mask)
    shapes = [part.shape for part in kv]
    if all(shape == shapes[rank] for shape in shapes):
        dkv = torch.empty((len(kv), *shapes[rank]), dtype=torch.float32, device=q.device)
    else:
        dkv = [torch.empty(shape, dtype=torch.float32, device=q.device) for shape in shapes]
    chunk_len = q.shape[-2] // 2
    if world == 1:
        halves = (0, 0, 2, chunk_len)
        dq = attend_backward(dout, q, *_halves(kv, *halves), out, lse, mask, *_halves(dkv, *halves), accumulate=False)
        return dq, dkv
    dq = torch.empty_like(q)
    summed = [_Sum(dq[..., _row_slice((c,), chunk_len), :]) for c in (0, 1)]
    written = set()  # (rank, half) of dkv already holding a gradient: later parts add to it
    for chunks, r, first, end, part in _parts(rank, world, chunk_len, mask):
        rows = _row_slice(chunks, chunk_len)
        keys = (r, first, end, chunk_len)
        seen = [(r, h) in written for h in range(first, end)]
        if any(seen) != all(seen):  # _key_blocks never overlaps a part only partly with earlier ones
            raise AssertionError(f"key part {(r, first, end)} of rank {rank} overlaps earlier parts only partly")
        written.update((r, h) for h in range(first, end))
        part_dq = attend_backward(dout[..., rows, :], q[..., rows, :], *_halves(kv, *keys), out[..., rows, :],
                                  lse[..., rows], part, *_halves(dkv, *keys),
                                  accumulate=any(seen))
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


def gather_kv(comm, kv: torch.Tensor, async_op: bool = False, label="kv", mask: Mask = CAUSAL):
    """Every rank's local K/V [2, B, S/D, Hkv, d] (token-major) -> a list of D such tensors, rank by rank (the
    layout the zigzag attention reads; no reordering). Rank p never reads the second chunk (2D-1-r) of a rank
    r < p, which comes after both of its query chunks: where the backend moves tensors point to point, those
    ranks' entries hold their first chunk only (a quarter of the K/V traffic saved, evenly over the ranks:
    rank p receives p halves fewer and sends D-1-p halves fewer). At D = 1 ``[kv]``.

    Under a ``mask`` with a window (a sliding layer), only the keys this rank's queries read, point to point on
    every backend (``distributed.window``): a ``WindowKV``.

    With ``async_op`` it returns a function that waits and returns the result, so the caller can
    compute (e.g. the queries) while the gather is in flight.
    """
    if comm.size == 1:
        return (lambda: [kv]) if async_op else [kv]
    if mask.window is not None:
        wait = exchange_window_kv(comm, kv, mask.window, label=label)
        return wait if async_op else wait()
    pending = comm.all_gather_prefixes(kv, first_chunk(kv), async_op=True, label=label)
    return pending.wait if async_op else pending.wait()


def scatter_kv_grad(comm, dkv, kv: torch.Tensor, async_op: bool = False, label="kv.grad"):
    """The adjoint of ``gather_kv``: ``dkv`` from ``zigzag_attention_backward`` -> the float32 gradient
    [2, B, S/D, Hkv, d] of this rank's own K/V ``kv``, summed over every rank's queries (a ``Pending`` with
    ``async_op``). A reduce-scatter (causally pruned where ``gather_kv`` was), or for a sliding layer's
    ``WindowGrad`` the gradients of what each rank sent going back to it."""
    if isinstance(dkv, WindowGrad):
        return return_window_grad(comm, dkv, async_op=async_op, label=label)
    return comm.reduce_scatter(dkv, async_op=async_op, label=label, prefix=first_chunk(kv))


class ZigzagAttention(torch.autograd.Function):
    """Causal attention of local zigzag queries q [B, Hq, S/D, d] against the keys and values of every rank of
    ``comm``: the local kv [2, B, S/D, Hkv, d] (token-major) are all-gathered (and the gathered K/V saved);
    backward reduce-scatters their gradients to their owners."""

    @staticmethod
    def forward(ctx, q, kv, comm, mask=CAUSAL, sinks=None):
        gathered = gather_kv(comm, kv, mask=mask)
        out, lse = zigzag_attention_forward(q, gathered, comm.rank, comm.size, mask)
        if sinks is not None:  # once, on the attention merged over every rank's keys
            out, lse = apply_sinks(out, lse, sinks)
        # A sliding layer's exchange saves what it received (the tensors saved, their layout on ctx).
        tensors, ctx.window = gathered.saved() if isinstance(gathered, WindowKV) else (gathered, None)
        ctx.save_for_backward(q, out, lse, sinks, *tensors)
        ctx.comm, ctx.mask = comm, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, sinks, *gathered = ctx.saved_tensors
        comm = ctx.comm
        own = gathered[0] if ctx.window else gathered[comm.rank]
        if ctx.window:
            gathered = WindowKV.restore(gathered, ctx.window)
        # From the post-sink output and LSE the kernels' backward is exact for q, k and v (layers.sinks_grad).
        dq, dkv = zigzag_attention_backward(dout, q, gathered, out, lse, comm.rank, comm.size, ctx.mask)
        dkv = scatter_kv_grad(comm, dkv, own)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq, dkv.to(own.dtype), None, None, dsinks


def zigzag_causal_attention(q, kv, comm, mask: Mask = CAUSAL, sinks=None) -> torch.Tensor:
    """q: [B, Hq, S/D, d] local zigzag queries; kv: [2, B, S/D, Hkv, d] local keys and values, token-major;
    ``mask``: the whole sequence's (``layers.sequence_mask``: documents of packed rows, the layer's window);
    ``sinks`` [Hq] (GPT-OSS's, or None): added once, after every rank's partial attention is merged."""
    return ZigzagAttention.apply(q, kv, comm, mask, sinks)
