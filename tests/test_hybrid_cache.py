"""The paged cache of a hybrid model (sliding-window and full layers; issue #44 item 5): one block group per
attention type (serve/blocks.py), single process.

* the block manager: a sliding group's block goes back exactly when no query still to come sees it (the
  arithmetic is written out here, from masks.py's rule: a query at q sees keys q - W < k <= q); a prefix hit
  counts only as far as the full group holds every block and the sliding group the window before the hit point;
  the budget splits by one max-length sequence's need in each group;
* the scheduler over a simulated model that reads its window through the sliding table and the rest through the
  full one: every token equals the reference while sliding blocks are freed, under preemption and prefix hits
  (a block freed one step early makes it read the null block and fail);
* the real serving core on a tiny Gemma 3 (and an all-sliding Mistral) from transformers: greedy tokens equal
  transformers' for prompts longer than the window, with sliding blocks freed (the free count asserted),
  preemption and recompute, a prefix hit, and every cached block of each group equal to a fresh prefill's K/V.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from test_blocks import drive  # noqa: E402
from test_blocks import reference as stand_in_reference  # noqa: E402
from torchtsp.kv_layouts import first_needed_block, window_blocks  # noqa: E402
from torchtsp.serve.blocks import NULL_BLOCK, KVBlockManager, block_hash  # noqa: E402
from torchtsp.serve.paged_scheduler import PagedScheduler, scheduled  # noqa: E402
from torchtsp.serve.plan import Admission  # noqa: E402

# ---------------------------------------------------------------- the free rule, by hand


def test_first_needed_block_is_the_block_of_the_oldest_key_a_query_still_sees():
    # W = 6, blocks of 4. A query at q sees q - 5 .. q. Next position 9: keys 4..9, so block 0 (0..3) is out and
    # block 1 (4..7) is not; next position 10: keys 5..10, block 1 still holds 5; at 12: keys 7..12, still 7 in
    # block 1; at 13: keys 8..13: block 1 out too.
    W, bt = 6, 4
    assert [first_needed_block(q, W, bt) for q in (0, 5, 8, 9, 10, 12, 13, 16, 17)] == [0, 0, 0, 1, 1, 1, 2, 2, 3]
    # The window counts the query: W = 1 sees only itself, so every block before the query's goes.
    assert [first_needed_block(q, 1, bt) for q in (3, 4, 7, 8)] == [0, 1, 1, 2]
    # A decoding sequence holds at most the blocks its window touches: 6 positions starting anywhere in blocks of
    # 4 touch 2 or 3 (3..8: blocks 0, 1, 2); 5 positions at most 2 (3..7); 4 positions 1 or 2.
    assert window_blocks(6, 4) == 3 and window_blocks(5, 4) == 2 and window_blocks(4, 4) == 2
    assert window_blocks(64, 16) == 5  # 64 positions: 4 blocks when aligned, 5 when not


def hybrid(pages: int, window: int, bt: int = 4, caching: bool = True, sliding_groups: int = 1) -> KVBlockManager:
    """A full group and ``sliding_groups`` sliding ones sharing ``pages`` pages, the null page among them."""
    return KVBlockManager(pages + 1, bt, caching, windows=[None] + [window] * sliding_groups)


def test_sliding_blocks_are_freed_exactly_when_they_leave_the_window():
    m = hybrid(24, window=6)
    assert m.pool.total == 24 and NULL_BLOCK not in m.pool.free_queue  # the null page is set aside
    assert m.allocate(0, list(range(9)), 9) == 0  # positions 0..8: 3 blocks in each group, 6 pages
    assert m.pool.num_free == 18
    # Computed 0..8, the next query at 9 sees 4..9: block 0 (0..3) leaves, its entry becomes the null page.
    assert m.free_out_of_window(0, 9) == 1
    assert m.groups[1].tables[0][0] == NULL_BLOCK and m.pool.num_free == 19
    assert m.free_out_of_window(0, 12) == 0  # keys 7..12: block 1 (4..7) is still seen by position 12
    assert m.free_out_of_window(0, 13) == 1  # keys 8..13
    assert m.pool.num_free == 20 and NULL_BLOCK not in m.tables[0]  # the full group keeps all
    m.free(0)
    assert m.pool.num_free == 24  # the null entries are not released


def computed(m: KVBlockManager, seq: int, n: int) -> None:
    """Compute positions 0 .. n - 1 of ``seq`` a token a step, its out-of-window blocks freed before each step (as
    the scheduler does), and then before its next query at n."""
    assert m.allocate(seq, [seq] * n, 1, use_cache=False) == 0
    for pos in range(1, n):
        m.free_out_of_window(seq, pos)
        assert m.append_slots(seq, 1), (seq, pos)
    m.free_out_of_window(seq, n)


def test_the_groups_take_what_they_need_from_one_pool_both_ways():
    # Blocks of 4, W = 6. A sequence at its next query q holds every full block before q and, in a sliding group,
    # the blocks of keys q - 5 .. q - 1 (2 at q = 40: 35..39, blocks 8 and 9; 2 at 24: blocks 4 and 5); on its way
    # it held at most 3 (at q = 36: 31..36, blocks 7..9), so 22 pages suffice for both.
    full_heavy = hybrid(22, window=6)
    computed(full_heavy, 0, 40)
    computed(full_heavy, 1, 24)
    # 10 + 6 full blocks and 2 + 2 sliding: the full group holds 16 of the 20 pages in use.
    assert [sum(len(g.live(t)) for t in g.tables.values()) for g in full_heavy.groups] == [16, 4]
    assert full_heavy.pool.num_free == 2 and full_heavy.usage == 20 / 22
    # Three sliding groups and short sequences: 12 positions are 3 full blocks and, at the next query 12 (keys
    # 7..11), 2 blocks in each sliding group: the sliding groups hold 12 of the 18 pages two sequences take.
    short = hybrid(22, window=6, sliding_groups=3)
    computed(short, 0, 12)
    computed(short, 1, 12)
    assert [sum(len(g.live(t)) for t in g.tables.values()) for g in short.groups] == [6, 4, 4, 4]
    assert short.pool.num_free == 4


def test_pages_a_sliding_group_gives_back_go_to_the_full_group():
    m = hybrid(8, window=6)
    assert m.allocate(0, list(range(16)), 16) == 0  # 4 blocks in each group: all 8 pages
    assert not m.append_slots(0, 1)  # position 16 starts a fifth block in both groups: 2 pages, none free
    assert m.free_out_of_window(0, 16) == 2  # keys 11..16: blocks 0 and 1 (0..7) leave the sliding group
    given_back = set(m.pool.free_queue)
    assert m.append_slots(0, 1)
    assert {m.tables[0][4], m.groups[1].tables[0][4]} == given_back and m.pool.num_free == 0


def test_admission_counts_the_pages_of_every_group_together():
    m = hybrid(10, window=6, sliding_groups=2)
    assert m.allocate(0, list(range(12)), 12) == 0  # 3 blocks in each of 3 groups: 9 of 10 pages
    # A 4-token prompt needs a block in each group: 3 pages, 1 free; refused, nothing taken.
    assert m.allocate(1, [7, 7, 7, 7], 4) is None and m.pool.num_free == 1 and 1 not in m.slots
    assert m.free_out_of_window(0, 12) == 2  # keys 7..12: each sliding group's block 0 goes back
    assert m.allocate(1, [7, 7, 7, 7], 4) == 0 and m.pool.num_free == 0


def test_the_capacity_is_the_longest_sequence_the_pool_holds_alone():
    # 22 pages, blocks of 4, W = 6 (a decoding sequence's window touches at most 3 blocks): b full blocks and
    # min(b, 3) sliding ones fit while b + 3 <= 22, so 19 blocks, 76 tokens; with two sliding groups 16 (64).
    m = hybrid(22, window=6)
    assert m.capacity_tokens == 76 and m.fits_ever(76) and not m.fits_ever(77)
    assert hybrid(22, window=6, sliding_groups=2).capacity_tokens == 64
    assert m.fits_ever(8) and m.pages_alone(8) == 2 + 2  # shorter than the window: its own blocks in each group


def test_a_chunk_never_outgrows_the_pool_alone():
    # 14 pages, blocks of 4, W = 6: a chunk of n at c needs the sliding blocks of positions c - 5 .. c + n - 1
    # (n + 5 positions, at most (n + 5 - 2) // 4 + 1 blocks) beside every full block. A 40-token sequence's 10 full
    # blocks leave 4: n = 8 fits wherever it starts (at c = 7: 2..14, blocks 0..3), n = 9 does not (at c = 8:
    # 3..16, blocks 0..4). At 41 tokens (11 full blocks) 3 are left: n = 4 (5..12 at c = 10... at most 3 blocks),
    # not 5 (at c = 8: 3..12, blocks 0..3).
    m = hybrid(14, window=6)
    assert m.max_chunk_tokens(40) == 8 and m.max_chunk_tokens(41) == 4
    assert m.max_chunk_tokens(5) == 5  # 2 full blocks: the chunk of the whole sequence fits
    sched = PagedScheduler(m, max_num_batched_tokens=64)
    sched.add_request(0, list(range(40)), 2)
    plan = sched.schedule()
    assert plan.prefill == [(0, 0, 8)]  # capped by the pool, not the budget of 64


def test_layers_split_into_groups_of_equal_layer_count():
    from torchtsp.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
    from torchtsp.kv_layouts import KVGroups

    S, F = SLIDING_ATTENTION, FULL_ATTENTION
    base = dict(dim=64, n_heads=4, n_kv_heads=4, sliding_window=8)
    # 5 local : 1 global: groups of 1 layer, the full one first, then one per local layer.
    groups = KVGroups.of(ModelConfig(**base, n_layers=6, layer_types=(S,) * 5 + (F,)))
    assert groups.group_size == 1 and groups.windows == (None,) + (8,) * 5
    assert groups.layer_group == (1, 2, 3, 4, 5, 0) and groups.layer_slot == (0,) * 6
    # 3 global, 5 local: groups of 3; the local layers fill one and pad a second (2 layers of 3).
    types = (S, F, S, F, S, F, S, S)
    groups = KVGroups.of(ModelConfig(**base, n_layers=8, layer_types=types))
    assert groups.group_size == 3 and groups.windows == (None, 8, 8)
    assert groups.layer_group == (1, 0, 1, 0, 1, 0, 2, 2) and groups.layer_slot == (0, 0, 1, 1, 2, 2, 0, 1)
    assert [groups.layers(g) for g in range(3)] == [3, 3, 2]
    # No sliding layer: one group of every layer, a tensor each (the pool of before).
    groups = KVGroups.of(ModelConfig(**{**base, "sliding_window": None}, n_layers=4))
    assert groups.windows == (None,) and groups.group_size == 4 and groups.layer_slot == (0, 1, 2, 3)


def test_a_prefix_hit_needs_the_full_blocks_and_the_window_before_the_hit_point():
    W, bt = 6, 4
    m = hybrid(16, window=W)
    prompt = list(range(100, 117))  # 4 full blocks and a token
    assert m.allocate(0, prompt, len(prompt)) == 0
    m.cache_blocks(0, prompt, len(prompt))
    m.free_out_of_window(0, 17)  # keys 12..17: blocks 0, 1, 2 (0..11) leave the sliding group (stay cached)
    m.free(0)
    chain = []
    for i in range(4):
        chain.append(block_hash(chain[-1] if chain else None, prompt[i * bt:(i + 1) * bt]))
    # One pool, two copies of each block: each group's under its own key, in distinct pages.
    assert all(m.pool.cached[0, d] != m.pool.cached[1, d] for d in chain) and len(m.pool.cached) == 8
    # Everything is still cached in both groups: a hit of 4 blocks (16 tokens); the window before position 16
    # is 11..15, blocks 2 and 3, so the sliding table is [null, null, b2, b3].
    assert m.allocate(1, prompt, 1) == 16
    assert m.groups[1].tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in m.groups[1].tables[1][2:]
    m.free(1)
    # Evict the sliding group's copy of block 2 (positions 8..11): a hit of 4 needs it (11 is in the window
    # before 16); a hit of 3 (12 tokens) needs 7..11, blocks 1 and 2: gone too; a hit of 2 (8 tokens) needs
    # 3..7, blocks 0 and 1: both cached. So the hit shortens to 2 blocks.
    victim = m.pool.cached.pop((1, chain[2]))
    m.pool.hash[victim] = None
    assert len(m.cached_prefix(prompt)) == 2
    assert m.allocate(2, prompt, 9) == 8
    # The full group alone would have hit 4: all its blocks are cached.
    assert all(m.pool.lookup((0, d)) is not None for d in chain)


# ---------------------------------------------------------------- the scheduler over a simulated hybrid model


W_SIM = 6


def windowed_model(context):
    """A stand-in hybrid model: a full layer's term over every token before, a sliding layer's over the last
    W_SIM (order matters in both)."""
    full = sum((i + 1) * t for i, t in enumerate(context))
    window = sum((i + 3) * t for i, t in enumerate(context[-W_SIM:]))
    return (full * 2654435761 + window * 40503) % 97


def windowed_reference(prompt, max_tokens):
    out = list(prompt)
    for _ in range(max_tokens):
        out.append(windowed_model(out))
    return out[len(prompt):]


class HybridEngine:
    """The ranks, simulated: each scheduled token is written to both groups' slots its tables name; the next token
    reads the full context through the full table and the window through the sliding table (a null entry there is
    never written: reading one fails)."""

    def __init__(self, sched):
        self.sched, self.store, self.free_pages = sched, {}, []

    def step(self, plan):
        bt = self.sched.blocks.block_tokens
        sampled = {}
        for seq_id, n in scheduled(plan).items():
            seq, (full, sliding) = self.sched.seqs[seq_id], plan.tables[seq_id]
            for p in range(seq.num_computed, seq.num_computed + n):
                assert sliding[p // bt] != NULL_BLOCK, (seq_id, p)
                self.store["full", full[p // bt], p % bt] = seq.tokens[p]
                self.store["sliding", sliding[p // bt], p % bt] = seq.tokens[p]
            end = seq.num_computed + n
            if end == len(seq.tokens):
                context = [self.store["full", full[p // bt], p % bt] for p in range(end)]
                window = [self.read(sliding, p) for p in range(max(0, end - W_SIM), end)]
                assert window == context[-W_SIM:]
                sampled[seq_id] = windowed_model(context)
        self.free_pages.append(self.sched.blocks.pool.num_free)
        self.sched.update(plan, sampled, {}, written=scheduled(plan))

    def read(self, sliding_table, p):
        bt = self.sched.blocks.block_tokens
        assert sliding_table[p // bt] != NULL_BLOCK, f"position {p} in the window was freed"
        return self.store["sliding", sliding_table[p // bt], p % bt]


def run_hybrid(sched, requests, steps=2000):
    engine = HybridEngine(sched)
    for rid, (prompt, n) in requests.items():
        sched.add_request(rid, prompt, n)
    seqs = dict(sched.seqs)
    for _ in range(steps):
        if not sched.has_work():
            break
        engine.step(sched.schedule())
    assert not sched.has_work()
    return {rid: s.tokens[s.prompt_len:] for rid, s in seqs.items()}, engine


def test_windowed_sequences_generate_exactly_while_their_old_blocks_are_freed():
    # 3 requests of 35-45 tokens in 48 pages: each holds at most 12 full blocks and, in the sliding group, the
    # blocks of a chunk of 8 and the window before it (13 positions: at most 4): 3 x 16 = 48 always fit, though
    # keeping every sliding block (3 x 24) would not.
    requests = {i: ([(7 * i + j) % 50 for j in range(20 + 5 * i)], 15) for i in range(3)}
    sched = PagedScheduler(hybrid(48, window=W_SIM), max_num_batched_tokens=8, max_num_seqs=3)
    out, engine = run_hybrid(sched, requests)
    for rid, (prompt, n) in requests.items():
        assert out[rid] == windowed_reference(prompt, n), rid
    assert sched.num_preemptions == 0 and min(engine.free_pages) >= 0 and sched.blocks.pool.num_free == 48


def test_windowed_sequences_preempt_recompute_and_hit_the_prefix_exactly():
    shared = [(3 * j + 1) % 50 for j in range(16)]
    requests = {0: (shared + [1, 2, 3], 20), 1: (shared + [9], 20), 2: (shared + [4, 4], 18), 3: ([5] * 11, 25)}
    sched = PagedScheduler(hybrid(30, window=W_SIM), max_num_batched_tokens=6, max_num_seqs=4)
    out, _ = run_hybrid(sched, requests)
    for rid, (prompt, n) in requests.items():
        assert out[rid] == windowed_reference(prompt, n), rid
    assert sched.num_preemptions > 0 and sched.blocks.prefix_hits > 0


def test_stand_in_model_without_windows_still_schedules_as_before():
    # One full group: the manager is the cache of before (no null block, nothing freed).
    m = KVBlockManager(16, 4)
    assert len(m.groups) == 1 and m.groups[0].window is None and m.max_chunk_tokens(11) is None
    assert m.pool.total == 16 and 0 in m.pool.free_queue and m.capacity_tokens == 64
    sched = PagedScheduler(m, max_num_batched_tokens=8)
    sched.add_request(0, [1, 2, 3, 4, 5], 6)
    out, _ = drive(sched)
    assert out[0] == stand_in_reference([1, 2, 3, 4, 5], 6)


# ---------------------------------------------------------------- the real serving core, against transformers

pytest.importorskip("transformers")

from test_hybrid import make_hf, ours_from_hf  # noqa: E402
from test_serve_batch import serving  # noqa: E402

WINDOW = 5
BS = 2  # tokens per block: a window of 5 spans 3 or 4 of them
PROMPT = [(11 * j + 3) % 101 for j in range(14)]  # longer than the window


def hf_greedy(hf, prompt, n):
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gemma():
    hf = make_hf("gemma3", WINDOW)
    return hf, ours_from_hf(hf)


@pytest.fixture(scope="module")
def mistral():
    hf = make_hf("mistral", WINDOW)
    return hf, ours_from_hf(hf)


def serve_hybrid(model, requests, waves=1, limit=400, **options):
    """Drive the serving core (test_serve_batch.serving) over ``requests`` (Admissions; with ``waves`` 2, the
    second half is submitted once the first has ended); returns tokens, the fewest free pages seen (once each step
    is planned, its blocks taken), and the runner and scheduler."""
    runner, scheduler, http = serving(model, block_size=BS, **options)
    blocks = scheduler.paged.blocks
    sliding = [g for g in blocks.groups if g.window is not None][0]
    half = len(requests) // waves
    pending = [requests[:half], requests[half:]] if waves == 2 else [requests]
    tokens, ended, least_free, freed_while_running, most_running = {}, {}, blocks.pool.total, 0, 0
    for _ in range(limit):
        if not scheduler.has_work() and not scheduler.admissions:
            if not pending:
                break
            for a in pending.pop(0):
                http.send(("submit", a))
        scheduler.receive(0)
        plan = scheduler.plan(0)
        least_free = min(least_free, blocks.pool.num_free)
        most_running = max(most_running, len(scheduler.paged.running))
        for tables in plan.tables.values():
            freed_while_running += sum(b == NULL_BLOCK for b in tables[blocks.groups.index(sliding)])
        result = runner.step(plan)
        scheduler.after(result)
        for rid, t in result.tokens:
            tokens.setdefault(rid, []).append(t)
        ended.update(result.finished + scheduler.dropped)
        scheduler.dropped = []
    else:
        raise AssertionError(f"the requests did not end in {limit} steps: {ended}")
    assert all(ended[a.request_id] == "length" for a in requests)
    return dict(tokens=tokens, least_free=least_free, null_entries=freed_while_running, most_running=most_running,
                runner=runner, scheduler=scheduler)


def null_blocks_untouched(runner):
    """Every sliding layer's null block still holds zeros: nothing was ever written there."""
    pool = runner.pool
    for layer, g in enumerate(pool.layer_group):
        if pool.groups.windows[g] is not None:
            assert not pool.k[layer][NULL_BLOCK].any() and not pool.v[layer][NULL_BLOCK].any(), layer


def test_gemma3_paged_decode_past_the_window_equals_transformers_and_frees_sliding_blocks(gemma):
    hf, model = gemma
    n = 12
    got = serve_hybrid(model, [Admission(0, PROMPT, n)], num_blocks=32, prefill_chunk=4, max_model_len=64)
    assert got["tokens"][0] == hf_greedy(hf, PROMPT, n)
    blocks = got["scheduler"].paged.blocks
    assert [g.window for g in blocks.groups] == [None, WINDOW]
    # 31 pages and the null one. 14 + 12 - 1 = 25 positions: 13 blocks of 2 in the full group at the last step;
    # the sliding group then holds window_blocks(5, 2) = 3 (positions 20..24), so 16 pages are the most in use
    # (while a chunk of 4 was prefilled, c - 4 .. c + 3 at c <= 12: at most 7 full blocks and 4 sliding ones).
    assert got["least_free"] == 31 - 16 and got["null_entries"] > 0
    null_blocks_untouched(got["runner"])


def test_gemma3_paged_preempts_recomputes_and_hits_the_prefix_exactly(gemma):
    hf, model = gemma
    shared = PROMPT[:12]  # 6 full blocks
    requests = [Admission(0, shared + [1, 2, 3], 10), Admission(1, shared + [7], 9), Admission(2, [4, 9] * 5, 11),
                Admission(3, shared + [1, 2, 3, 60], 6)]
    # 20 pages: the three first requests (up to 24 positions, 12 full blocks and 3 sliding ones each) cannot run
    # together.
    got = serve_hybrid(model, requests, waves=2, num_blocks=21, prefill_chunk=4, max_model_len=64,
                       max_num_seqs=3)
    for a in requests:
        assert got["tokens"][a.request_id] == hf_greedy(hf, a.prompt, a.max_tokens), a.request_id
    paged = got["scheduler"].paged
    assert paged.num_preemptions > 0 and paged.blocks.prefix_hits > 0
    null_blocks_untouched(got["runner"])


def test_mistral_every_layer_sliding_serves_sequences_longer_than_its_pool(mistral):
    hf, model = mistral
    prompt, n = PROMPT + PROMPT[:6], 20  # 20 + 20 - 1 = 39 positions: 20 blocks; the pool holds 6
    got = serve_hybrid(model, [Admission(0, prompt, n)], num_blocks=7, prefill_chunk=3, max_model_len=64)
    assert got["tokens"][0] == hf_greedy(hf, prompt, n)
    assert [g.window for g in got["scheduler"].paged.blocks.groups] == [WINDOW]


def test_several_sliding_groups_share_the_pool_and_many_sequences_equal_transformers():
    """7 layers, 5 sliding and 2 global: groups of 2 layers (1 full, 3 sliding, the last padded), every page 2 layers'
    block. Six requests at once in 80 pages: the full group's blocks and the three sliding groups' windows come and
    go in one pool, with preemptions; each request's greedy tokens equal transformers' for it alone."""
    S, F = "sliding_attention", "full_attention"
    hf = make_hf("gemma3", WINDOW, num_hidden_layers=7, layer_types=[S, S, F, S, S, F, S])
    model = ours_from_hf(hf)
    requests = [Admission(i, [(13 * i + 7 * j + 1) % 101 for j in range(8 + 2 * i)], 10 + i % 3) for i in range(6)]
    got = serve_hybrid(model, requests, num_blocks=80, prefill_chunk=4, max_model_len=64, max_num_seqs=6, budget=24)
    blocks, pool = got["scheduler"].paged.blocks, got["runner"].pool
    assert [g.window for g in blocks.groups] == [None, WINDOW, WINDOW, WINDOW] and len(pool.k_slots) == 2
    assert pool.layer_group == (1, 1, 0, 2, 2, 0, 3) and pool.groups.layer_slot == (0, 1, 0, 0, 1, 1, 0)
    for a in requests:
        assert got["tokens"][a.request_id] == hf_greedy(hf, a.prompt, a.max_tokens), a.request_id
    # All six ran at once (6 x 4 groups x 2 blocks of their first chunk of 4: 48 of 79 pages), then the pool ran
    # short as they grew (the longest, 18 + 11 - 1 = 28 positions, alone holds 14 full blocks and 3 x 3 sliding).
    assert got["most_running"] == 6 and got["scheduler"].paged.num_preemptions > 0 and got["null_entries"] > 0
    null_blocks_untouched(got["runner"])


def test_every_cached_block_of_each_group_equals_a_fresh_prefill(gemma):
    """tests/test_prefix_cache_invariant.py's check, per group: each group's cached blocks hold, in its own layers,
    what a fresh prefill of their token chain writes (K_V_ATOL as there: the same float32 math, chunked alike
    or not)."""
    from test_prefix_cache_invariant import K_V_ATOL

    _, model = gemma
    requests = [Admission(0, PROMPT, 8), Admission(1, PROMPT[:10] + [5, 5, 5], 6)]
    got = serve_hybrid(model, requests, num_blocks=40, prefill_chunk=4, max_model_len=64)
    runner, blocks = got["runner"], got["scheduler"].paged.blocks
    chains = {}
    for a in requests:
        tokens, parent = a.prompt + got["tokens"][a.request_id], None
        for i in range(len(tokens) // BS):
            parent = block_hash(parent, tokens[i * BS:(i + 1) * BS])
            chains[parent] = tokens[:(i + 1) * BS]
    checked = 0
    for (g, digest), block in dict(blocks.pool.cached).items():
        chain = chains[digest]
        fresh = serve_hybrid(model, [Admission(0, chain + [1], 1)], num_blocks=40, prefill_chunk=4, max_model_len=64)
        want = fresh["scheduler"].paged.blocks.pool.cached[g, digest]
        for layer in [i for i, lg in enumerate(runner.pool.layer_group) if lg == g]:
            for mine, theirs in ((runner.pool.k, fresh["runner"].pool.k), (runner.pool.v, fresh["runner"].pool.v)):
                torch.testing.assert_close(mine[layer][block, :, :BS], theirs[layer][want, :, :BS],
                                           atol=K_V_ATOL, rtol=0)
        checked += 1
    assert checked >= 2 * 6  # both groups cache the prompts' full blocks


def test_a_free_rule_one_position_early_reads_the_null_block_and_fails(monkeypatch):
    """The planted off-by-one: freeing the block of the oldest key a query still sees (q - W + 1) makes the
    simulated ranks read a null entry, so the exactness test above cannot pass with it."""
    import torchtsp.serve.blocks as blocks

    monkeypatch.setattr(blocks, "first_needed_block", lambda q, w, bt: max(0, q - w + 2) // bt)
    with pytest.raises(AssertionError, match="in the window was freed"):
        test_windowed_sequences_generate_exactly_while_their_old_blocks_are_freed()


# ---------------------------------------------------------------- every engine and layout, on 2 ranks

ENGINE_REQUESTS = [Admission(0, PROMPT[:12] + [1, 2, 3], 10), Admission(1, PROMPT[:12] + [7], 9),
                   Admission(2, [4, 9] * 5, 11), Admission(3, PROMPT[:12] + [1, 2, 3, 60], 6)]
# (scheme, kv_layout, model, tokens a block id covers at D = 2): TSP's three layouts (grouped with one KV head),
# TP, SP and DP.
ENGINE_RUNS = [("tsp", "heads", "gemma3", 1), ("tsp", "grouped", "gemma3-kv1", 2), ("tsp", "sequence", "gemma3", 2),
               ("tp", "auto", "gemma3", 1), ("sp", "auto", "gemma3", 2), ("dp", "auto", "gemma3", 1)]


def _hybrid_on_ranks(scheme: str, layout: str, cfg, state, token_ranks: int) -> dict:
    import torchtsp

    model = torchtsp.Transformer(cfg)
    model.load_state_dict(state)
    model = torchtsp.parallelize(model.eval(), torchtsp.init_mesh(**{scheme: 2}), scheme)
    # Pages for 28 tokens of the full group and 5 more: the first wave's three requests (up to 24 positions each)
    # preempt each other.
    got = serve_hybrid(model, ENGINE_REQUESTS, waves=2, num_blocks=28 // (BS * token_ranks) + 6, prefill_chunk=4,
                       max_model_len=64, kv_layout=layout, max_num_seqs=3)
    paged = got["scheduler"].paged
    null_blocks_untouched(got["runner"])
    return dict(tokens=got["tokens"], preemptions=paged.num_preemptions, hits=paged.blocks.prefix_hits,
                null_entries=got["null_entries"], block_tokens=got["runner"].block_tokens,
                layout=got["runner"].engine.kv_layout)


@pytest.fixture(scope="module")
def engine_models():
    out = {}
    for name, overrides in (("gemma3", {}), ("gemma3-kv1", {"num_key_value_heads": 1})):
        hf = make_hf("gemma3", WINDOW, **overrides)
        ours = ours_from_hf(hf)
        out[name] = (ours.cfg, ours.state_dict(), {a.request_id: hf_greedy(hf, a.prompt, a.max_tokens)
                                                   for a in ENGINE_REQUESTS})
    return out


@pytest.mark.parametrize("scheme,layout,name,token_ranks", ENGINE_RUNS,
                         ids=[f"{s}-{layout}" for s, layout, *_ in ENGINE_RUNS])
def test_every_engine_and_layout_serves_a_hybrid_model_as_transformers(pools, engine_models, scheme, layout, name,
                                                                       token_ranks):
    cfg, state, expected = engine_models[name]
    for got in pools(2).run(_hybrid_on_ranks, scheme, layout, cfg, state, token_ranks):
        assert got["block_tokens"] == BS * token_ranks
        assert got["tokens"] == expected, (scheme, got["layout"])
        assert got["preemptions"] > 0 and got["hits"] > 0 and got["null_entries"] > 0


def test_the_memory_model_counts_a_sliding_layers_paged_cache_as_its_window():
    from torchtsp.analysis.infer_memory import paged_kv_bytes
    from torchtsp.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

    types = (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    cfg = ModelConfig(dim=256, n_layers=6, n_heads=4, n_kv_heads=4, layer_types=types, sliding_window=64)
    slot = 2 * 4 * 4 * 64  # K and V, float32, 4 heads of 64
    # 2048 tokens in blocks of 16: the global layer 128 blocks, each local layer its window's 5 (64 positions
    # starting anywhere in a block).
    assert paged_kv_bytes(cfg, 2048, 4, 4, 16) == (1 * 128 + 5 * 5) * 16 * slot
    assert paged_kv_bytes(cfg.replace(layer_types=(), sliding_window=None), 2048, 4, 4, 16) == 6 * 128 * 16 * slot
    assert paged_kv_bytes(cfg, 40, 4, 4, 16) == 6 * 3 * 16 * slot  # shorter than the window: every block


def test_the_worker_sizes_one_pool_of_pages_within_the_budget_and_refuses_one_without_room_for_a_window(gemma):
    from torchtsp.infer import make_engine
    from torchtsp.serve.worker import pool_sizing

    _, model = gemma
    engine, cfg = make_engine(model), model.cfg
    slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # K and V of every KV head, float32, one layer
    sizing = pool_sizing(cfg, engine, BS, 100_000)
    # 4 layers, every second one global (Gemma 3's pattern 2), blocks of 2 tokens: groups of 2 layers, a page is
    # 2 layers' block; every page the budget buys, none set aside for a group.
    assert sizing.windows == (None, WINDOW) and sizing.group_size == 2 and sizing.bytes_per_page == 2 * BS * slot
    assert sizing.pages == 100_000 // (2 * BS * slot)
    sizing.check()
    pool = engine.kv_pool(sizing.pages, BS, grouped=True)
    full_layer, sliding_layer = pool.layer_group.index(0), pool.layer_group.index(1)
    # Two K tensors (one per place in a group), each [pages + the spare one, ...]; a full and a sliding layer of the
    # same place share one.
    assert len(pool.k_slots) == 2 and pool.k[full_layer].shape[0] == sizing.pages + 1
    assert pool.k[full_layer] is pool.k[sliding_layer] and pool.nbytes == sizing.pages * sizing.bytes_per_page
    # A window of 5 in blocks of 2 touches up to 3 blocks: with the null page and a full block, 5 pages at least.
    tight = pool_sizing(cfg, engine, BS, 4 * 2 * BS * slot)
    assert tight.pages == 4 and tight.least_pages == 5
    with pytest.raises(ValueError, match="raise --kv-cache-mb"):
        tight.check()


def test_the_capacity_benchmark_holds_3x_the_sequences_of_a_full_only_cache_at_half_length():
    """benchmarks/hybrid_cache_capacity.py's measure (the worker's sizing, the real pool and block manager), on a
    narrow 6-layer toy (5 local layers of W = 64, 1 global), pools sized for max_model_len 2048 in the same 12 MiB,
    sequences of 512, 1024 and 2048 tokens computed in chunks of 512 (blocks of 16).

    Full-only: 256 pages of 6 layers; a sequence of n tokens takes n / 16: 8, 4 and 2 sequences. Hybrid: 1536 pages
    of 1 layer (the null one among them); a computed sequence holds n / 16 full blocks and 4 blocks in each of 5
    sliding groups (its last 63 positions, aligned), 52, 84 and 148 pages; the last one needs, during its last
    chunk, n / 16 full blocks and the 36 blocks of that chunk and the window before it (fewer if the sequence has
    fewer) in each sliding group: 192, 244 and 308. So k sequences fit while (k - 1) x held + last <= 1535: 26, 16
    and 9 (3.25x, 4x, 4.5x). A split of the budget fixed for max-length sequences held 12, 11 and 8."""
    import importlib.util
    from pathlib import Path

    from torchtsp.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hybrid_cache_capacity.py"
    spec = importlib.util.spec_from_file_location("hybrid_cache_capacity", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = dict(dim=64, n_layers=6, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=64, max_seq_len=2048)
    types = (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    budget = 12 * 2**20  # 512 B per token and layer
    lengths = (512, 1024, 2048)
    full = bench.measure(ModelConfig(**base), budget, 16, 2048, 512, lengths)
    hybrid = bench.measure(ModelConfig(**base, layer_types=types, sliding_window=64), budget, 16, 2048, 512, lengths)
    assert (full["pages"], hybrid["pages"]) == (256, 1536)
    assert full["sequences"] == {512: 8, 1024: 4, 2048: 2}
    assert hybrid["sequences"] == {512: 26, 1024: 16, 2048: 9}
