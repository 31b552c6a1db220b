"""The paged serving core against the real engines (issue #36 item 5): rank 0's scheduler and block manager
(``worker.Scheduler`` over ``PagedScheduler`` and ``KVBlockManager``) driving ``BatchRunner`` steps, on the
reference engine and on 2 ranks for tsp (sequence and heads layouts; grouped in the capacity test), tp and sp.

* allocation and growth: every plan's block tables hold exactly ceil(tokens / block_tokens) blocks, a table only
  grows at its end, and the sequences running together never share a block;
* preemption and recompute: a pool too small for the requests together preempts, and every request (greedy and
  seeded sampling) still gets exactly what ``generate`` gives it alone;
* prefix caching: requests sharing full blocks of a prefix hit them (in tokens), prefill only the rest, and give
  the same tokens with caching on and off; the least recently freed blocks are evicted first;
* capacity: with n_kv = 1 at D = 2 and the same bytes per rank, tsp's pool holds 2x the tokens of tp's;
* echo requests bypass the prefix cache and return every prompt position's logprob.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import torchtsp
from test_serve_batch import _model, serving
from torchtsp.infer import generate, make_engine
from torchtsp.serve.plan import Admission, Sampling

BS = 4  # block_size: tokens a rank stores per block

# Three requests of 20 cache slots each (prompt + max_tokens - 1): one fits alone in a pool of 32 slots, three
# together do not. Greedy and seeded sampling side by side.
PREEMPT = [Admission(0, [3, 1, 4, 1, 5, 9, 2], 14, Sampling()),
           Admission(1, [(11 * i + 5) % 101 for i in range(9)], 12, Sampling(0.8, 5, None, 11)),
           Admission(2, [42, 7, 7, 60, 1], 16, Sampling(1.0, None, 0.9, 3))]
POOL_TOKENS = 32

PREFIX = [(13 * i + 2) % 101 for i in range(16)]  # 4 blocks of 4 tokens, 2 of 8 (sequence layout at D = 2)


def shared(rid: int, suffix: list[int], max_tokens: int = 6, **kw) -> Admission:
    return Admission(rid, PREFIX + suffix, max_tokens, Sampling(), **kw)


def alone(reference, a: Admission) -> list[int]:
    s = a.sampling
    return generate(reference, [a.prompt], a.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                    seed=s.seed).new_tokens[0]


def serve(model, waves: list[list[Admission]], limit: int = 400, **options) -> dict:
    """Serve ``waves`` of requests (each wave is submitted once every earlier request has ended) through
    ``test_serve_batch.serving``'s StepPlanner and BatchRunner; returns what came back and, per plan, what the
    growth checks need."""
    runner, scheduler, http = serving(model, **options)
    blocks = scheduler.paged.blocks
    got = {"tokens": {}, "ended": {}, "prompt_logprobs": {}, "prefill": [], "tables": [], "shared_blocks": 0,
           "hits_after_wave": [], "queries": 0, "block_tokens": runner.block_tokens, "num_blocks": blocks.pool.total}
    pending = [list(w) for w in waves]
    for _ in range(limit):
        if not scheduler.has_work() and not scheduler.admissions:
            got["hits_after_wave"].append(blocks.prefix_hits)
            if not pending:
                break
            for a in pending.pop(0):
                http.send(("submit", a))
        scheduler.receive(0)
        plan = scheduler.plan(0)
        _record_tables(plan, runner, got)
        result = runner.step(plan)
        scheduler.after(result)
        for rid, t in result.tokens:
            got["tokens"].setdefault(rid, []).append(t)
        got["prompt_logprobs"].update(result.prompt_logprobs)
        got["ended"].update(result.finished + scheduler.dropped)
        scheduler.dropped = []
    else:
        raise AssertionError(f"the requests did not end in {limit} steps: {got['ended']}")
    got.update(preemptions=scheduler.paged.num_preemptions, queries=blocks.prefix_queries,
               free_at_end=blocks.pool.num_free)
    return got


def _record_tables(plan, runner, got: dict) -> None:
    """Per sequence with work: (its table, the tokens it has slots for once the step ran)."""
    tokens = {r: start + n for r, start, n in plan.prefill}
    tokens.update({r: len(runner.seqs[r].tokens) for r in plan.decode})  # the last token's K/V is written now
    got["tables"].append({r: (list(plan.tables[r][0]), n) for r, n in tokens.items()})  # one group: no window
    got["prefill"].append(list(plan.prefill))
    ids = [b for t in plan.tables.values() for b in t[0]]
    got["shared_blocks"] += len(ids) - len(set(ids))


def check_growth(got: dict) -> None:
    """Each table holds ceil(tokens / block_tokens) blocks, and a running sequence's table only grows at its end
    (a preemption may start it over)."""
    bt, last, grew = got["block_tokens"], {}, 0
    for step in got["tables"]:
        for rid, (table, tokens) in step.items():
            assert len(table) == math.ceil(tokens / bt), (rid, table, tokens, bt)
            before = last.get(rid)
            if before is not None and table[:len(before)] == before:
                grew += len(table) > len(before)
            last[rid] = table
    assert grew > 0


def check_alone(got: dict, reference, requests: list[Admission]) -> None:
    for a in requests:
        assert got["tokens"][a.request_id] == alone(reference, a), a.request_id
        assert got["ended"][a.request_id] == "length", a.request_id


# ---------------------------------------------------------------- allocation and growth, one rank


def test_a_sequence_decoding_past_several_blocks_grows_its_table_a_block_at_a_time():
    model = _model()
    a = Admission(0, [5, 6, 7, 8, 9, 10], 30, Sampling())  # 6 + 29 = 35 slots: 9 blocks of 4
    got = serve(model, [[a]], num_blocks=16, block_size=BS, prefill_chunk=4, max_model_len=64)
    lengths = [len(step[0][0]) for step in got["tables"]]
    tokens = [step[0][1] for step in got["tables"]]
    assert tokens == [4, 6, *range(7, 36)]  # two prompt chunks, then a decode per step
    assert lengths == [math.ceil(t / BS) for t in tokens] and lengths[-1] == 9
    tables = [step[0][0] for step in got["tables"]]
    assert all(t[:len(s)] == s for s, t in zip(tables, tables[1:]))  # blocks are never moved, only added
    assert len(set(tables[-1])) == 9 and got["free_at_end"] == 16
    check_alone(got, model, [a])


# ---------------------------------------------------------------- preemption and recompute


def test_reference_engine_preempts_and_recomputes_exactly():
    model = _model()
    got = serve(model, [PREEMPT], num_blocks=POOL_TOKENS // BS, block_size=BS, budget=16, prefill_chunk=8)
    assert got["preemptions"] > 0 and got["shared_blocks"] == 0
    check_growth(got)
    check_alone(got, model, PREEMPT)
    assert got["free_at_end"] == got["num_blocks"]


def _preempt_on_ranks(scheme: str, layout: str, token_ranks: int) -> dict:
    reference = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference), torchtsp.init_mesh(**{scheme: 2}), scheme).eval()
    got = serve(model, [PREEMPT], num_blocks=POOL_TOKENS // (BS * token_ranks), block_size=BS, budget=16,
                prefill_chunk=8, kv_layout=layout)
    got["alone"] = {a.request_id: alone(reference, a) for a in PREEMPT}
    return got


@pytest.mark.parametrize("scheme,layout,token_ranks", [("tsp", "sequence", 2), ("tsp", "heads", 1),
                                                       ("tp", "auto", 1), ("sp", "auto", 2)])
def test_parallel_engines_preempt_and_recompute_exactly(pools, scheme, layout, token_ranks):
    for got in pools(2).run(_preempt_on_ranks, scheme, layout, token_ranks):
        assert got["block_tokens"] == BS * token_ranks  # a block id covers block_size x the ranks sharing tokens
        assert got["preemptions"] > 0 and got["shared_blocks"] == 0
        check_growth(got)
        for a in PREEMPT:
            assert got["tokens"][a.request_id] == got["alone"][a.request_id], (scheme, layout, a.request_id)
            assert got["ended"][a.request_id] == "length"


# ---------------------------------------------------------------- prefix caching


def prefix_waves() -> list[list[Admission]]:
    """A request, then two sharing its 16-token prefix (full blocks) with their own suffixes."""
    return [[shared(0, [1, 2, 3])], [shared(1, [4, 5, 6]), shared(2, [7, 8, 9], 4)]]


def first_starts(got: dict) -> dict[int, int]:
    """Where each request's first prefill chunk starts."""
    firsts = {}
    for step in got["prefill"]:
        for rid, start, _ in step:
            firsts.setdefault(rid, start)
    return firsts


def check_prefix(on: dict, off: dict) -> None:
    bt, requests = on["block_tokens"], [a for w in prefix_waves() for a in w]
    cached = len(PREFIX) // bt * bt  # the prefix's full blocks
    assert cached == 16
    assert on["hits_after_wave"][:3] == [0, 0, 2 * cached] and off["hits_after_wave"][:3] == [0, 0, 0]
    assert on["queries"] == sum(len(a.prompt) for a in requests)
    assert first_starts(on) == {0: 0, 1: cached, 2: cached}  # the later prefills start past the hit
    assert first_starts(off) == {0: 0, 1: 0, 2: 0}
    computed = {rid: sum(n for step in on["prefill"] for r, _, n in step if r == rid) for rid in (1, 2)}
    assert computed == {1: 3, 2: 3}  # only the suffixes are prefilled
    assert on["tokens"] == off["tokens"]
    assert set(on["ended"].values()) == {"length"}


def test_requests_sharing_a_prefix_reuse_its_blocks_and_give_what_they_give_without():
    model = _model()
    runs = [serve(model, prefix_waves(), num_blocks=32, block_size=BS, prefix_caching=cache) for cache in (1, 0)]
    check_prefix(*runs)
    check_alone(runs[0], model, [a for w in prefix_waves() for a in w])


def test_a_prompt_made_of_cached_full_blocks_still_computes_its_last_token():
    # The 16-token prefix is 4 cached blocks; a prompt of exactly those tokens reuses 3 and computes the 4th
    # block's tokens, the last of which gives its first token.
    model = _model()
    again = Admission(1, list(PREFIX), 5, Sampling())
    waves = [[shared(0, [1, 2, 3])], [again]]
    got = serve(model, waves, num_blocks=32, block_size=BS)
    assert first_starts(got) == {0: 0, 1: 12} and got["hits_after_wave"][2] == 12
    check_alone(got, model, [a for w in waves for a in w])


def _prefix_on_ranks() -> tuple:
    reference = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference), torchtsp.init_mesh(tsp=2), "tsp").eval()
    runs = [serve(model, prefix_waves(), num_blocks=16, block_size=BS, kv_layout="sequence", prefix_caching=cache)
            for cache in (True, False)]
    return runs, {a.request_id: alone(reference, a) for w in prefix_waves() for a in w}


def test_sequence_layout_reuses_virtual_blocks_position_exactly(pools):
    for (on, off), want in pools(2).run(_prefix_on_ranks):
        assert on["block_tokens"] == 2 * BS  # two ranks each keep 4 of a block's 8 tokens
        check_prefix(on, off)
        assert on["tokens"] == want


def test_the_least_recently_freed_cached_blocks_are_evicted_first():
    # 16 blocks of 4. A and B (19 prompt tokens each, 4 full blocks cached) end in turn; X (44 tokens, 11
    # blocks) then takes the 6 never-used blocks, A's partial block, then A's 4 cached ones (freed before B's).
    model = _model()
    a_prompt, b_prompt = PREFIX + [1, 2, 3], [(5 * i + 1) % 101 for i in range(19)]
    x = Admission(2, [(3 * i + 50) % 101 for i in range(44)], 1, Sampling())
    waves = [[Admission(0, a_prompt, 1)], [Admission(1, b_prompt, 1)], [x], [Admission(3, b_prompt, 3)],
             [Admission(4, a_prompt, 3)]]
    got = serve(model, waves, num_blocks=16, block_size=BS, max_model_len=64)
    hits = got["hits_after_wave"]
    assert hits[:3] == [0, 0, 0] and hits[3] == 0  # X shares nothing
    assert hits[4] - hits[3] == 16  # B's blocks survived X
    assert hits[5] - hits[4] == 0  # A's were evicted
    check_alone(got, model, [a for w in waves for a in w])


# ---------------------------------------------------------------- capacity: tsp against tp at n_kv = 1


def _kv1_model():
    torch.manual_seed(0)
    cfg = dataclasses.replace(_model().cfg, n_kv_heads=1)
    model = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return model


CAPACITY_REQUESTS = [Admission(i, [(17 * i + 3 * j + 1) % 101 for j in range(8)], 11,
                               Sampling() if i % 2 else Sampling(0.9, None, None, i)) for i in range(4)]


def _capacity_on_ranks(scheme: str, budget_bytes: int) -> dict:
    """The pool the worker sizes (worker.run_serve_rank) for ``budget_bytes`` per rank, and the requests through
    it."""
    from torchtsp.kv_layouts import bytes_per_block

    reference = _kv1_model()
    model = torchtsp.parallelize(copy.deepcopy(reference), torchtsp.init_mesh(**{scheme: 2}), scheme).eval()
    engine, cfg = make_engine(model), reference.cfg
    per_block = bytes_per_block(cfg.n_layers, engine.kv_heads_per_rank, cfg.head_dim, engine.dtype.itemsize, BS)
    num_blocks = budget_bytes // per_block
    got = serve(model, [CAPACITY_REQUESTS], num_blocks=num_blocks, block_size=BS, budget=16, prefill_chunk=8,
                max_num_seqs=4)
    got.update(layout=engine.kv_layout, capacity=num_blocks * got["block_tokens"],
               alone={a.request_id: alone(reference, a) for a in CAPACITY_REQUESTS})
    return got


def test_tsp_caches_twice_the_tokens_of_tp_in_the_same_bytes_at_n_kv_1(pools):
    cfg = _kv1_model().cfg
    slot = 2 * cfg.n_layers * 1 * cfg.head_dim * 4  # K and V of one KV head, float32: what one rank keeps per slot
    budget = 12 * BS * slot  # 48 slots per rank
    # tp copies the one KV head to both ranks: 48 tokens. tsp's grouped layout deals the tokens over the 2 ranks
    # sharing the head: 96. Four requests of 8 + 11 - 1 = 18 tokens: 72 fit tsp's pool, not tp's.
    tp, tsp = pools(2).run(_capacity_on_ranks, "tp", budget), pools(2).run(_capacity_on_ranks, "tsp", budget)
    for got in tp + tsp:
        for a in CAPACITY_REQUESTS:
            assert got["tokens"][a.request_id] == got["alone"][a.request_id], (got["layout"], a.request_id)
    assert [g["capacity"] for g in tp] == [48, 48] and [g["capacity"] for g in tsp] == [96, 96]
    assert tsp[0]["layout"] == "grouped" and tsp[0]["capacity"] >= 1.9 * tp[0]["capacity"]
    assert all(g["preemptions"] > 0 for g in tp) and all(g["preemptions"] == 0 for g in tsp)


# ---------------------------------------------------------------- echo


def test_echo_requests_bypass_the_prefix_cache_and_return_every_prompt_position():
    model = _model()
    echo = shared(1, [4, 5, 6], 2, prompt_logprobs=2)
    waves = [[shared(0, [1, 2, 3])], [echo, shared(2, [7, 8, 9], 3)]]
    got = serve(model, waves, num_blocks=32, block_size=BS)
    assert first_starts(got) == {0: 0, 1: 0, 2: 16}  # the echo request computes its whole prompt; the other hits
    assert got["hits_after_wave"][2] == 16
    entries = got["prompt_logprobs"][1]
    assert len(entries) == len(echo.prompt) and entries[0] is None
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([echo.prompt])).double()[0], dim=-1)
    for t in range(1, len(echo.prompt)):  # prompt token t is predicted by position t - 1
        lp, top = entries[t]
        assert abs(lp - want[t - 1, echo.prompt[t]].item()) < 1e-4, t
        assert [i for i, _ in top] == want[t - 1].argsort(descending=True, stable=True)[:2].tolist()
    check_alone(got, model, [a for w in waves for a in w])
