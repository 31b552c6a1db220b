"""The serve scheduler (``torchtsp.serve.worker.Scheduler``) itself, on a real BatchRunner over the reference
engine, fed over a pipe as the HTTP process feeds it; single process.

What a request needs is worked out here by hand: the reference engine's cache holds every token, so a
sequence prefilled in a group padded to P tokens that generates m tokens needs P + m - 1 cache slots of its
row (the last token chosen is never written back). Each scenario states the fit it relies on, then checks the
plans: who is admitted when, who waits, who is dropped and why; and, run to the end, that every admitted
request gets exactly what ``generate`` gives it alone (a plan that overfilled a row would raise or differ).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

import torchtsp
from torchtsp.config import ModelConfig
from torchtsp.infer import generate, make_engine
from torchtsp.serve import worker
from torchtsp.serve.batch import BatchRunner
from torchtsp.serve.plan import Admission
from torchtsp.serve.worker import Scheduler

MAX_MODEL_LEN = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)
    m = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.3)
    return m


class Served:
    """A scheduler over a fresh runner, the HTTP side of its pipe, and what came back per request."""

    def __init__(self, model, max_batch=4, prefill_chunk=64):
        self.model = model
        self.runner = BatchRunner(make_engine(model), max_batch=max_batch, max_model_len=MAX_MODEL_LEN,
                                  prefill_chunk=prefill_chunk)
        inbox, self.http = multiprocessing.Pipe()
        self.scheduler = Scheduler(self.runner, inbox)
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}
        self.requests: dict[int, Admission] = {}
        self.step_no = 0

    def submit(self, rid: int, prompt_len: int, max_tokens: int) -> None:
        a = Admission(rid, [(7 * rid + 3 * i) % 61 for i in range(prompt_len)], max_tokens)
        self.requests[rid] = a
        self.http.send(("submit", a))

    def cancel(self, rid: int) -> None:
        self.http.send(("cancel", rid))

    def step(self):
        """One engine step as rank 0 runs it; returns the plan."""
        self.scheduler.receive(0)
        plan = self.scheduler.plan(self.step_no)
        result = self.runner.step(plan)
        for rid, t in result.tokens:
            self.tokens.setdefault(rid, []).append(t)
        self.ended.update(result.finished + self.scheduler.dropped)
        self.scheduler.dropped = []
        self.step_no += 1
        return plan

    def run_out(self, limit: int = 200) -> None:
        while self.scheduler.waiting or self.runner.rows or self.runner.prefilling is not None:
            self.step()
            assert self.step_no < limit

    def check_alone(self, rid: int) -> None:
        a = self.requests[rid]
        assert self.tokens[rid] == generate(self.model, [a.prompt], a.max_tokens).new_tokens[0], rid
        assert self.ended[rid] == "length"


def admitted(plan) -> list[int]:
    return [a.request_id for a in plan.admit]


def test_reference_row_capacity_is_what_the_scheduler_checks_against(model):
    # The scenarios below size requests against this: a row holds max_model_len tokens (and a little slack).
    s = Served(model)
    assert MAX_MODEL_LEN <= s.runner.capacity <= MAX_MODEL_LEN + 4


def test_a_short_prompt_that_would_not_fit_next_to_a_longer_one_waits_for_the_next_group(model):
    s = Served(model)
    cap = s.runner.capacity
    s.submit(0, 20, 4)  # alone: 20 + 3 slots
    s.submit(1, 3, 30)  # alone: 3 + 29 = 32 slots fit; padded to 20 next to request 0: 20 + 29 = 49 do not
    assert 20 + 3 <= cap and 3 + 29 <= cap < 20 + 29
    assert admitted(s.step()) == [0]
    assert [a.request_id for a in s.scheduler.waiting] == [1]
    while s.runner.prefilling is not None:  # one group prefills at a time
        assert admitted(s.step()) == []
    assert admitted(s.step()) == [1]
    s.run_out()
    s.check_alone(0)
    s.check_alone(1)


def test_prompts_that_fit_together_are_prefilled_as_one_group(model):
    s = Served(model)
    for rid, (n, m) in enumerate([(9, 5), (4, 6), (12, 3)]):  # padded to 12: 12 + 5 slots at most, all fit
        s.submit(rid, n, m)
    assert admitted(s.step()) == [0, 1, 2]
    s.run_out()
    for rid in range(3):
        s.check_alone(rid)


def test_a_request_cancelled_while_queued_never_gets_a_row(model):
    s = Served(model, max_batch=1)
    s.submit(0, 5, 6)
    s.submit(1, 5, 6)
    s.submit(2, 5, 6)
    assert admitted(s.step()) == [0]  # one row: 1 and 2 queue
    s.cancel(1)
    plan = s.step()
    assert admitted(plan) == [] and plan.cancel == []  # nothing running is cancelled; 1 just leaves the queue
    assert s.ended[1] == "cancelled" and [a.request_id for a in s.scheduler.waiting] == [2]
    s.run_out()
    assert 1 not in s.tokens
    s.check_alone(0)
    s.check_alone(2)


def test_a_running_request_cancelled_leaves_in_the_next_plan(model):
    s = Served(model)
    s.submit(0, 5, 20)
    s.step()
    s.step()
    s.cancel(0)
    plan = s.step()
    assert plan.cancel == [0] and s.ended[0] == "cancelled" and not s.runner.rows
    assert len(s.tokens[0]) < 20
    assert s.tokens[0] == generate(s.model, [s.requests[0].prompt], 20).new_tokens[0][:len(s.tokens[0])]


def test_a_request_too_long_to_ever_fit_is_dropped_and_the_queue_moves_on(model):
    s = Served(model)
    cap = s.runner.capacity
    s.submit(0, 30, 20)  # 30 + 19 slots: more than a row holds, even alone
    s.submit(1, 6, 4)
    assert 30 + 19 > cap
    plan = s.step()
    # Rank 0 checks every request's bounds before the rows (prompt + max_tokens over --max-model-len): it is
    # refused there, and the queue moves on either way.
    assert admitted(plan) == [1] and s.ended[0] in ("rejected", "too_long")
    assert not s.scheduler.waiting
    s.run_out()
    assert 0 not in s.tokens
    s.check_alone(1)


def test_admission_is_first_come_first_served_and_nobody_is_overtaken(model):
    s = Served(model, max_batch=2)
    s.submit(0, 20, 4)
    s.submit(1, 3, 30)  # cannot join request 0's group (see above)
    s.submit(2, 3, 2)  # could join it, but arrived after 1: it must not overtake 1
    assert admitted(s.step()) == [0]
    assert [a.request_id for a in s.scheduler.waiting] == [1, 2]
    order = []
    while s.scheduler.waiting:
        order += admitted(s.step())
        assert s.step_no < 50  # request 1 is not starved behind later, easier requests
    assert order == [1, 2]
    s.run_out()
    for rid in range(3):
        s.check_alone(rid)


def test_a_full_batch_admits_the_oldest_waiting_request_when_a_row_frees(model):
    s = Served(model, max_batch=2)
    for rid, m in enumerate([3, 12, 5, 5]):
        s.submit(rid, 4, m)
    first = s.step()
    assert admitted(first) == [0, 1]
    order = []
    while s.scheduler.waiting:
        plan = s.step()
        order += admitted(plan)
        assert not plan.admit or s.ended.get(0) == "length"  # the first to finish freed the row
    assert order == [2, 3]
    s.run_out()
    for rid in range(4):
        s.check_alone(rid)


def test_a_group_is_capped_in_padded_tokens_but_a_long_prompt_still_runs_alone(model, monkeypatch):
    monkeypatch.setattr(worker, "PREFILL_GROUP_TOKENS", 24)
    s = Served(model)
    s.submit(0, 30, 2)  # 30 padded tokens alone: over the cap, but never blocked
    s.submit(1, 10, 2)  # next to request 0: 2 x 30 = 60 > 24, so the next group
    s.submit(2, 12, 2)  # next to request 1: 2 x 12 = 24 <= 24, one group
    s.submit(3, 5, 2)  # next to 1 and 2: 3 x 12 = 36 > 24, the group after
    plans = [admitted(s.step())]
    while s.scheduler.waiting:
        plan = s.step()
        if plan.admit:
            plans.append(admitted(plan))
    assert plans == [[0], [1, 2], [3]]
    s.run_out()
    for rid in range(4):
        s.check_alone(rid)


def test_stop_cancels_everything_running(model):
    s = Served(model)
    s.submit(0, 5, 20)
    s.submit(1, 6, 20)
    s.step()
    s.step()
    s.http.send(("stop",))
    plan = s.step()
    assert plan.stop and plan.cancel == [0, 1]
