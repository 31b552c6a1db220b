"""Hybrid attention and the families that use it, against transformers: Mistral's every-layer window, Qwen2 /
Qwen3's windows from max_window_layers or layer_types (Qwen3 with heads wider than hidden / heads), Gemma 3 text
(5 local : 1 global in the real models; (1 + w) and sandwich norms, GeGLU, scaled embeddings, q/k norm,
query_pre_attn_scalar, RoPE per layer type). The window lives in ``layers.Mask``: these tests also check it at
its edge, with packed documents, and on every rank's zigzag share of a sequence.

CPU, float32, offline, one process.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import sliding_window_causal_mask_function  # noqa: E402

from helpers import hf_batch, rel_err, spread_hf_weights  # noqa: E402
from torchtsp import kernels  # noqa: E402
from torchtsp.config import SLIDING_ATTENTION, ModelConfig  # noqa: E402
from torchtsp.convert import convert_checkpoint  # noqa: E402
from torchtsp.distributed import zigzag  # noqa: E402
from torchtsp.distributed.attention import zigzag_attention_backward, zigzag_attention_forward  # noqa: E402
from torchtsp.hf import config_from_hf, config_to_hf, from_hf_state_dict, load_torchtsp_checkpoint  # noqa: E402
from torchtsp.layers import IGNORE_INDEX, Documents, Mask, attend, positions_mask, sequence_mask  # noqa: E402
from torchtsp.model import Transformer  # noqa: E402
from torchtsp.presets import get_preset  # noqa: E402

# As tests/test_families.py: two float32 implementations summing in different orders (SDPA or eager softmax on
# expanded K/V there; fused blocks merged through their LSEs, and explicitly masked edge blocks, here) differ
# by ~1e-7 to 1e-6 of a tensor's largest entry; a window off by one token, a norm without its 1 + w, a wrong
# RoPE base for one layer type or a missing embedding scale is off by 1e-3 or more.
REL_TOL = 1e-5
B, S = 2, 24

# Tiny shapes with GQA and heads of another width than hidden / heads (16 here: 24 and 32 below).
_COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 101, "max_position_embeddings": 64}


def _gemma3(window: int) -> tuple:
    # Four layers, every second one global (the real models: every sixth), head_dim 24, the attention scale of
    # query_pre_attn_scalar 20, linear RoPE scaling on global layers, a local base of its own.
    # pad_token_id None: transformers' embedding would give the pad token's row no gradient from lookups
    # (nn.Embedding's padding_idx), a training detail torchtsp does not copy; its checkpoints load the same.
    values = {**_COMMON, "num_hidden_layers": 4, "head_dim": 24, "pad_token_id": None, "query_pre_attn_scalar": 20,
              "sliding_window": window,
              "sliding_window_pattern": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    return Gemma3TextConfig, Gemma3ForCausalLM, values


def _mistral(window: int) -> tuple:
    return MistralConfig, MistralForCausalLM, {**_COMMON, "num_hidden_layers": 2, "sliding_window": window,
                                               "rope_theta": 1e6, "tie_word_embeddings": False}


def _qwen3(window: int) -> tuple:
    # Sliding from layer 1 on (max_window_layers), head_dim 32 as Qwen3-0.6B's heads are wider than hidden / heads.
    return Qwen3Config, Qwen3ForCausalLM, {**_COMMON, "num_hidden_layers": 3, "head_dim": 32, "rms_norm_eps": 1e-6,
                                           "use_sliding_window": True, "sliding_window": window,
                                           "max_window_layers": 1, "tie_word_embeddings": False}


def _qwen2(window: int) -> tuple:
    # Explicit layer_types: the window in the lower layer only.
    return Qwen2Config, Qwen2ForCausalLM, {**_COMMON, "num_hidden_layers": 2, "use_sliding_window": True,
                                           "sliding_window": window, "tie_word_embeddings": False,
                                           "layer_types": ["sliding_attention", "full_attention"]}


FAMILIES = {"gemma3": _gemma3, "mistral": _mistral, "qwen3": _qwen3, "qwen2": _qwen2}
# A window of 5 tokens lies inside one zigzag chunk at D = 2 (chunks of S/4 = 6), one of 13 spans three.
WINDOWS = (5, 13)


def make_hf(family: str, window: int, seed: int = 0, **overrides):
    """A tiny random float32 model of ``family`` (``overrides``: config values replaced, e.g. the KV heads)."""
    config_cls, model_cls, values = FAMILIES[family](window)
    torch.manual_seed(seed)
    config = config_cls(**json.loads(json.dumps({**values, **overrides})), attn_implementation="eager")
    model = model_cls(config).float().eval()
    spread_hf_weights(model)
    if family == "gemma3":  # Gemma's norms scale by 1 + w: weights around 0, not 1, as its checkpoints hold
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.sub_(1.0)
    return model


def ours_from_hf(hf) -> Transformer:
    cfg = config_from_hf(hf.config.to_dict())
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model.eval()


# --------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_logits_loss_and_grads(family, window, monkeypatch):
    # Tiles of 4 queries: the reference runs several tiles per row, each with an edge and a diagonal block.
    monkeypatch.setattr("torchtsp.masks.WINDOW_TILE", 4)
    hf = make_hf(family, window)
    ours = ours_from_hf(hf)
    cfg = ours.cfg
    assert cfg.sliding and cfg.sliding_window == window and cfg.hf_model_type == hf.config.model_type
    hf_types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * cfg.n_layers  # Mistral: all
    assert [cfg.layer_type(i) for i in range(cfg.n_layers)] == list(hf_types)
    tokens, labels = hf_batch(cfg.vocab_size, B, S)

    loss = ours.loss(tokens, labels)
    loss.backward()
    hf_logits = hf(input_ids=tokens).logits
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    hf_loss.backward()
    with torch.no_grad():
        assert rel_err(ours(tokens), hf_logits) <= REL_TOL
    assert rel_err(loss, hf_loss) <= REL_TOL

    grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    assert grads.keys() == dict(ours.named_parameters()).keys()
    for name, g in grads.items():
        assert g.abs().max() > 0, f"gradient of {name} is zero; the test would prove nothing"
        assert rel_err(dict(ours.named_parameters())[name].grad, g) <= REL_TOL, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_window_and_the_gemma_features_matter(family):
    """Without its window (or one of Gemma's features) a model's logits move far beyond REL_TOL: the
    conformance test above can fail."""
    ours = ours_from_hf(make_hf(family, 5))
    tokens, _ = hf_batch(101, B, S)
    drops = [dict(layer_types=())]
    if family == "gemma3":
        drops += [dict(norm_offset=0.0), dict(sandwich_norm=False), dict(mlp_activation="silu"),
                  dict(embed_scale=False), dict(query_pre_attn_scalar=None), dict(rope_local_theta=None)]
    for drop in drops:
        crippled = Transformer(ours.cfg.replace(family=None, **drop))
        crippled.load_state_dict(ours.state_dict(), strict=False)
        with torch.no_grad():
            assert rel_err(crippled(tokens), ours(tokens)) > 1e-3, drop


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_to_torchtsp_to_hf_round_trip(tmp_path, family):
    hf = make_hf(family, 5)
    tokens, _ = hf_batch(hf.config.vocab_size, B, S)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert_checkpoint(tmp_path / "hf", tmp_path / "tsp") == "torchtsp"
    cfg, _ = load_torchtsp_checkpoint(tmp_path / "tsp")
    assert cfg == config_from_hf(hf.config.to_dict())
    assert convert_checkpoint(tmp_path / "tsp", tmp_path / "hf2") == "hf"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    assert getattr(back.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    assert back.config.sliding_window == hf.config.sliding_window
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)


# --------------------------------------------------------------------------- the window's edge


def _visible(mask: Mask, n: int) -> torch.Tensor:
    """The [n, n] matrix of which key each query sees, read back from the blocks ``attend`` runs."""
    rows = mask.blocks(n, n)
    blocks = rows[1] if rows[0] is None else rows[0]
    seen = torch.zeros(n, n, dtype=torch.bool)
    for block in blocks:
        part = kernels._band(block, "cpu") if block.kind == "masked" else torch.ones(
            block.q.stop - block.q.start, block.k.stop - block.k.start, dtype=torch.bool)
        if block.kind == "causal":
            part = part.tril()
        elif block.kind == "anticausal":  # the far edge: query i sees keys j >= i
            part = part.triu()
        seen[block.q, block.k] |= part
    return seen


def check_window_edge(window: int, monkeypatch) -> None:
    n = 20
    hf_fn = sliding_window_causal_mask_function(window)
    i = torch.arange(n)
    expected = hf_fn(torch.tensor(0), torch.tensor(0), i[:, None], i[None, :]).expand(n, n)
    assert expected.sum(1).max() == min(window, n)  # the query itself counts: W keys, not W + 1
    for tile in (1, 3, 128):
        monkeypatch.setattr("torchtsp.masks.WINDOW_TILE", tile)
        assert torch.equal(_visible(sequence_mask(window=window), n), expected), tile
    # The cache's mask (decode of a sliding layer): the same pairs.
    q, k, v = torch.randn(3, 1, 2, n, 8, generator=torch.Generator().manual_seed(0)).unbind(0)
    pos = torch.arange(n)[None]
    out, _ = attend(q, k, v, positions_mask(pos, pos, torch.ones_like(pos, dtype=torch.bool), window))
    dense = (q @ k.transpose(-1, -2) * 8**-0.5).masked_fill(~expected, float("-inf")).softmax(-1) @ v
    assert rel_err(out, dense) < 1e-6


@pytest.mark.parametrize("window", [1, 2, 5, 16])
def test_the_window_edge_is_transformers(window, monkeypatch):
    """Query i sees key j iff i - window < j <= i: transformers' sliding_window_causal_mask_function, pair by
    pair, for the block kernels (several tile sizes) and the KV cache's positional mask alike."""
    check_window_edge(window, monkeypatch)


@pytest.mark.parametrize("where", ["blocks", "cache"])
def test_an_off_by_one_window_is_caught(where, monkeypatch):
    """A window that kept one key more (i - j <= W), planted in the block enumeration or in the cache's kernel,
    disagrees with transformers at the edge: the check above fails."""
    import torchtsp.masks

    if where == "blocks":
        real = torchtsp.masks.visible_blocks
        planted = lambda runs, qs, ql, ks, kl, w: real(runs, qs, ql, ks, kl, None if w is None else w + 1)
        monkeypatch.setattr(torchtsp.masks, "visible_blocks", planted)
    else:
        real = kernels.masked_attention
        planted = lambda q, k, v, qp, kp, valid, w=None: real(q, k, v, qp, kp, valid, None if w is None else w + 1)
        monkeypatch.setattr(kernels, "masked_attention", planted)
    with pytest.raises(AssertionError):
        check_window_edge(5, monkeypatch)


def check_windowed_attention(window: int, tile: int, monkeypatch) -> int:
    """attend() under a sliding layer's mask, forward and the gradients of q, k and v (GQA: 4 query heads on 2 KV
    heads), against a plain softmax masked by transformers' window mask; returns how many far-edge blocks ran
    as "anticausal" (the fused kernel on reversed rows)."""
    monkeypatch.setattr("torchtsp.masks.WINDOW_TILE", tile)
    ran, real = [], kernels.anticausal_attention
    monkeypatch.setattr(kernels, "anticausal_attention", lambda *a: ran.append(1) or real(*a))
    n, g = 29, torch.Generator().manual_seed(window)
    q = torch.randn(2, 4, n, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, n, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 4, n, 8, generator=g)
    i = torch.arange(n)
    visible = sliding_window_causal_mask_function(window)(torch.tensor(0), torch.tensor(0), i[:, None], i[None, :])
    expand = lambda t: t.repeat_interleave(2, dim=1)
    scores = (q @ expand(k).transpose(-1, -2) * 8**-0.5).masked_fill(~visible.expand(n, n), float("-inf"))
    dense = scores.softmax(-1) @ expand(v)
    expected = torch.autograd.grad(dense, (q, k, v), dout)
    out, _ = attend(q, k, v, sequence_mask(window=window))
    got = torch.autograd.grad(out, (q, k, v), dout)
    # float32 throughout on both sides: differences are rounding of sums over at most `window` keys (~1e-7).
    assert rel_err(out, dense) < 1e-5
    for name, a, b in zip("qkv", got, expected):
        assert rel_err(a, b) < 1e-5, name
    return len(ran)


@pytest.mark.parametrize("window,tile", [(3, 4), (8, 4), (8, 8), (13, 4), (14, 4)])
def test_windowed_attention_and_its_gradients_equal_a_masked_softmax(window, tile, monkeypatch):
    """The block kernels of a window (its far edge run fused on reversed rows, its diagonal causal or banded) give
    the output and every gradient of a dense softmax under transformers' mask: tiles as long as the window and
    longer (whose diagonal is then banded), rows ending in a short tile (its edge banded: fewer queries than keys)."""
    assert check_windowed_attention(window, tile, monkeypatch) > 0


@pytest.mark.parametrize("planted", ["lse not reversed back", "edge rows shifted by one"])
def test_a_wrong_far_edge_is_caught(planted, monkeypatch):
    """Plausible slips in the reversed-rows edge (its LSE left reversed; the keys' rows misaligned by one, as
    a causal mask that kept the diagonal out would be) fail the check above."""
    real = kernels.anticausal_attention
    if planted == "lse not reversed back":
        wrong = lambda q, k, v: (lambda out, lse: (out, lse.flip(-1)))(*real(q, k, v))
    else:
        wrong = lambda q, k, v: real(q, torch.roll(k, 1, dims=-2), torch.roll(v, 1, dims=-2))
    monkeypatch.setattr(kernels, "anticausal_attention", wrong)
    with pytest.raises(AssertionError):
        check_windowed_attention(8, 8, monkeypatch)


# --------------------------------------------------------------------------- windows with documents, on shards

LENGTHS = ((7, 11, 6), (24,))  # documents of each packed row


def _document_ids() -> torch.Tensor:
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])


@pytest.mark.parametrize("window", WINDOWS)
def test_window_with_documents_equals_each_document_alone(window):
    """A packed row under a windowed model gives each document's logits and gradients as the document alone."""
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-gemma3").replace(sliding_window=window))
    ids = _document_ids()
    tokens = torch.randint(model.cfg.vocab_size, (len(LENGTHS), S))
    logits = model(tokens, document_ids=ids)
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            alone = model(tokens[b:b + 1, start:start + n])
            assert rel_err(logits[b:b + 1, start:start + n], alone) < 1e-5, (b, start, n)
            start += n


class AttentionWork:
    """Counts the (query, key) pairs the fused kernels and the masked blocks are handed."""

    def __init__(self, monkeypatch):
        self.pairs = 0
        fused, band = kernels.fused_attention, kernels.band_attention

        def count_fused(q, k, v, causal):
            self.pairs += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
            return fused(q, k, v, causal)

        def count_band(q, k, v, block):
            self.pairs += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
            return band(q, k, v, block)

        monkeypatch.setattr(kernels, "fused_attention", count_fused)
        monkeypatch.setattr(kernels, "band_attention", count_band)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("window", [2, 5, 13])
@pytest.mark.parametrize("D", [2, 4])
def test_zigzag_attention_with_a_window_equals_whole_rows_and_skips_blocks_outside(D, window, documents,
                                                                                   monkeypatch):
    """Every rank's zigzag share, forward and backward, against one windowed attention of whole rows; the
    kernels see fewer pairs than with causal masking alone (parts wholly outside the window are skipped)."""
    Hq, Hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, Hq, S, d, generator=g)
    k, v = torch.randn(2, 2, Hkv, S, d, generator=g)
    dout = torch.randn(2, Hq, S, d, generator=g)
    mask = sequence_mask(Documents.from_ids(_document_ids()) if documents else None, window)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    whole, _ = attend(qr, kr, vr, mask)
    whole.backward(dout)
    kv = [torch.stack([zigzag.shard(k, D, r, dim=2), zigzag.shard(v, D, r, dim=2)]).transpose(2, 3)
          for r in range(D)]
    shard = lambda t, r: zigzag.shard(t, D, r, dim=2)
    outs, dqs, dkv = [], [], torch.zeros(D, 2, 2, S // D, Hkv, d)
    work = AttentionWork(monkeypatch)
    for r in range(D):
        out, lse = zigzag_attention_forward(shard(q, r), kv, r, D, mask)
        dq, part = zigzag_attention_backward(shard(dout, r), shard(q, r), kv, out, lse, r, D, mask)
        outs.append(out)
        dqs.append(dq)
        dkv += torch.stack(list(part)) if isinstance(part, list) else part
    assert rel_err(zigzag.unshard(torch.stack(outs), dim=2), whole) < 1e-6
    assert rel_err(zigzag.unshard(torch.stack(dqs), dim=2), qr.grad) < 1e-6
    assert rel_err(zigzag.unshard(dkv[:, 0].transpose(2, 3), dim=2), kr.grad) < 1e-6
    assert rel_err(zigzag.unshard(dkv[:, 1].transpose(2, 3), dim=2), vr.grad) < 1e-6
    windowed = work.pairs
    work.pairs = 0
    for r in range(D):
        zigzag_attention_forward(shard(q, r), kv, r, D, sequence_mask(mask.documents))
    assert windowed < work.pairs, (windowed, work.pairs)


# --------------------------------------------------------------------------- configs


def test_config_fields_and_refusals():
    cfg = ModelConfig(head_dim=32)
    assert cfg.head_dim == 32 and cfg.replace(dim=256).head_dim == 32  # set on its own: it stays
    assert ModelConfig().replace(dim=256).head_dim == 32  # derived from dim / n_heads: it follows them
    assert ModelConfig.from_dict({"dim": 128}) == ModelConfig()  # old torchtsp.json files: head_dim derived
    assert ModelConfig(sliding_window=8).sliding_window is None  # no sliding layer: one spelling
    with pytest.raises(ValueError, match=r"layer_types has 1 entries for 2 layers"):
        ModelConfig(layer_types=(SLIDING_ATTENTION,), sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding_window=None must be a positive number"):
        ModelConfig(layer_types=(SLIDING_ATTENTION,) * 2)
    with pytest.raises(ValueError, match=r"layer_types has 'local'"):
        ModelConfig(layer_types=("local", "full_attention"), sliding_window=8)
    with pytest.raises(ValueError, match=r"head_dim=7 must be positive and even"):
        ModelConfig(head_dim=7)
    with pytest.raises(ValueError, match=r"rope_scaling='linear': rope_type 'linear' needs factor"):
        ModelConfig(rope_scaling="linear")
    hf = config_to_hf(get_preset("tiny-gemma3"))
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        with pytest.raises(ValueError, match=rf"unsupported {name}=30.0: torchtsp has no logit soft-capping"):
            config_from_hf({**hf, name: 30.0})
    with pytest.raises(ValueError, match=r"llama checkpoints have no sliding window"):
        config_to_hf(ModelConfig(layer_types=(SLIDING_ATTENTION,) * 2, sliding_window=8))
    with pytest.raises(ValueError, match=r"mistral slides in every layer"):
        config_to_hf(ModelConfig(layer_types=(SLIDING_ATTENTION, "full_attention"), sliding_window=8,
                                 family="mistral"))


def test_qwen_layer_types_as_transformers_derives_them():
    base = {"model_type": "qwen2", **_COMMON, "num_hidden_layers": 4, "sliding_window": 16}
    assert not config_from_hf(base).sliding  # use_sliding_window false: transformers drops the window
    cfg = config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 1})
    assert [cfg.layer_type(i) for i in range(4)] == ["full_attention"] + ["sliding_attention"] * 3
    assert not config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 4}).sliding
    for model_type, config_cls in (("qwen2", Qwen2Config), ("qwen3", Qwen3Config)):
        hf = config_cls(**{k: v for k, v in base.items() if k != "model_type"}, use_sliding_window=True,
                        max_window_layers=2).to_dict()
        assert [config_from_hf(hf).layer_type(i) for i in range(4)] == hf["layer_types"], model_type


# The public config.json of each real model a preset copies (Gemma 3 4B / 27B: the text part of theirs).
REAL_CONFIGS = {
    "gemma3-1b": {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
                  "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                  "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                  "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
                  "max_position_embeddings": 32768, "vocab_size": 262144, "rms_norm_eps": 1e-06,
                  "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                  "attn_logit_softcapping": None},
    "gemma3-27b": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                   "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                   "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
                   "rope_theta": 1000000, "rope_local_base_freq": 10000,
                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "max_position_embeddings": 131072,
                   "vocab_size": 262208, "rms_norm_eps": 1e-06, "final_logit_softcapping": None},
    "qwen3-4b": {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "max_window_layers": 36, "rms_norm_eps": 1e-06,
                 "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
                 "tie_word_embeddings": True, "vocab_size": 151936},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 32000,
                   "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_presets_are_the_real_models(name):
    assert config_from_hf(REAL_CONFIGS[name]) == get_preset(name)


def test_gemma3_presets_slide_five_layers_of_six():
    for name in ("gemma3-1b", "gemma3-4b", "gemma3-27b"):
        cfg = get_preset(name)
        types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
        assert types[:6] == ["sliding_attention"] * 5 + ["full_attention"], name
        assert types.count("full_attention") == cfg.n_layers // 6, name


def test_decode_of_sliding_layers_masks_keys_older_than_the_window():
    """Greedy generation through the reference engine's KV cache equals the model's forward at every step with a
    window shorter than the prompt: decode hides the keys that left a sliding layer's window."""
    from torchtsp.infer import generate

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-qwen3-window").replace(sliding_window=4)).eval()
    model.reset_parameters(std=0.1)
    prompt = [3, 17, 5, 42, 8, 1, 9]
    result = generate(model, [prompt], 4, return_logits=True)
    tokens = result.tokens[0]
    with torch.no_grad():
        full = model(torch.tensor([tokens[:-1]]))[0]
        unwindowed = Transformer(model.cfg.replace(layer_types=()))
        unwindowed.load_state_dict(model.state_dict())
        assert rel_err(unwindowed(torch.tensor([tokens[:-1]]))[0], full) > 1e-3  # the window shows
    for step, logits in enumerate(result.logits):
        assert rel_err(logits.float().reshape(-1), full[len(prompt) - 1 + step]) <= 1e-5, step


def test_bench_builds_the_hybrid_model_it_is_asked_for():
    """`bench --sliding-window W --global-every N`: Gemma 3's pattern, written out here by hand (every 6th layer
    full, counting from 1), and the flags refused alone; a depth override keeps a preset's pattern."""
    import argparse

    from torchtsp.bench.args import add_bench_arguments
    from torchtsp.bench.run import _model_config

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    cfg = _model_config(parser.parse_args(["--n-layers", "12", "--sliding-window", "512", "--global-every", "6"]))
    full = [i for i in range(12) if cfg.window(i) is None]
    assert full == [5, 11] and cfg.sliding_window == 512
    with pytest.raises(ValueError, match="go together"):
        _model_config(parser.parse_args(["--sliding-window", "512"]))
    deeper = _model_config(parser.parse_args(["--preset", "tiny-gemma3", "--n-layers", "4"]))
    assert [deeper.window(i) for i in range(4)] == [64, None, 64, None]
