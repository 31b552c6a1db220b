"""Sampling penalties: logit_bias, repetition, frequency and presence penalties on each rank's vocabulary slice,
min_p on the gathered distribution. Checked against transformers' ``RepetitionPenaltyLogitsProcessor`` and
``MinPLogitsWarper`` and against OpenAI's formula written here, on the full logits and with the vocabulary cut into
D slices as the ranks hold them (the last slice padded with -inf columns); then the serving core's greedy tokens
against a loop over the model's full forward with the same processors; then the HTTP checks (400 naming the
field). The 2-rank server check with the ``openai`` client is in test_serve_sampling.py (its server fixture)."""

from __future__ import annotations

import pytest
import torch

from torchtsp.serve.penalties import min_p_filter, penalize_slice, sampling_scores
from torchtsp.serve.plan import Admission, Sampling

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

V = 101
PROMPT = [3, 7, 7, 50, 99, 100]
GENERATED = [7, 12, 12, 12, 60, 0, 99]


def _logits(rows: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 4  # both signs, so both branches of the repetition penalty run


def _sharded(full: torch.Tensor, D: int, rows: list) -> torch.Tensor:
    """``penalize_slice`` run on each of D slices as the ranks hold them (the last padded with -inf columns),
    the slices put back together; the padding must stay -inf."""
    cols = -(-V // D)
    padded = torch.cat([full, torch.full((full.shape[0], cols * D - V), float("-inf"))], dim=1)
    out = torch.cat([penalize_slice(padded[:, r * cols:(r + 1) * cols], r * cols, rows) for r in range(D)], dim=1)
    assert torch.isneginf(out[:, V:]).all()
    return out[:, :V]


def _openai(logits: torch.Tensor, generated: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's documented formula, in float64: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty."""
    counts = torch.zeros(V, dtype=torch.float64)
    for t in generated:
        counts[t] += 1
    return logits.double() - counts * frequency - (counts > 0).double() * presence


@pytest.mark.parametrize("D", [1, 2, 3, 4])
def test_repetition_penalty_on_each_slice_equals_transformers(D):
    full = _logits()
    s = Sampling(repetition_penalty=1.7)
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([PROMPT + GENERATED] * 2), full.clone())
    got = _sharded(full, D, [(s, PROMPT, GENERATED), (s, PROMPT, GENERATED)])
    # The same float32 multiply or divide of each seen logit: bit for bit.
    assert torch.equal(got, want)
    assert not torch.equal(got, full)


@pytest.mark.parametrize("D", [1, 2, 3])
def test_frequency_and_presence_penalties_on_each_slice_equal_openais_formula(D):
    full = _logits()
    s = Sampling(frequency_penalty=0.75, presence_penalty=-1.25)
    got = _sharded(full, D, [(s, PROMPT, GENERATED), None])
    # float32 against float64: the penalty (at most 3 x 0.75 + 1.25) and the subtraction each round once in
    # float32, within 2 ulp of logits of magnitude < 32 (ulp 2^-19 ~ 2e-6).
    torch.testing.assert_close(got[0].double(), _openai(full[0], GENERATED, 0.75, -1.25), rtol=0, atol=4e-6)
    assert torch.equal(got[1], full[1])  # a row without penalties is left as it was
    untouched = [t for t in range(V) if t not in GENERATED]
    assert torch.equal(got[0, untouched], full[0, untouched])  # the prompt does not count for these two


@pytest.mark.parametrize("D", [1, 2, 3])
def test_all_penalties_together_in_vllms_order(D):
    """logit_bias, then the repetition penalty (transformers'), then OpenAI's frequency and presence penalties."""
    full = _logits(seed=1)
    bias = {0: 100.0, 7: -3.5, 55: 2.0, 100: -100.0}
    s = Sampling(logit_bias=bias, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6)
    biased = full.clone()
    for t, b in bias.items():
        biased[:, t] += b
    repeated = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([PROMPT + GENERATED] * 2), biased)
    want = _openai(repeated[0], GENERATED, 0.4, 0.6)
    got = _sharded(full, D, [(s, PROMPT, GENERATED), (Sampling(logit_bias={55: -1.0}), [1], [])])
    torch.testing.assert_close(got[0].double(), want, rtol=0, atol=3e-5)  # bias 100: |logits| < 128, ulp 2^-17
    assert torch.equal(got[1, 55], full[1, 55] - 1.0) and torch.equal(got[1, :55], full[1, :55])


@pytest.mark.parametrize("min_p,temperature,top_k", [(0.1, 1.0, None), (0.3, 0.7, None), (0.05, 1.3, 20),
                                                     (1.0, 1.0, None)])
def test_min_p_distribution_equals_transformers(min_p, temperature, top_k):
    """The distribution a sampling row draws from, against transformers' warpers in their order (temperature,
    top-k, min-p): the same tokens kept, the same probabilities."""
    full = _logits(seed=2)
    warpers = [TemperatureLogitsWarper(temperature), *([TopKLogitsWarper(top_k)] if top_k else []),
               MinPLogitsWarper(min_p)]
    want = LogitsProcessorList(warpers)(torch.zeros(2, 1, dtype=torch.long), full.clone())
    got = sampling_scores(full, Sampling(temperature, top_k, None, 0, min_p=min_p))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert 0 < int(torch.isfinite(got).sum()) < (2 * (top_k or V) if min_p < 1 else 3)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), rtol=0, atol=1e-7)  # same ops: a rounding at most
    assert torch.equal(min_p_filter(full, 0.0), full)


def test_the_runners_greedy_tokens_take_the_penalties():
    """The serving core (one rank) against a greedy loop over the model's full forward with transformers'
    repetition penalty and OpenAI's formula applied to the last logits: the same tokens; and a greedy request
    with a logit_bias of 100 on one id takes that id every time."""
    from test_serve_batch import _model, drive, serving

    model = _model()
    prompt, n = [5, 9, 5, 17, 3], 12
    s = Sampling(repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.5)
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([ids]))[:, -1].float()
            scored = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([ids]), last)[0]
            scored = _openai(scored, ids[len(prompt):], 0.9, 0.5)
            top2 = scored.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            ids.append(int(scored.argmax()))
    # The loop's forward and the paged engine round differently (~1e-6): an argmax decided by less could flip.
    assert min(margins) > 1e-4, margins
    plain = [Admission(2, prompt, n)]
    runner, scheduler, http = serving(model)
    out = drive(runner, scheduler, http, [Admission(1, prompt, n, s), *plain,
                                          Admission(3, prompt, n, Sampling(logit_bias={42: 100.0}))])
    assert out[1]["tokens"] == ids[len(prompt):]
    assert out[1]["tokens"] != out[2]["tokens"]  # the penalties changed the text
    assert out[3]["tokens"] == [42] * n


# ---------------------------------------------------------------- the HTTP side's checks (the service, no server)


@pytest.mark.parametrize("extra,words", [
    ({"presence_penalty": 2.5}, "[-2, 2]"), ({"frequency_penalty": -2.01}, "[-2, 2]"),
    ({"frequency_penalty": float("nan")}, "got nan"), ({"repetition_penalty": 0}, "[0.01, 100]"),
    ({"repetition_penalty": 1e9}, "[0.01, 100]"), ({"min_p": 1.5}, "[0, 1]"), ({"min_p": -0.1}, "[0, 1]"),
    ({"logit_bias": {"257": 1}}, "vocabulary [0, 257)"), ({"logit_bias": {"-1": 1}}, "'-1'"),
    ({"logit_bias": {"abc": 1}}, "'abc'"), ({"logit_bias": {"9" * 5000: 1}}, "not a token id"),
    ({"logit_bias": {"5": 101}}, "[-100, 100]"), ({"logit_bias": {"5": True}}, "True"),
    ({"logit_bias": {"5": "1"}}, "'1'"), ({"logit_bias": {str(i): 1 for i in range(2000)}}, "at most 1024"),
])
def test_out_of_range_penalties_are_400_naming_the_field(extra, words):
    pytest.importorskip("fastapi")
    from test_serve_hostile import _refusal

    e = _refusal({"prompt": "hi", "max_tokens": 2, **extra})
    field = next(iter(extra))
    assert e.status == 400 and e.param == field and words in e.message and len(e.message) < 300, (e.param, e.message)


def test_the_penalties_reach_the_engine_request():
    pytest.importorskip("fastapi")
    import asyncio
    import json

    from test_serve_hostile import _FakeClient, _state
    from torchtsp.serve.plan import admission_problem
    from torchtsp.serve.protocol import CompletionRequest, parse
    from torchtsp.serve.service import CompletionService

    raw = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "seed": 1, "min_p": 0.2, "presence_penalty": -0.5,
           "frequency_penalty": 1, "repetition_penalty": 1.1, "logit_bias": {"10": -100, "256": 7.5}}
    service = CompletionService(_state(_FakeClient()))
    choices = asyncio.run(service.completion_choices(parse(CompletionRequest, json.dumps(raw).encode())))
    want = Sampling(0.0, None, None, 1, 0.2, -0.5, 1.0, 1.1, {10: -100.0, 256: 7.5})
    assert choices[0].sampling == want
    assert admission_problem(Admission(1, choices[0].prompt, 2, want), 257, 64) is None  # rank 0 agrees
    default = asyncio.run(service.completion_choices(parse(CompletionRequest, b'{"prompt": "hi", "seed": 1}')))
    assert not default[0].sampling.penalized and default[0].sampling.min_p == 0.0
