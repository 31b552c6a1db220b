"""The serve scheduler (``torchtsp.serve.worker.Scheduler`` over the ``PagedScheduler`` and its
``KVBlockManager``) on a real BatchRunner over the reference engine, fed over a pipe as the HTTP process feeds
it; single process.

What a request needs is worked out here by hand: a sequence of P prompt tokens that generates m tokens needs
P + m - 1 cache slots (the last token chosen is never written back), in blocks of ``block_tokens`` slots
(the reference engine keeps every token: block_tokens = block_size). Each scenario states the fit it relies on,
then checks the plans: who is admitted when, who waits, who is dropped and why, which blocks come back; and,
run to the end, that every admitted request gets exactly what ``generate`` gives it alone.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchtsp
from test_serve_batch import serving
from torchtsp.config import ModelConfig
from torchtsp.infer import generate
from torchtsp.serve.plan import Admission

BS = 4  # block size: the reference engine's block covers 4 tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)
    m = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.3)
    return m


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / BS)


class Served:
    """rank 0's serve loop on one rank (``test_serve_batch.serving``), the HTTP side of its pipe, and what came
    back per request."""

    def __init__(self, model, **options):
        self.model = model
        options = {"block_size": BS, "max_model_len": 64, **options}
        self.runner, self.scheduler, self.http = serving(model, **options)
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}
        self.requests: dict[int, Admission] = {}
        self.step_no = 0

    @property
    def pool(self):
        return self.scheduler.paged.blocks.pool

    def submit(self, rid: int, prompt_len: int, max_tokens: int) -> None:
        a = Admission(rid, [(7 * rid + 3 * i + 1) % 61 for i in range(prompt_len)], max_tokens)
        self.requests[rid] = a
        self.http.send(("submit", a))

    def cancel(self, rid: int) -> None:
        self.http.send(("cancel", rid))

    def step(self):
        """One engine step as rank 0 runs it (worker._step_loop); returns the plan."""
        self.scheduler.receive(0)
        plan = self.scheduler.plan(self.step_no)
        result = self.runner.step(plan)
        self.scheduler.after(result)
        for rid, t in result.tokens:
            self.tokens.setdefault(rid, []).append(t)
        self.ended.update(result.finished + self.scheduler.dropped)
        self.scheduler.dropped = []
        self.step_no += 1
        return plan

    def run_out(self, limit: int = 200) -> None:
        while self.scheduler.has_work():
            self.step()
            assert self.step_no < limit

    def alone(self, rid: int) -> list[int]:
        a = self.requests[rid]
        return generate(self.model, [a.prompt], a.max_tokens).new_tokens[0]

    def check_alone(self, rid: int) -> None:
        assert self.tokens[rid] == self.alone(rid), rid
        assert self.ended[rid] == "length"

    def check_prefix_of_alone(self, rid: int) -> None:
        got = self.tokens.get(rid, [])
        assert len(got) < self.requests[rid].max_tokens and got == self.alone(rid)[:len(got)], rid


def admitted(plan) -> list[int]:
    return [a.request_id for a in plan.admit]


def test_admission_is_first_come_first_served_and_nobody_is_overtaken(model):
    # 12 blocks. Request 0 (24 + 11 tokens: 6 blocks for its prompt, growing to 9) takes the whole token budget
    # of the first step. Request 1's first chunk then needs 6 blocks of the 5 free; request 2 needs 1 and
    # would fit, but arrived after 1: it waits behind it.
    s = Served(model, num_blocks=12, budget=24, prefill_chunk=None, max_num_seqs=4)
    s.submit(0, 24, 12)
    s.submit(1, 24, 4)
    s.submit(2, 3, 3)
    assert admitted(s.step()) == [0]
    order, head_of_line = [], 0
    while s.scheduler.waiting:
        free = s.pool.num_free
        plan = s.step()
        order += admitted(plan)
        if not plan.admit and free >= blocks_for(3):
            head_of_line += 1  # request 2 alone would have fitted this step
        assert s.step_no < 60  # request 1 is not starved behind a later, easier request
    assert order == [1, 2] and head_of_line > 0
    assert s.scheduler.paged.num_preemptions == 0
    s.run_out()
    for rid in range(3):
        s.check_alone(rid)


def test_prompts_that_fit_the_budget_prefill_in_one_step_beside_decodes(model):
    s = Served(model, num_blocks=32, budget=16, prefill_chunk=8, max_num_seqs=4)
    s.submit(0, 5, 8)
    s.step()  # request 0's prompt; then it decodes
    for rid, n in [(1, 6), (2, 12)]:
        s.submit(rid, n, 5)
    plan = s.step()
    # budget 16: request 0's decode (1), request 1's prompt (6), 9 left: request 2's first chunk of 8
    assert plan.decode == [0] and plan.prefill == [(1, 0, 6), (2, 0, 8)] and admitted(plan) == [1, 2]
    s.run_out()
    for rid in range(3):
        s.check_alone(rid)


def test_a_request_cancelled_while_queued_never_reaches_the_ranks(model):
    s = Served(model, num_blocks=32, max_num_seqs=1)
    s.submit(0, 5, 6)
    s.submit(1, 5, 6)
    s.submit(2, 5, 6)
    assert admitted(s.step()) == [0]  # one sequence at a time: 1 and 2 queue
    s.cancel(1)
    plan = s.step()
    assert admitted(plan) == [] and plan.cancel == []  # the ranks never saw 1: nothing to forget
    assert s.ended[1] == "cancelled" and [q.seq_id for q in s.scheduler.waiting] == [2]
    assert s.pool.num_free == 32 - len(s.scheduler.paged.blocks.tables[0])  # request 1 never held a block
    s.run_out()
    assert 1 not in s.tokens and 1 not in s.runner.seqs
    s.check_alone(0)
    s.check_alone(2)


def test_a_running_request_cancelled_frees_its_blocks_at_once_and_the_ranks_forget_it(model):
    s = Served(model, num_blocks=32, prefix_caching=False)
    total = s.pool.num_free
    s.submit(0, 9, 20)
    for _ in range(5):
        s.step()
    assert 0 in s.runner.seqs and s.pool.num_free < total
    s.cancel(0)
    s.scheduler.receive(0)
    plan = s.scheduler.plan(s.step_no)
    assert s.pool.num_free == total  # before the ranks even run the step
    assert plan.cancel == [0] and s.scheduler.dropped == [(0, "cancelled")]
    s.runner.step(plan)
    assert 0 not in s.runner.seqs
    s.check_prefix_of_alone(0)


def test_a_preempted_request_cancelled_leaves_the_queue_and_the_ranks(model):
    # 8 blocks; two requests of 6 + 20 - 1 = 25 tokens (7 blocks each): the newer is preempted to let the
    # older grow, then cancelled while it waits to be recomputed.
    s = Served(model, num_blocks=8, budget=16, prefill_chunk=8, max_num_seqs=2, prefix_caching=False)
    s.submit(0, 6, 20)
    s.submit(1, 6, 20)
    while not s.scheduler.paged.num_preemptions:
        s.step()
        assert s.step_no < 40
    paged = s.scheduler.paged
    assert paged.seqs[1].status == "preempted" and 1 not in paged.blocks.tables and 1 in s.runner.seqs
    free = s.pool.num_free
    assert free == 8 - len(paged.blocks.tables[0])
    s.cancel(1)
    plan = s.step()
    assert plan.cancel == [1] and s.ended[1] == "cancelled" and 1 not in s.runner.seqs
    assert 1 not in paged.seqs and not paged.waiting
    assert s.pool.num_free >= free - 1  # nothing came back to request 1; request 0 may grow by a block
    s.run_out()
    s.check_alone(0)
    s.check_prefix_of_alone(1)
    assert s.pool.num_free == 8


def test_a_request_too_long_to_ever_fit_is_dropped_and_the_queue_moves_on(model):
    # 8 blocks of 4: the whole cache holds 32 tokens. 30 + 3 - 1 = 32 fit exactly; 30 + 4 - 1 = 33 never do.
    s = Served(model, num_blocks=8, max_model_len=64)
    assert s.scheduler.paged.blocks.capacity_tokens == 32
    s.submit(0, 30, 4)
    s.submit(1, 30, 3)
    plan = s.step()
    assert s.ended[0] == "too_long" and admitted(plan) == [1]
    s.run_out()
    assert 0 not in s.tokens and 0 not in s.runner.seqs
    s.check_alone(1)


def test_stop_cancels_everything_and_frees_every_block(model):
    s = Served(model, num_blocks=32, max_num_seqs=2)
    s.submit(0, 5, 20)
    s.submit(1, 6, 20)
    s.submit(2, 4, 20)  # queued behind the sequence cap
    s.step()
    s.step()
    s.http.send(("stop",))
    plan = s.step()
    assert plan.stop and plan.cancel == [0, 1]
    assert sorted(s.ended.items()) == [(0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert not s.runner.seqs and s.pool.num_free == 32 and not s.scheduler.has_work()


def test_draining_finishes_what_runs_and_fails_what_waits(model):
    s = Served(model, num_blocks=32, max_num_seqs=2)
    for rid in range(3):
        s.submit(rid, 5, 6)
    s.step()
    s.http.send(("drain",))
    s.run_out()
    assert s.ended[2] == "cancelled" and 2 not in s.tokens
    s.check_alone(0)
    s.check_alone(1)
    assert s.pool.num_free == 32
