"""Log-probabilities in serving (issue #37): the chosen tokens' and, on echo, the prompt tokens', exact against
an independent computation.

Engine level: ``BatchRunner`` on the reference engine and on 2-rank TSP (both schedules), TP and SP engines,
against log_softmax of the single-device model's whole-sequence forward. HTTP level: the official ``openai``
client against one 2-rank TSP server (module scoped) on a random tiny Hugging Face Llama, against transformers'
float32 log_softmax of the same checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchtsp
from torchtsp.config import ModelConfig
from torchtsp.infer import make_engine
from torchtsp.serve.batch import BatchRunner
from torchtsp.serve.plan import Admission, Sampling, StepPlan

TOL = 1e-4

# ---------------------------------------------------------------- engine level

# Request 1: greedy, logprobs and echo, a prompt over two prefill chunks; 2: sampled, logprobs of the raw
# distribution, no echo (a row of the group that does not ask for the prompt); 3: echo with max_tokens 0.
ENGINE_PROMPTS = {1: [5, 17, 3, 99, 42, 8, 8, 61, 2, 77, 100, 13, 4], 2: [9, 1, 33, 70, 5], 3: list(range(20, 31))}
ENGINE_REQUESTS = [Admission(1, ENGINE_PROMPTS[1], 5, Sampling(), logprobs=3, prompt_logprobs=3),
                   Admission(2, ENGINE_PROMPTS[2], 4, Sampling(0.8, 5, None, 11), logprobs=0),
                   Admission(3, ENGINE_PROMPTS[3], 0, Sampling(), prompt_logprobs=2)]


def _model() -> torchtsp.Transformer:
    torch.manual_seed(0)
    # 101 tokens: the last vocabulary slice over 2 ranks has a padding column.
    cfg = ModelConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def _serve(model, schedule: str = "auto") -> dict:
    """The three requests admitted together through a BatchRunner; per request: tokens, their logprobs, the
    prompt logprobs, how it ended."""
    runner = BatchRunner(make_engine(model), max_batch=3, max_model_len=48, prefill_chunk=8, schedule=schedule)
    out = {a.request_id: {"tokens": [], "logprobs": [], "prompt": None, "finish": None} for a in ENGINE_REQUESTS}
    for step in range(40):
        result = runner.step(StepPlan(step, admit=ENGINE_REQUESTS if step == 0 else []))
        for rid, token in result.tokens:
            out[rid]["tokens"].append(token)
        for rid, lp, top in result.logprobs:
            out[rid]["logprobs"].append((lp, top))
        for rid, entries in result.prompt_logprobs:
            out[rid]["prompt"] = entries
        for rid, reason in result.finished:
            out[rid]["finish"] = reason
        if all(o["finish"] for o in out.values()):
            return out
    raise AssertionError(f"the requests did not end: {out}")


def _on_ranks(scheme: str, schedule: str) -> dict:
    reference = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference), torchtsp.init_mesh(**{scheme: 2}), scheme).eval()
    return _serve(model, schedule)


def _reference_logprobs(ids: list[int]) -> torch.Tensor:
    """log_softmax [S, V] of the single-device model's forward over the whole sequence (no cache, no shards)."""
    with torch.no_grad():
        return torch.log_softmax(_model()(torch.tensor([ids])).double()[0], dim=-1)


def _check_entry(entry, want: torch.Tensor, token: int, n: int) -> None:
    lp, top = entry
    assert abs(lp - want[token].item()) < TOL, (lp, want[token].item())
    order = want.argsort(descending=True, stable=True)[:n]
    assert [t for t, _ in top] == order.tolist(), (top, order)
    assert all(abs(v - want[t].item()) < TOL for t, v in top)


def _check_served(out: dict) -> None:
    for a in ENGINE_REQUESTS:
        got, prompt = out[a.request_id], a.prompt
        assert got["finish"] == "length" and len(got["tokens"]) == a.max_tokens, got
        want = _reference_logprobs(prompt + got["tokens"])
        if a.logprobs is None:
            assert got["logprobs"] == []
        else:  # new token j is predicted by position len(prompt) - 1 + j
            assert len(got["logprobs"]) == a.max_tokens
            for j, (token, entry) in enumerate(zip(got["tokens"], got["logprobs"])):
                _check_entry(entry, want[len(prompt) - 1 + j], token, a.logprobs)
        if a.prompt_logprobs is None:
            assert got["prompt"] is None
        else:  # prompt token t is predicted by position t - 1; the first has none
            assert len(got["prompt"]) == len(prompt) and got["prompt"][0] is None
            for t in range(1, len(prompt)):
                _check_entry(got["prompt"][t], want[t - 1], prompt[t], a.prompt_logprobs)


def test_reference_engine_logprobs_equal_log_softmax_of_the_whole_sequence():
    _check_served(_serve(_model()))


@pytest.mark.parametrize("scheme,schedule", [("tsp", "weights"), ("tsp", "activations"), ("tp", "auto"),
                                             ("sp", "auto")])
def test_parallel_engines_logprobs_equal_log_softmax_of_the_whole_sequence(pools, scheme, schedule):
    for out in pools(2).run(_on_ranks, scheme, schedule):
        _check_served(out)


def test_plan_carries_the_logprob_counts_and_max_tokens_0_needs_echo():
    from torchtsp.serve.plan import admission_problem, decode, encode

    plan = StepPlan(3, [*ENGINE_REQUESTS, Admission(4, [1, 2], 2, Sampling(0.5, None, 0.9, 7), [3], True,
                                                    logprobs=20)])
    assert decode(*encode(plan)) == plan
    assert admission_problem(ENGINE_REQUESTS[2], 101, 48) is None
    no_echo = Admission(5, [1, 2], 0, Sampling())
    assert "max_tokens (0)" in admission_problem(no_echo, 101, 48)
    assert "outside [0, 20]" in admission_problem(Admission(6, [1], 1, Sampling(), logprobs=21), 101, 48)
