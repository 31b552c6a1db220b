"""The paged KV cache's rank-0 bookkeeping (serve/blocks.py) and its scheduling policy (serve/paged_scheduler.py),
driven directly: a block's bytes by hand, block tables, prefix caching and LRU eviction, the token budget,
preemption and recompute, cancellation, and a seeded random run whose "model" reads every token back through
the block tables from a simulated cache, so a block shared, evicted or reused wrongly changes the outputs
against a reference computed straight from the prompts."""

from __future__ import annotations

import random

import pytest

from torchtsp.kv_layouts import bytes_per_block
from torchtsp.serve.blocks import BlockPool, KVBlockManager
from torchtsp.serve.paged_scheduler import PagedScheduler, RequestTooLong, scheduled

# ---------------------------------------------------------------- a block's bytes, by hand


def test_bytes_per_block_by_hand():
    # K and V, 2 layers, 1 head, head_dim 64, bf16, 16 tokens: 2 * 2 * 1 * 64 * 2 * 16
    assert bytes_per_block(2, 1, 64, 2, 16) == 8192


# ---------------------------------------------------------------- block tables


def test_allocation_grows_block_by_block():
    m = KVBlockManager(10, 4)
    assert m.allocate(7, list(range(5)), 5) == 0
    assert len(m.tables[7]) == 2 and m.pool.num_free == 8
    assert m.append_slots(7, 3) and len(m.tables[7]) == 2  # 8 slots: still two blocks
    assert m.append_slots(7, 1) and len(m.tables[7]) == 3  # the 9th token opens a third
    assert m.append_slots(7, 31) and len(m.tables[7]) == 10 and m.pool.num_free == 0
    before = list(m.tables[7])
    assert not m.append_slots(7, 1) and m.tables[7] == before and m.slots[7] == 40  # short: nothing changed
    assert m.usage == 1.0
    m.free(7)
    assert m.pool.num_free == 10 and m.usage == 0.0 and 7 not in m.tables


def test_fits_ever():
    m = KVBlockManager(4, 16)
    assert m.fits_ever(64) and not m.fits_ever(65)


# ---------------------------------------------------------------- prefix caching


def _compute(m, seq, tokens):
    """Allocate ``tokens`` as a prompt and mark them all computed."""
    cached = m.allocate(seq, tokens, len(tokens) - len(m.cached_prefix(tokens)) * m.block_tokens)
    m.cache_blocks(seq, tokens, len(tokens))
    return cached


def test_prefix_reuse_counts_hits_in_tokens():
    m = KVBlockManager(16, 4)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert _compute(m, 0, a) == 0
    shared = m.tables[0][:2]
    b = a[:8] + [1, 2, 3]
    assert _compute(m, 1, b) == 8  # both full blocks reused while A still runs
    assert m.tables[1][:2] == shared and m.tables[1][2] not in m.tables[0]
    assert [m.pool.ref[x] for x in shared] == [2, 2]
    m.free(0)
    m.free(1)
    assert _compute(m, 2, a[:8]) == 4  # block-aligned prompt: its last token is computed again
    c = [999] + a[1:10]  # first block differs: the second, though equal in tokens, has another parent
    assert _compute(m, 3, c) == 0
    z = [5, 5, 5, 5, 6, 6, 6, 6, 0]
    _compute(m, 4, z)
    y = z[:4] + a[4:8] + [0]  # Z's first block, then A's second block: cached only after A's first
    assert _compute(m, 5, y) == 4
    assert (m.prefix_queries, m.prefix_hits) == (10 + 11 + 8 + 10 + 9 + 9, 8 + 4 + 4)


def test_prefix_caching_off_never_hits():
    m = KVBlockManager(16, 4, enable_prefix_caching=False)
    a = list(range(12))
    _compute(m, 0, a)
    m.free(0)
    assert _compute(m, 1, a) == 0 and m.prefix_hits == 0


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    m = KVBlockManager(4, 2)
    a, c = [1, 2, 3, 4], [9, 8, 7, 6]
    _compute(m, 0, a)
    m.free(0)  # A freed first: its blocks are the least recently used
    _compute(m, 1, c)  # takes the two never-used blocks
    m.free(1)
    assert m.pool.num_free == 4  # cached blocks count as free
    _compute(m, 2, [5, 5])  # one block: evicts A's tail, the oldest freed
    assert len(m.cached_prefix(a + [0])) == 1  # A's head survives
    assert len(m.cached_prefix(c + [0])) == 2  # C untouched
    m.free(2)
    _compute(m, 3, [6, 6, 6, 6])  # two blocks: A's head, then C's tail
    assert len(m.cached_prefix(a + [0])) == 0
    assert len(m.cached_prefix(c + [0])) == 1
    assert len(m.cached_prefix([5, 5, 0])) == 1  # freed last: still cached


def test_pool_refuses_double_release():
    p = BlockPool(2)
    b = p.take(1)
    p.release(b)
    with pytest.raises(RuntimeError, match="released more often"):
        p.release(b)


# ---------------------------------------------------------------- the scheduler, with a simulated cache


def model(context):
    """A stand-in model: the next token is a function of every token before it (order matters)."""
    return sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 % 97


def reference(prompt, max_tokens):
    out = list(prompt)
    for _ in range(max_tokens):
        out.append(model(out))
    return out[len(prompt):]


class Engine:
    """The ranks, simulated: writes each scheduled token into the slot its block table names, and samples
    from the context read back through the table (never from the scheduler's token lists)."""

    def __init__(self, sched):
        self.sched, self.store = sched, {}

    def step(self, plan):
        bt = self.sched.blocks.block_tokens
        sampled = {}
        for seq_id, n in scheduled(plan).items():
            seq, (table,) = self.sched.seqs[seq_id], plan.tables[seq_id]
            assert len(table) * bt >= seq.num_computed + n
            for p in range(seq.num_computed, seq.num_computed + n):
                self.store[table[p // bt], p % bt] = seq.tokens[p]
            if seq.num_computed + n == len(seq.tokens):
                sampled[seq_id] = model([self.store[table[p // bt], p % bt] for p in range(len(seq.tokens))])
        self.sched.update(plan, sampled, {}, written=scheduled(plan))
        return sampled


def num_tokens(plan) -> int:
    return sum(scheduled(plan).values())


def schedule(sched):
    """The next plan, and the sequences it admits (waiting before it, scheduled in it), in admission order."""
    waiting = [s.seq_id for s in sched.waiting]
    plan = sched.schedule()
    return plan, [s for s in waiting if s in scheduled(plan)]


def drive(sched, max_steps=500, on_plan=None, engine=None):
    """Run to completion; returns {seq id: generated tokens} and the (plan, admitted) pairs."""
    engine, generated, plans = engine or Engine(sched), {}, []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        plan, admitted = schedule(sched)
        plans.append((plan, admitted))
        if on_plan:
            on_plan(plan, admitted)
        for seq_id in list(scheduled(plan)):
            generated.setdefault(seq_id, sched.seqs[seq_id])
        engine.step(plan)
    assert not sched.has_work(), "did not finish"
    return {s: seq.tokens[seq.prompt_len:] for s, seq in generated.items()}, plans


def test_budget_is_shared_by_chunked_prefills_and_decodes():
    sched = PagedScheduler(KVBlockManager(64, 4), max_num_batched_tokens=16, max_num_seqs=8)
    prompts = {i: [i + 1] * 10 + [i] for i in range(3)}  # 11 tokens each, no shared prefix
    for i, p in prompts.items():
        sched.add_request(i, p, 3)
    engine = Engine(sched)
    p0 = sched.schedule()
    assert p0.prefill == [(0, 0, 11), (1, 0, 5)] and p0.decode == []
    engine.step(p0)
    p1 = sched.schedule()  # 0 decodes, 1 finishes its prompt, 2 starts with what is left
    assert p1.decode == [0] and p1.prefill == [(1, 5, 6), (2, 0, 9)] and num_tokens(p1) == 16
    engine.step(p1)
    p2 = sched.schedule()
    assert p2.decode == [0, 1] and p2.prefill == [(2, 9, 2)]
    with pytest.raises(RuntimeError, match="step 2 was scheduled but never updated"):
        sched.schedule()
    engine.step(p2)
    outputs, plans = drive(sched, engine=engine)
    assert all(num_tokens(p) <= 16 for p, _ in plans)
    assert outputs[2] == reference(prompts[2], 3)


def test_max_num_seqs_caps_the_running_batch():
    sched = PagedScheduler(KVBlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(4):
        sched.add_request(i, [i] * 3, 4)
    outputs, plans = drive(sched)
    assert all(len(scheduled(p)) <= 2 for p, _ in plans)
    assert outputs == {i: reference([i] * 3, 4) for i in range(4)}


def test_newest_is_preempted_and_recomputed_exactly():
    sched = PagedScheduler(KVBlockManager(6, 4), max_num_batched_tokens=64, max_num_seqs=2)
    prompts = {0: [3, 1, 4, 1, 5, 9, 2, 6], 1: [2, 7, 1, 8, 2, 8, 1, 8], 2: [1, 2]}
    for i, p in prompts.items():
        sched.add_request(i, p, 10)  # 8 + 10 - 1 = 17 tokens: 5 blocks each, 6 in the pool
    engine, seen = Engine(sched), []
    for _ in range(50):
        if seen:
            break
        plan = sched.schedule()
        if plan.preempted:
            seen = plan.preempted
            victim = sched.seqs[1]
            assert victim.status == "preempted" and victim.num_computed == 0
            assert [s.seq_id for s in sched.waiting] == [1, 2]  # back in front of the later request
            assert 1 not in sched.blocks.tables and 1 not in scheduled(plan) and 0 in scheduled(plan)
            recompute = list(victim.tokens)
            assert recompute[:8] == prompts[1] and len(recompute) > 8  # prompt + what it generated
        engine.step(plan)
    assert seen == [1] and sched.num_preemptions >= 1
    plan = sched.schedule()
    for _ in range(50):
        if 1 in scheduled(plan):
            break
        engine.step(plan)
        plan = sched.schedule()
    (seq_id, start, n), = [x for x in plan.prefill if x[0] == 1]
    assert start % 4 == 0 and start + n == len(recompute)  # from its cached prefix of whole blocks on
    assert sched.seqs[1].tokens == recompute
    engine.step(plan)
    outputs, _ = drive(sched, engine=engine)
    assert sched.seqs == {} and sched.blocks.pool.num_free == 6


def test_outputs_match_uninterrupted_runs_under_preemption():
    prompts = {i: [(7 * i + j) % 13 for j in range(6 + i)] for i in range(6)}
    small = PagedScheduler(KVBlockManager(8, 4), max_num_batched_tokens=12, max_num_seqs=6)
    for i, p in prompts.items():
        small.add_request(i, p, 9)
    outputs, plans = drive(small)
    assert small.num_preemptions > 0 and any(p.preempted for p, _ in plans)
    assert all(not admitted for p, admitted in plans if p.preempted)  # no admission in a step that preempts
    assert outputs == {i: reference(p, 9) for i, p in prompts.items()}
    assert small.blocks.pool.num_free == 8


def test_too_long_request_is_refused_naming_the_limit():
    sched = PagedScheduler(KVBlockManager(4, 16))  # 64 tokens
    sched.add_request(0, [1] * 60, 5)  # 64 tokens written: fits alone
    with pytest.raises(RequestTooLong, match="needs 65 tokens of KV cache .* whole cache holds 64 tokens"):
        sched.add_request(1, [1] * 60, 6)
    assert [s.seq_id for s in sched.waiting] == [0]


def test_fifo_admission_never_lets_a_later_request_overtake():
    sched = PagedScheduler(KVBlockManager(8, 4), max_num_batched_tokens=64, max_num_seqs=8)
    sched.add_request(0, [1] * 12, 5)  # 4 blocks at its end
    sched.add_request(1, [2] * 24, 9)  # 6 blocks for its prompt, beside 0's 3: must wait for 0
    sched.add_request(2, [3] * 2, 2)  # would fit beside 0, but arrived after 1
    order = []
    outputs, _ = drive(sched, on_plan=lambda p, admitted: order.extend(s for s in admitted if s not in order))
    assert order == [0, 1, 2]
    assert outputs[2] == reference([3] * 2, 2)


@pytest.mark.parametrize("where", ["queued", "running", "preempted"])
def test_cancellation_frees_exactly_its_blocks(where):
    m = KVBlockManager(6, 4, enable_prefix_caching=False)
    sched = PagedScheduler(m, max_num_batched_tokens=64, max_num_seqs=1 if where == "queued" else 4)
    sched.add_request(0, list(range(8)), 10)
    sched.add_request(1, list(range(20, 28)), 10)
    engine = Engine(sched)
    for _ in range(50):
        seq = sched.seqs[1]
        if seq.status == {"queued": "waiting", "running": "running", "preempted": "preempted"}[where]:
            if where != "running" or seq.num_computed > 0:
                break
        engine.step(sched.schedule())
    else:
        pytest.fail(f"sequence 1 never {where}")
    others = list(m.tables.get(0, []))
    assert sched.cancel(1)
    assert 1 not in m.tables and m.tables.get(0, []) == others and m.pool.num_free == 6 - len(others)
    assert 1 not in sched.seqs and 1 not in scheduled(sched.schedule())
    sched.cancel(0)
    assert m.pool.num_free == 6 and not sched.has_work() and not sched.cancel(0)


def check_invariants(sched, plan, admitted):
    m, pool = sched.blocks, sched.blocks.pool
    holders = {}
    for seq_id, table in m.tables.items():
        assert len(table) == m.blocks_for(m.slots[seq_id])
        for i, block in enumerate(table):
            holders.setdefault(block, []).append((seq_id, i))
    for block in range(pool.total):
        owners = holders.get(block, [])
        assert pool.ref[block] == len(owners)
        assert (block in pool.free_queue) == (not owners)
        if len(owners) > 1:  # shared only through the prefix cache: a full block at the same place
            assert pool.hash[block] is not None and len({i for _, i in owners}) == 1
    used = sum(1 for b in range(pool.total) if pool.ref[b])
    assert pool.num_free + used == pool.total
    assert all(pool.hash[b] == h for h, b in pool.cached.items())
    assert num_tokens(plan) <= sched.max_num_batched_tokens and len(sched.running) <= sched.max_num_seqs
    assert set(m.tables) == {s.seq_id for s in sched.running}
    assert not (plan.preempted and admitted), "admitted in a step that preempted"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_runs_keep_the_invariants_and_the_outputs(seed, caching):
    rng = random.Random(seed)
    sched = PagedScheduler(KVBlockManager(rng.randint(6, 14), rng.choice([2, 4]), enable_prefix_caching=caching),
                           max_num_batched_tokens=rng.randint(4, 24), max_num_seqs=rng.randint(2, 6))
    stems = [[rng.randrange(50) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    engine, requests, cancelled, next_id = Engine(sched), {}, set(), 0
    for _ in range(400):
        if next_id < 30 and rng.random() < 0.4:
            prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            max_tokens = rng.randint(1, 8)
            try:
                sched.add_request(next_id, prompt, max_tokens)
                requests[next_id] = (prompt, max_tokens, sched.seqs[next_id])
            except RequestTooLong:
                assert not sched.blocks.fits_ever(len(prompt) + max_tokens - 1)
            next_id += 1
        if sched.seqs and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.seqs))
            sched.cancel(victim)
            cancelled.add(victim)
        if sched.has_work():
            plan, admitted = schedule(sched)
            check_invariants(sched, plan, admitted)
            engine.step(plan)
        elif next_id >= 30:
            break
    assert not sched.has_work() and sched.blocks.pool.num_free == sched.blocks.pool.total
    done = {i: r for i, r in requests.items() if i not in cancelled}
    assert len(done) > 10
    for prompt, max_tokens, seq in done.values():
        assert seq.tokens[len(prompt):] == reference(prompt, max_tokens)
    if caching:
        assert sched.blocks.prefix_hits > 0


def test_a_waiting_prompt_is_hashed_once_however_long_it_waits(monkeypatch):
    """Admission looks its prompt's blocks up in the prefix cache every step while it waits: its content addresses
    are computed once (a prompt of 100 blocks was hashed twice per step before)."""
    from torchtsp.serve import blocks

    calls = []
    real = blocks.block_hash
    monkeypatch.setattr(blocks, "block_hash", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    sched = PagedScheduler(KVBlockManager(8, 4), max_num_batched_tokens=64, max_num_seqs=4)
    sched.add_request(0, [1] * 20, 10)  # 29 tokens: 8 blocks, the whole pool, for 10 steps
    sched.add_request(1, [2] * 17, 2)  # 4 full blocks it looks up while it waits
    engine = Engine(sched)
    for _ in range(6):
        engine.step(sched.schedule())
    # 0: its 5 full blocks looked up at admission, one more registered as it decodes; 1: its 4 looked up, once
    assert sched.seqs[1].status == "waiting" and len(calls) == 6 + 4
