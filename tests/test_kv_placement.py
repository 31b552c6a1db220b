"""Where a token's K/V lives (kv_layouts.py: ``kv_heads_of_rank``, ``kv_token_ranks``, ``KVPlacement``), checked by
simulating the D ranks of every layout writing every position of a sequence through the rule, against
arithmetic written here from the design's words (docs/design.md, "Decode cache layouts", "Paged cache"):

* every (KV head, position) lands on exactly the ranks the layout names (one rank for TSP's layouts; the copies
  of a head under TP with n_kv < D), in one (block, slot) of each, no two positions sharing one;
* each member keeps its tokens in order, ``block_size`` per block: its k-th token is slot k of its own slots;
* the inverse (own slot, member) -> position round-trips, on ints and on tensors alike;
* each rank's count of heads x slots is what analysis/infer_memory predicts for the KV cache;
* ``infer/cache.py`` writes and reads the slots the rule names (a paged pool with a shuffled block table).

Single process, no ranks: a planted off-by-one or a swapped ``//`` / ``%`` fails here in a second.
"""

from __future__ import annotations

import random

import pytest
import torch

import torchtsp
from torchtsp.analysis import predict_memory
from torchtsp.infer.cache import FAR, KVPool
from torchtsp.kv_layouts import KVPlacement, allowed_kv_layouts, kv_heads_of_rank, kv_heads_per_rank, kv_token_ranks

N_HEADS = 8
# (scheme, layout, n_kv, D): every TSP layout the model allows, TP's heads (copies of a head when n_kv < D), SP.
CASES = [("tsp", layout, n_kv, D) for D in (1, 2, 4, 8) for n_kv in (1, 2, 4, 8)
         for layout in allowed_kv_layouts(n_kv, D)]
CASES += [("tp", "heads", n_kv, D) for D in (2, 4, 8) for n_kv in (1, 2, 4, 8)]
CASES += [("sp", "sequence", n_kv, D) for D in (2, 4) for n_kv in (1, 4)]
BLOCK_SIZES = (1, 3, 4)


def expected_keepers(layout: str, n_kv: int, D: int, head: int, p: int) -> set[int]:
    """The ranks that cache head ``head`` at position p, from the design's words (not from kv_layouts.py).

    heads: rank j holds KV heads j·n_kv/D … (j+1)·n_kv/D − 1, or with n_kv < D a copy of head ⌊j·n_kv/D⌋, and every
    token of them. grouped: the c = D/n_kv ranks of head ⌊j·n_kv/D⌋ deal its tokens in turn, rank j taking those
    with p mod c == j mod c. sequence: rank j holds every head of the tokens with p mod D == j."""
    keepers = set()
    for j in range(D):
        if layout == "sequence":
            if p % D == j:
                keepers.add(j)
        elif n_kv >= D:
            if j * n_kv // D <= head < (j + 1) * n_kv // D:
                keepers.add(j)
        elif head == j * n_kv // D and (layout == "heads" or p % (D // n_kv) == j % (D // n_kv)):
            keepers.add(j)
    return keepers


def simulate(layout: str, n_kv: int, D: int, block_size: int, length: int) -> dict:
    """Every rank writes every position 0 .. length - 1 through the rule: {rank: {(head, position): (block, slot)}}."""
    placement = KVPlacement.of(layout, n_kv, D, block_size)
    stored = {}
    for rank in range(D):
        member = placement.member_of_rank(rank)
        stored[rank] = {(head, p): (placement.block_index(p), placement.offset(p))
                        for p in range(length) if placement.keeper(p) == member
                        for head in kv_heads_of_rank(layout, n_kv, D, rank)}
    return stored


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("scheme,layout,n_kv,D", CASES, ids=[f"{s}-{lay}-kv{k}-D{d}" for s, lay, k, d in CASES])
def test_every_position_lands_where_the_layout_says_once_per_rank(scheme, layout, n_kv, D, block_size):
    length = 4 * D * block_size + 5  # several blocks of every member, the last one partly filled
    stored = simulate(layout, n_kv, D, block_size, length)
    for head in range(n_kv):
        for p in range(length):
            held = {rank for rank in range(D) if (head, p) in stored[rank]}
            assert held == expected_keepers(layout, n_kv, D, head, p), (head, p)
    for places in stored.values():
        heads = sorted({head for head, _ in places})
        assert len(heads) == kv_heads_per_rank(layout, n_kv, D)
        for head in heads:  # the rank's tokens of one head: in order, block_size per block, no slot twice
            positions = sorted(p for h, p in places if h == head)
            assert [places[head, p] for p in positions] == [(k // block_size, k % block_size)
                                                            for k in range(len(positions))]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("token_ranks", (1, 2, 3, 4, 8))
def test_the_inverse_round_trips_on_ints_and_tensors(token_ranks, block_size):
    rule = KVPlacement(token_ranks, block_size)
    positions = range(5 * token_ranks * block_size + 3)
    for p in positions:
        member, slot = rule.keeper(p), rule.local_slot(p)
        assert 0 <= member < token_ranks and 0 <= rule.offset(p) < block_size
        assert rule.position(slot, member) == p
    for member in range(token_ranks):
        for slot in range(4 * block_size):
            p = rule.position(slot, member)
            assert (rule.keeper(p), rule.local_slot(p)) == (member, slot)
    t = torch.tensor(list(positions))
    for name in ("keeper", "block_index", "offset", "local_slot"):
        assert getattr(rule, name)(t).tolist() == [getattr(rule, name)(p) for p in positions], name
    assert rule.position(rule.local_slot(t), rule.keeper(t)).tolist() == list(positions)


def _infer_cfg(n_kv: int) -> torchtsp.ModelConfig:
    return torchtsp.ModelConfig(dim=64, n_layers=2, n_heads=N_HEADS, n_kv_heads=n_kv, ffn_dim=64, vocab_size=128,
                                max_seq_len=256)


@pytest.mark.parametrize("scheme,layout,n_kv,D", CASES, ids=[f"{s}-{lay}-kv{k}-D{d}" for s, lay, k, d in CASES])
def test_each_ranks_cache_is_what_the_memory_model_predicts(scheme, layout, n_kv, D):
    cfg, batch, prompt, new, e = _infer_cfg(n_kv), 3, 21, 6, 2
    padded = -(-prompt // (2 * D)) * 2 * D if scheme != "tp" else prompt  # generate pads for the zigzag's 2D
    cached = padded + new - 1  # the last chosen token is never written back
    stored = simulate(layout, n_kv, D, 1, cached)
    fullest = max(len(places) for places in stored.values())  # (head, slot) pairs of the rank holding the most
    kv_bytes = cfg.n_layers * 2 * e * batch * fullest * cfg.head_dim
    degree = {scheme: D}
    predicted = predict_memory(scheme, cfg, batch, prompt, **degree, mode="infer", new_tokens=new, dtype_bytes=e,
                               kv_layout=layout if scheme == "tsp" else "auto")
    assert predicted.kv_cache == kv_bytes


def test_token_ranks_per_layout():
    # The design's table: tokens per block id = block_size x (1 for heads, D/n_kv for grouped, D for sequence).
    assert [kv_token_ranks(layout, 2, 8) for layout in ("heads", "grouped", "sequence")] == [1, 4, 8]
    assert KVPlacement.of("grouped", 2, 8, block_size=16).block_tokens == 64


@pytest.mark.parametrize("token_ranks,member", [(1, 0), (2, 1), (4, 2)])
def test_the_paged_cache_writes_and_reads_the_rules_slots(token_ranks, member):
    """A pool of 6 blocks of 3 slots, two sequences with shuffled block tables: ``reserve`` returns the slot the
    rule names for the positions this member keeps (the spare one for the others), and the keys' positions are
    exactly the member's positions below each sequence's length."""
    bs, rule = 3, KVPlacement(token_ranks, 3)
    pool = KVPool(1, 6, 1, 2, torch.float32, "cpu", rule, member)
    blocks = list(range(6))
    random.Random(token_ranks).shuffle(blocks)
    tables = torch.tensor([blocks[:3], blocks[3:]])
    cache = pool.rows(tables, torch.zeros(2, dtype=torch.long))
    lengths = [5 * token_ranks + 1, 2 * token_ranks]
    pos = torch.arange(max(lengths)).expand(2, -1)
    valid = pos < torch.tensor(lengths).unsqueeze(1)
    (slots,) = cache.reserve(pos, valid)  # [G = 1, B, T]: one block group
    for b, length in enumerate(lengths):
        for p in range(max(lengths)):
            kept = p < length and p % token_ranks == member
            where = tables[b, p // (token_ranks * bs)] * pool.stride + p % (token_ranks * bs) // token_ranks
            assert slots[b, p] == (where if kept else pool.spare), (b, p)
        keys = cache.key_positions()[b]
        assert sorted(keys[keys != FAR].tolist()) == [p for p in range(length) if p % token_ranks == member]
