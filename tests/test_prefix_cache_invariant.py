"""The prefix cache's invariant: a block enters it only once the ranks have written it.

The real serving core of one rank (``test_serve_batch.serving``: a BatchRunner over a paged pool and rank 0's
StepPlanner fed through a pipe) runs prompts of three full blocks and more, and each way a sequence can end before
or during its prefill: refused by the ranks (a grammar they cannot compile), cancelled while queued, mid-prefill,
decoding or preempted, preempted and recomputed, and a step that raises. Afterwards two things must hold:

- every block the prefix cache holds has the content a fresh prefill of its token chain writes (a fresh core,
  nothing cached, computes the same chain: a block the ranks never wrote holds zeros or another sequence's K/V);
- a later greedy request with the same prompt gets what ``generate`` gives it alone, without any cache.

Both on a dense toy and on a hybrid one (a tiny Gemma 3 with a window of 5: its sliding block group frees blocks
as they leave the window, and each group's cached blocks are checked in the group's own layers).
"""

from __future__ import annotations

import time

import pytest
import torch

from test_serve_batch import _model, serving
from torchtsp.infer import generate
from torchtsp.serve.blocks import block_hash
from torchtsp.serve.plan import Admission

xgr = pytest.importorskip("xgrammar")

BLOCK = 4  # tokens per block (one rank: a block id covers block_size tokens)
PROMPT = [5, 17, 33, 2, 61, 8, 90, 14, 27, 3, 44, 71, 9, 12]  # 3 full blocks and 2 tokens
OTHER = [7, 7, 21, 60, 19, 4, 88, 31, 56, 2, 13, 40, 77, 23, 6]  # another prompt of 3 full blocks, for pressure
UNCOMPILABLE = ("ebnf", "root ::= Token(999999)")  # parses; no vocabulary of 101 ids compiles it
K_V_ATOL = 1e-5  # the same float32 math on the same tokens, chunked alike or not: round-off only


class Core:
    """One rank's serving core, stepped by hand; records every request's tokens and how it ended."""

    def __init__(self, model, num_blocks=64, max_num_seqs=4, budget=8, prefix_caching=True):
        """``num_blocks``: blocks per block group; the groups share a pool of that many pages each."""
        from torchtsp.data.tokenizers import ByteTokenizer
        from torchtsp.kv_layouts import KVGroups
        from torchtsp.serve.structured import Grammars

        pages = num_blocks * len(KVGroups.of(model.cfg).windows)
        self.runner, self.scheduler, self.http = serving(
            model, num_blocks=pages, block_size=BLOCK, max_num_seqs=max_num_seqs, budget=budget,
            prefill_chunk=BLOCK, max_model_len=48, prefix_caching=prefix_caching,
            grammars=Grammars(ByteTokenizer(), model.cfg.vocab_size, None))
        self.prompts, self.tokens, self.ended = {}, {}, {}

    @property
    def blocks(self):
        return self.scheduler.paged.blocks

    def submit(self, rid: int, prompt: list[int], max_tokens: int, grammar=None) -> None:
        self.prompts[rid], self.tokens[rid] = list(prompt), []
        self.http.send(("submit", Admission(rid, list(prompt), max_tokens, grammar=grammar)))

    def cancel(self, rid: int) -> None:
        self.http.send(("cancel", rid))

    def step(self) -> None:
        s = self.scheduler
        s.receive(0)
        plan = s.plan(0)
        try:
            result = self.runner.step(plan)
        except RuntimeError:
            s.step_failed()  # what the worker does before the rank exits
            result = None
        else:
            s.after(result)
            for rid, token in result.tokens:
                self.tokens[rid].append(token)
        self.ended.update((result.finished if result else []) + s.dropped)
        s.dropped = []
        if s.compiling and not s.has_work():  # as the serve loop: wait for the compiling grammar, do not spin
            time.sleep(0.01)

    def run(self, *rids: int, limit: int = 60) -> None:
        for _ in range(limit):
            if all(r in self.ended for r in rids):
                return
            self.step()
        raise AssertionError(f"requests {rids} did not end in {limit} steps: {self.ended}")

    def state(self, rid: int):
        return self.scheduler.paged.seqs.get(rid)

    def step_until(self, rid: int, predicate, limit: int = 60) -> None:
        for _ in range(limit):
            if predicate(self.state(rid)):
                return
            self.step()
        raise AssertionError(f"request {rid} never reached the state asked for")

    def chains(self) -> dict[bytes, list[int]]:
        """Content address -> token chain, for every full-block prefix of every token list this core saw."""
        out = {}
        for rid, prompt in self.prompts.items():
            tokens, parent = prompt + self.tokens[rid], None
            for i in range(len(tokens) // BLOCK):
                parent = block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
                out[parent] = tokens[:(i + 1) * BLOCK]
        return out


def check_cached_blocks(core: Core, model) -> int:
    """Every cached block holds what a fresh prefill of its chain writes, in each block group (a hybrid model's groups
    share one pool of pages, serve/blocks.py: a page holds its group's layers, cached under (group, address));
    returns how many were checked."""
    chains, checked, pool = core.chains(), 0, core.runner.pool
    for (g, digest), block in dict(core.blocks.pool.cached).items():
        chain = chains[digest]
        fresh = Core(model)
        fresh.submit(0, chain + [1], 1)  # one more token: every block of the chain is full and written
        fresh.run(0)
        want, theirs = fresh.blocks.pool.cached[g, digest], fresh.runner.pool
        for layer in [i for i, lg in enumerate(pool.layer_group) if lg == g]:
            for got_kv, want_kv in ((pool.k, theirs.k), (pool.v, theirs.v)):
                torch.testing.assert_close(got_kv[layer][block, :, :BLOCK], want_kv[layer][want, :, :BLOCK],
                                           atol=K_V_ATOL, rtol=0)
        checked += 1
    return checked


def alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    return generate(model, [prompt], max_tokens).new_tokens[0]


def _refused(core: Core) -> None:
    core.submit(1, PROMPT, 4, grammar=UNCOMPILABLE)
    core.run(1)
    assert core.ended[1] == "bad_grammar"


def _cancelled_while_queued(core: Core) -> None:
    core.submit(1, OTHER, 6)
    core.submit(2, PROMPT, 4)  # max_num_seqs 1: it waits behind 1
    core.step()
    core.cancel(2)
    core.run(1, 2)
    assert core.ended[2] == "cancelled"


def _cancelled_mid_prefill(core: Core) -> None:
    core.submit(1, PROMPT, 4)
    core.step_until(1, lambda s: s is not None and 0 < s.num_computed < s.prompt_len)
    core.cancel(1)
    core.run(1)
    assert core.ended[1] == "cancelled"


def _cancelled_while_decoding(core: Core) -> None:
    core.submit(1, PROMPT, 8)
    core.step_until(1, lambda s: s is not None and s.num_generated >= 3)
    core.cancel(1)
    core.run(1)
    assert core.ended[1] == "cancelled"


def _preempted(core: Core) -> None:
    core.submit(1, OTHER, 10)
    core.submit(2, PROMPT, 10)
    core.run(1, 2)
    assert core.scheduler.paged.num_preemptions > 0 and core.ended == {1: "length", 2: "length"}


def _cancelled_while_preempted(core: Core) -> None:
    core.submit(1, OTHER, 10)
    core.submit(2, PROMPT, 10)
    core.step_until(2, lambda s: s is not None and s.status == "preempted")
    core.cancel(2)
    core.run(1, 2)
    assert core.ended[2] == "cancelled"


def _failed_step(core: Core) -> None:
    """The step after the first chunk raises inside the engine, as a broken collective would."""
    core.submit(1, PROMPT, 4)
    core.step_until(1, lambda s: s is not None and s.num_computed > 0)
    engine, real = core.runner.engine, core.runner.engine.prefill_chunk

    def broken(*args, **kwargs):
        real(*args, **kwargs)  # its K/V are half written when it fails
        raise RuntimeError("a collective timed out")

    engine.prefill_chunk = broken
    try:
        core.step()
    finally:
        engine.prefill_chunk = real
    assert core.ended[1] == "error" and core.scheduler.forget == {1} and 1 in core.runner.seqs
    core.step()  # the next plan has the ranks forget it
    assert 1 not in core.runner.seqs


# (scenario, core options): 8 blocks per group (32 tokens; the hybrid model's pool 16 pages, one of them null, and a
# sequence of 24 tokens holds 6 full blocks and 2 sliding ones) make two sequences of 24 tokens preempt one another.
SCENARIOS = {
    "refused by the ranks": (_refused, {}),
    "cancelled while queued": (_cancelled_while_queued, {"max_num_seqs": 1}),
    "cancelled mid-prefill": (_cancelled_mid_prefill, {}),
    "cancelled while decoding": (_cancelled_while_decoding, {}),
    "preempted and recomputed": (_preempted, {"num_blocks": 8}),
    "cancelled while preempted": (_cancelled_while_preempted, {"num_blocks": 8}),
    "a step that raises": (_failed_step, {}),
}


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def model(request):
    """The dense toy, and a tiny Gemma 3 from transformers (window 5, every second layer global): its paged cache
    has a sliding block group whose blocks leave the window while the scenarios run."""
    if request.param == "dense":
        return _model()
    pytest.importorskip("transformers")
    from test_hybrid import make_hf, ours_from_hf

    return ours_from_hf(make_hf("gemma3", 5))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_only_written_blocks_enter_the_prefix_cache(model, name):
    scenario, options = SCENARIOS[name]
    core = Core(model, **options)
    scenario(core)
    check_cached_blocks(core, model)
    # Later requests reuse whatever is cached: each gets what it gets alone, without a cache.
    later = {10: (PROMPT, 6), 11: (PROMPT + [50, 51, 52], 5), 12: (OTHER, 4)}
    for rid, (prompt, n) in later.items():
        core.submit(rid, prompt, n)
        core.run(rid)
        assert core.tokens[rid] == alone(model, prompt, n), (name, rid)
    assert check_cached_blocks(core, model) >= 3  # the later requests' own full blocks are cached
    assert not core.runner.seqs and core.blocks.usage == 0
