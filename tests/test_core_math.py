"""Core math on one process, against transformers or arithmetic written here: the inference path of the reference
model (KV cache, its masked attention with GQA), the loss's ignored targets, the LR schedule and the AdamW step.
Each test here fails for one of the plausible one-line bugs planted in a scratch copy (see the mutation table of
the change that added it)."""

from __future__ import annotations

import math

import pytest
import torch

import torchtsp
from torchtsp.infer import generate
from torchtsp.train.optim import build_adamw, warmup_cosine

transformers = pytest.importorskip("transformers")

from test_infer import make_hf  # noqa: E402
from torchtsp.hf import config_from_hf, from_hf_state_dict  # noqa: E402


def _hf_gqa():
    """A random Llama with 8 query heads over 2 KV heads (g = 4), RoPE and norms far from trivial."""
    return make_hf(dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96))


def test_one_device_generate_with_its_kv_cache_equals_transformers():
    """Greedy decoding of prompts of different lengths in one batch (the cache holds padding): every step's
    logits equal transformers' full forward over the prompt and the tokens chosen so far, run per prompt."""
    hf = _hf_gqa()
    cfg = config_from_hf(hf.config.to_dict())
    model = torchtsp.Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    model.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(101, (n,), generator=g).tolist() for n in (5, 11, 8)]
    new = 6
    result = generate(model, prompts, new, return_logits=True, prefill_chunk=4)
    for i, (prompt, seq) in enumerate(zip(prompts, result.tokens)):
        assert seq[:len(prompt)] == prompt and len(seq) == len(prompt) + new
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, len(prompt) - 1:-1]  # the logits each new token came from
        got = torch.stack([step[i] for step in result.logits])
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5, i
        assert seq[len(prompt):] == want.argmax(-1).tolist(), i


def test_the_loss_averages_only_targets_that_are_not_ignored():
    torch.manual_seed(0)
    cfg = torchtsp.ModelConfig(vocab_size=53, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                               max_seq_len=16)
    model = torchtsp.Transformer(cfg).eval()
    tokens = torch.randint(53, (2, 9))
    labels = torch.randint(53, (2, 9))
    labels[0, :4] = -100
    labels[1, 7:] = -100
    with torch.no_grad():
        logp = model(tokens).double().log_softmax(-1)
        kept = [(b, t) for b in range(2) for t in range(9) if labels[b, t] != -100]
        want = -sum(logp[b, t, labels[b, t]] for b, t in kept) / len(kept)
        assert model.loss(tokens, labels).item() == pytest.approx(want.item(), rel=1e-5)
        terms = model.loss_terms(tokens, labels)
        assert terms.count.item() == len(kept) == 12
        assert terms.nll_sum.item() == pytest.approx(want.item() * len(kept), rel=1e-5)


def test_warmup_cosine_by_hand():
    # 12 steps, 3 of warmup: 1/3, 2/3, 1; then the cosine over the 8 steps 3..11 from 1 down to min_ratio.
    lr = [warmup_cosine(s, 12, 3, 0.1) for s in range(12)]
    assert lr[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert lr[7] == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert lr[5] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr[11] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[2:], lr[3:]))


def test_adamw_steps_by_hand():
    """Two AdamW steps (betas 0.9 / 0.95, eps 1e-8, bias-corrected, decoupled weight decay) in float64; norm
    weights get no decay."""
    lr, wd, b1, b2, eps = 0.1, 0.5, 0.9, 0.95, 1e-8
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    n = torch.nn.Parameter(torch.tensor([1.5, 0.25], dtype=torch.float64))
    opt = build_adamw([(["layers.0.attention.wq.weight"], w), (["layers.0.attention_norm.weight"], n)], lr, wd)
    grads = [(torch.tensor([0.3, -0.1, 2.0]), torch.tensor([-1.0, 0.5])),
             (torch.tensor([-0.2, 0.4, 1.0]), torch.tensor([0.1, 0.1]))]
    want = {"w": [1.0, -2.0, 0.5], "n": [1.5, 0.25]}
    m = {k: [0.0] * len(v) for k, v in want.items()}
    v = {k: [0.0] * len(v) for k, v in want.items()}
    for t, (gw, gn) in enumerate(grads, start=1):
        w.grad, n.grad = gw.double(), gn.double()
        opt.step()
        for key, g, decay in (("w", gw, wd), ("n", gn, 0.0)):
            for i, gi in enumerate(g.tolist()):
                m[key][i] = b1 * m[key][i] + (1 - b1) * gi
                v[key][i] = b2 * v[key][i] + (1 - b2) * gi * gi
                m_hat, v_hat = m[key][i] / (1 - b1 ** t), v[key][i] / (1 - b2 ** t)
                want[key][i] = want[key][i] * (1 - lr * decay) - lr * m_hat / (math.sqrt(v_hat) + eps)
    assert w.detach().tolist() == pytest.approx(want["w"], rel=1e-12)
    assert n.detach().tolist() == pytest.approx(want["n"], rel=1e-12)
