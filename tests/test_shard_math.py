"""The per-shard math of the distributed code, in one process (issue 48): each function takes what the D ranks
hold, cut here from a whole tensor as the ranks would hold it, and its answer is compared with a whole-tensor
reference written here (``torch.log_softmax``/``topk``, a dense mask, a plain softmax, a sum) or with arithmetic
from the design's words. The communication stays in the callers (an all-gather is a ``torch.stack`` of the
simulated ranks' parts; a reduce-scatter a sum over them); the multirank tests check that the real collectives
deliver what this simulation assumes.

* vocabulary-sharded logprobs: ``logprob_part`` per rank, ``merge_logprob_parts`` on their stack (infer/logprobs.py);
* zigzag sharding and its inverse (distributed/zigzag.py, chunks.py);
* a sliding layer's K/V exchange: ``window_keys``/``window_needs``/``window_traffic`` (chunks.py);
* the attention blocks kept per (query chunk, key chunk) for documents and windows (masks.visible_blocks);
* the exact merge of partial attentions over disjoint key sets (infer/cache.merge_packed);
* ZeRO's dp chunks, padding and accumulation over micro-batches (train/zero.py).

The grouped and heads layouts' placement and the paged cache's slots are in test_kv_placement.py, the global
gradient norm with KV copies against ``clip_grad_norm_`` in test_grad_norm.py. tools/mutants.py plants a bug in
each of these functions; a test here (or there) fails for each.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchtsp.chunks import chunk_ids, window_keys, window_needs, window_traffic
from torchtsp.distributed.zigzag import positions, shard, unshard
from torchtsp.infer.cache import merge_packed
from torchtsp.infer.logprobs import logprob_part, merge_logprob_parts
from torchtsp.masks import Documents, visible_blocks
from torchtsp.train.zero import accumulate, chunk_elements, fill_rows, owned_span, split_chunks

# ---------------------------------------------------------------- vocabulary-sharded logprobs


def vocab_slices(logits: torch.Tensor, world: int) -> list[tuple[torch.Tensor, int]]:
    """(slice [rows, cols], vocab_start) of each rank: V padded with -inf columns to world·cols, cols = ceil(V/D),
    as the selector's logits slices are (the padding rows of the output weight give -inf logits there)."""
    cols = -(-logits.shape[1] // world)
    padded = torch.nn.functional.pad(logits, (0, world * cols - logits.shape[1]), value=float("-inf"))
    return [(padded[:, r * cols:(r + 1) * cols], r * cols) for r in range(world)]


@pytest.mark.parametrize("world,vocab", [(1, 11), (3, 50), (4, 9), (8, 7)])  # (8, 7): a slice of padding only
def test_sharded_logprobs_merge_equals_log_softmax_and_topk_of_the_whole_vocabulary(world, vocab):
    torch.manual_seed(world)
    rows, top_n = 6, 3
    # Spread logits (std 8): slices' maxima differ by tens, so a merge that forgets to rescale each slice's sum
    # to the common maximum is off by far more than the tolerance.
    logits = torch.randn(rows, vocab) * 8
    targets = torch.randint(0, vocab, (rows,))
    targets[1] = -1  # no target: NaN
    parts = [logprob_part(x, targets, start, top_n) for x, start in vocab_slices(logits, world)]
    target_lp, top_lp, top_ids = merge_logprob_parts(torch.stack(parts), targets, top_n)

    whole = torch.log_softmax(logits.double(), dim=-1)
    want = whole.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1)
    # float32 results of float64 sums of float32 logits: within a few float32 ulps of |logprob| <= ~60
    torch.testing.assert_close(target_lp[targets >= 0], want[targets >= 0].float(), rtol=1e-6, atol=1e-5)
    assert torch.isnan(target_lp[1])
    best = whole.topk(min(top_n, vocab), dim=-1)
    torch.testing.assert_close(top_lp, best.values.float(), rtol=1e-6, atol=1e-5)
    assert torch.equal(top_ids, best.indices)


def test_sharded_top_n_breaks_ties_by_the_lower_id_across_slices():
    logits = torch.zeros(2, 8)  # every id equally likely: the first ids win, whichever slice holds them
    logits[1, 5] = 1.0
    parts = [logprob_part(x, torch.tensor([0, 5]), start, 3) for x, start in vocab_slices(logits, 4)]
    _, top_lp, top_ids = merge_logprob_parts(torch.stack(parts), torch.tensor([0, 5]), 3)
    assert top_ids.tolist() == [[0, 1, 2], [5, 0, 1]]
    torch.testing.assert_close(top_lp, torch.log_softmax(logits, -1).gather(1, top_ids))  # float32 both


# ---------------------------------------------------------------- zigzag


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_shards_hold_chunks_p_and_2d_minus_1_minus_p_and_unshard_inverts_them(world):
    S = 2 * world * 3
    x = torch.arange(2 * S * 5).view(2, S, 5)
    cut = x.view(2, 2 * world, 3, 5)  # the 2D chunks, written here
    for p in range(world):
        want = torch.cat([cut[:, p], cut[:, 2 * world - 1 - p]], dim=1)
        assert torch.equal(shard(x, world, p), want)
        assert torch.equal(positions(S, world, p), torch.cat([torch.arange(p * 3, p * 3 + 3),
                                                              torch.arange((2 * world - 1 - p) * 3,
                                                                           (2 * world - p) * 3)]))
        assert sum(c + 1 for c in chunk_ids(p, world)) == 2 * world + 1  # equal causal work on every rank
    assert torch.equal(unshard(torch.stack([shard(x, world, p) for p in range(world)]), dim=1), x)
    y = x.transpose(0, 1).contiguous()  # the sequence in dim 0
    assert torch.equal(unshard(torch.stack([shard(y, world, p, dim=0) for p in range(world)]), dim=0), y)


# ---------------------------------------------------------------- a sliding layer's K/V exchange


def window_cases():
    for world in (1, 2, 3, 4):
        for chunk in (1, 3, 4):
            for window in sorted({1, 2, chunk, chunk + 1, 2 * chunk + 1, 5 * chunk, 20 * chunk}):
                yield world, chunk, window


def keys_read(c: int, chunk: int, window: int) -> set[int]:
    """Global keys some query of global chunk c reads: query i sees i - window < j <= i (the design's rule)."""
    return {j for i in range(c * chunk, (c + 1) * chunk) for j in range(max(0, i - window + 1), i + 1)}


def test_window_pieces_needs_and_traffic_equal_the_keys_the_window_rule_reads():
    for world, chunk, window in window_cases():
        S = 2 * world * chunk
        holder = {g: (r, h) for r in range(world) for h, g in enumerate(chunk_ids(r, world))}  # chunk -> (rank, half)
        for rank in range(world):
            per_chunk = window_keys(S, world, rank, window)
            needs = [[set(), set()] for _ in range(world)]
            for c, pieces in zip(chunk_ids(rank, world), per_chunk):
                got = []
                for owner, half, length in pieces:
                    g = chunk_ids(owner, world)[half]
                    got += range((g + 1) * chunk - length, (g + 1) * chunk)  # the chunk's last `length` tokens
                want = keys_read(c, chunk, window)
                assert got == sorted(want), (world, chunk, window, rank, c)
                for j in want:
                    owner, half = holder[j // chunk]
                    if owner != rank:
                        needs[owner][half].add(j)
            want_needs = []
            for owner in range(world):  # a suffix of each of the owner's chunks, once for both query chunks
                pair = []
                for half in (0, 1):
                    g = chunk_ids(owner, world)[half]
                    assert needs[owner][half] == set(range((g + 1) * chunk - len(needs[owner][half]),
                                                           (g + 1) * chunk))
                    pair.append(len(needs[owner][half]))
                want_needs.append(tuple(pair))
            assert window_needs(S, world, rank, window) == tuple(want_needs), (world, chunk, window, rank)
        received = [sum(map(sum, window_needs(S, world, r, window))) for r in range(world)]
        sent = [sum(sum(window_needs(S, world, peer, window)[r]) for peer in range(world) if peer != r)
                for r in range(world)]
        assert [window_traffic(S, world, r, window) for r in range(world)] == list(zip(received, sent))
        assert sum(received) == sum(sent)


# ---------------------------------------------------------------- attention blocks per (query chunk, key chunk)


def dense_visible(doc: torch.Tensor, window: int | None) -> torch.Tensor:
    """[S, S] bool: query i sees key j (same document, j <= i, and j > i - window)."""
    i, j = torch.arange(len(doc))[:, None], torch.arange(len(doc))[None, :]
    seen = (doc[:, None] == doc[None, :]) & (j <= i)
    return seen if window is None else seen & (j > i - window)


def covered(blocks, q_len: int, k_len: int) -> torch.Tensor:
    """[q_len, k_len] int: how many blocks compute each (query, key) pair as visible."""
    count = torch.zeros(q_len, k_len, dtype=torch.int64)
    for b in blocks:
        i = torch.arange(b.q.stop - b.q.start)[:, None]
        j = torch.arange(b.k.stop - b.k.start)[None, :]
        seen = torch.ones(len(i), j.shape[1], dtype=torch.bool)
        if b.lo is not None:
            seen &= j - i >= b.lo
        if b.hi is not None:
            seen &= j - i <= b.hi
        count[b.q, b.k] += seen.long()
    return count


@pytest.mark.parametrize("window", [None, 1, 3, 7, 200])
def test_blocks_of_every_chunk_pair_cover_exactly_the_visible_pairs_of_documents_and_windows(window):
    S, world = 48, 3  # zigzag: 6 chunks of 8; documents cut across chunk edges, one of a single token
    doc = torch.tensor([0] * 5 + [1] + [2] * 13 + [3] * 20 + [4] * 9)
    runs = Documents.from_ids(doc[None]).runs[0]
    full = dense_visible(doc, window)
    chunk = S // (2 * world)
    for qc in range(2 * world):
        for kc in range(2 * world):
            qs, ks = qc * chunk, kc * chunk
            blocks = visible_blocks(runs, qs, chunk, ks, chunk, window)
            count = covered(blocks, chunk, chunk)
            assert torch.equal(count, full[qs:qs + chunk, ks:ks + chunk].long()), (qc, kc)  # each pair once
            if kc > qc:
                assert blocks == []  # a later chunk's keys: nothing computed
    blocks = visible_blocks(runs, 0, S, 0, S, window)  # the whole sequence at once (one rank)
    assert torch.equal(covered(blocks, S, S), full.long())


# ---------------------------------------------------------------- merging partial attentions


def test_merge_of_partials_over_disjoint_key_sets_equals_softmax_over_all_keys():
    torch.manual_seed(0)
    B, H, T, L, d, world = 2, 3, 4, 13, 8, 4
    q, k, v = torch.randn(B, H, T, d), torch.randn(B, H, L, d) * 3, torch.randn(B, H, L, d)
    s = (q @ k.transpose(-1, -2)) * d ** -0.5
    hidden = torch.zeros(T, L, dtype=torch.bool)
    hidden[0, 2::world] = True  # query 0 sees no key of set 2: a partial of lse -inf (its O is zeros)
    s = s.masked_fill(hidden, float("-inf"))
    parts = []
    for r in range(world):  # key set r: keys p with p mod D == r (the sequence layout)
        sr, vr = s[..., r::world], v[:, :, r::world]
        lse = torch.logsumexp(sr, dim=-1)
        out = torch.nan_to_num(torch.softmax(sr, dim=-1)) @ vr
        parts.append(torch.cat([out, lse.unsqueeze(-1)], dim=-1))
    merged = merge_packed(torch.stack(parts))
    torch.testing.assert_close(merged, torch.softmax(s, dim=-1) @ v, rtol=1e-5, atol=1e-6)  # float32 sums
    none = torch.full((world, 1, d + 1), float("-inf"))
    none[..., :d] = 0
    assert torch.equal(merge_packed(none), torch.zeros(1, d))  # a query no key set sees: zeros


# ---------------------------------------------------------------- ZeRO's chunks, padding and accumulation


@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_zero_chunks_reduce_scatter_and_micro_batch_accumulation_equal_the_summed_gradient(dp):
    """Each dp rank's gradients of a bucket of parameters (fewer rows than ranks, rows not divisible by dp, a
    scalar) go into [dp, width] rows; the reduce-scatter (a sum over the simulated ranks) leaves rank r row r;
    its owned chunk accumulates over micro-batches. Concatenated over ranks: the sum of every rank's gradient
    over every micro-batch, as ``--zero 0``'s all-reduce of ``.grad`` accumulated over micro-batches."""
    torch.manual_seed(dp)
    shapes = [(7, 3), (2, 5), (), (10,), (4, 2, 3)]
    micro = 3
    chunks = [chunk_elements(shape, dp) for shape in shapes]
    for shape, chunk in zip(shapes, chunks):
        rows = shape[0] if shape else 1
        assert chunk == math.ceil(rows / dp) * math.prod(shape[1:])  # whole rows, the last ranks padded
        spans = [owned_span(math.prod(shape), chunk, r) for r in range(dp)]
        assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(math.prod(shape)))  # a partition
    offsets = [sum(chunks[:i]) for i in range(len(chunks))]
    width = sum(chunks)
    grads = torch.randn(micro, dp, sum(math.prod(s) for s in shapes))  # every rank's flat gradients, per pass
    owned = [[None] * len(shapes) for _ in range(dp)]
    for m in range(micro):
        buffers = torch.zeros(dp, dp, width)  # per rank: a fresh ZeRO-2 bucket buffer
        for r in range(dp):
            flats = grads[m, r].split([math.prod(s) for s in shapes])
            for flat, chunk, offset in zip(flats, chunks, offsets):
                fill_rows(buffers[r, :, offset:offset + chunk], flat)
        total = buffers.sum(dim=0)  # the reduce-scatter: rank r gets row r of the sum
        for r in range(dp):
            for i, (shape, chunk, offset) in enumerate(zip(shapes, chunks, offsets)):
                lo, hi = owned_span(math.prod(shape), chunk, r)
                owned[r][i] = accumulate(owned[r][i], total[r, offset:offset + hi - lo].clone())
    want = grads.sum(dim=(0, 1)).split([math.prod(s) for s in shapes])
    for i in range(len(shapes)):
        got = torch.cat([owned[r][i] for r in range(dp)])
        torch.testing.assert_close(got, want[i], rtol=1e-6, atol=1e-6)  # float32 sums in another order
        full, rest = split_chunks(want[i], chunks[i], dp)  # the all-gather's way back: chunks in rank order
        back = torch.cat([full.reshape(-1), rest if rest is not None else full.new_empty(0)])
        assert torch.equal(back, want[i])
