"""Token sampling (``torchtsp.infer.sampling``, shared by the reference and parallel ``generate`` and by serve)
against Hugging Face's own logits processors, single process.

The distribution a token is drawn from is softmax of the scores transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` produce (in that order, as ``generate`` applies them):

* the filtered scores give exactly those probabilities;
* the selection itself, with Gumbel noise the test controls, picks argmax(HF scores + noise) for every draw:
  Gumbel-max then makes it an exact sample of HF's distribution (a wrong temperature, filter or noise slice
  changes many of the 20000 picks);
* with the selector's own seeded noise, the frequencies of 20000 draws match HF's probabilities;
* a seed reproduces its draws, another seed gives others, also through ``generate``.
"""

from __future__ import annotations

import pytest
import torch

import torchtsp
from torchtsp.distributed import AxisComm
from torchtsp.infer import generate
from torchtsp.infer.sampling import TokenSelector, filter_logits

transformers = pytest.importorskip("transformers")

V = 12
DRAWS = 20000
CASES = [  # (temperature, top_k, top_p): T != 1 both ways, each filter alone, both together
    (0.5, None, None),
    (2.0, None, None),
    (0.7, 4, None),
    (1.3, None, 0.8),
    (0.8, 5, 0.8),
    (1.7, 4, 0.7),
]


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(1, V, generator=g)  # spread so that T, top-k and top-p all matter, none keeps one token


def _hf_scores(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    scores = logits.clone()
    for warp in warpers:
        scores = warp(None, scores)
    return scores


def _selector(batch: int, temperature, top_k, top_p, seed: int = 0) -> TokenSelector:
    return TokenSelector(AxisComm(), V, 0, batch, slice(0, batch), temperature, top_k, top_p, seed, "cpu")


def _gumbel(n: int, seed: int) -> torch.Tensor:
    u = torch.rand(n, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (-torch.log(-torch.log(u.clamp_min(1e-300)))).float()


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_filtered_scores_give_transformers_probabilities(temperature, top_k, top_p):
    logits = _logits()
    want = _hf_scores(logits, temperature, top_k, top_p).softmax(-1)
    got = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    assert torch.equal(got > 0, want > 0), (got, want)  # the same tokens survive
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-6), (got, want)
    assert 1 < int((want > 0).sum()) < V or top_k is None and top_p is None  # the filter did cut, not everything


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_selection_with_known_noise_is_the_argmax_of_transformers_scores_plus_noise(temperature, top_k, top_p):
    logits = _logits()
    noise = _gumbel(DRAWS, seed=7)
    selector = _selector(DRAWS, temperature, top_k, top_p)
    selector.gumbel = lambda: noise  # the noise this test controls instead of the selector's generator
    got = selector(logits.expand(DRAWS, V).contiguous())
    want = (_hf_scores(logits, temperature, top_k, top_p) + noise).argmax(-1)
    assert torch.equal(got, want), int((got != want).sum())
    # The draws are a sample of HF's distribution (Gumbel-max), not of an unscaled / unfiltered one.
    freq = torch.bincount(got, minlength=V).double() / DRAWS
    p = _hf_scores(logits, temperature, top_k, top_p).softmax(-1)[0].double()
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / DRAWS).sqrt() + 1e-12).all(), (freq, p)


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_seeded_draws_follow_transformers_probabilities(temperature, top_k, top_p):
    logits = _logits()
    got = _selector(DRAWS, temperature, top_k, top_p, seed=3)(logits.expand(DRAWS, V).contiguous())
    freq = torch.bincount(got, minlength=V).double() / DRAWS
    p = _hf_scores(logits, temperature, top_k, top_p).softmax(-1)[0].double()
    # Within 4.5 standard errors per token; tokens HF removes are never drawn.
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / DRAWS).sqrt() + 1e-12).all(), (freq, p)
    assert (freq[p == 0] == 0).all()


def test_temperature_zero_is_the_argmax():
    logits = _logits().expand(3, V).contiguous()
    assert torch.equal(_selector(3, 0.0, None, None)(logits), logits.argmax(-1))


def test_a_seed_reproduces_and_another_seed_differs():
    logits = _logits().expand(64, V).contiguous()

    def draws(seed, case):
        selector = _selector(64, *case, seed=seed)
        return torch.stack([selector(logits) for _ in range(3)])

    for case in [(1.0, None, None), (0.8, 5, 0.9)]:
        first = draws(11, case)
        assert torch.equal(first, draws(11, case))
        assert not torch.equal(first, draws(12, case))
        assert not torch.equal(first[0], first[1])  # the generator advances between steps


def test_generate_with_a_seed_reproduces_and_another_seed_differs():
    torch.manual_seed(0)
    cfg = torchtsp.config.ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    kw = dict(temperature=1.5, top_k=20, top_p=0.95)
    first = generate(model, prompts, 12, seed=5, **kw).tokens
    assert generate(model, prompts, 12, seed=5, **kw).tokens == first
    assert generate(model, prompts, 12, seed=6, **kw).tokens != first
    assert generate(model, prompts, 12, seed=5, **{**kw, "temperature": 0.3}).tokens != first
