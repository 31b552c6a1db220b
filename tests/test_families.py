"""Model families against transformers: Llama 3.x (llama3 RoPE scaling), Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k norm) and Mistral, on tiny random configs that keep each real config's features.

The reference model must equal transformers' model (logits, loss, every gradient) and survive an
HF -> torchtsp -> HF round trip bit for bit. CPU, float32, offline.
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
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from helpers import hf_batch, spread_hf_weights  # noqa: E402
from torchtsp.config import ModelConfig  # noqa: E402
from torchtsp.convert import convert_checkpoint  # noqa: E402
from torchtsp.hf import config_from_hf, config_to_hf, from_hf_state_dict, load_torchtsp_checkpoint  # noqa: E402
from torchtsp.layers import (  # noqa: E402
    IGNORE_INDEX,
    head_norm,
    rms_norm,
    rope_cos_sin,
    rope_tables,
)
from torchtsp.model import Transformer, reference_shapes  # noqa: E402
from torchtsp.presets import PRESETS, get_preset  # noqa: E402
from torchtsp.rope import default_inv_freq  # noqa: E402

# Same justification as tests/test_hf.py: both sides compute in float32 in a different order (SDPA on
# expanded K/V vs eager matmul + softmax, different blocking); the worst round-off seen relative to a
# tensor's largest entry is ~1e-7 to 1e-6, while a mapping bug (a bias on the wrong projection, q/k norm
# after RoPE instead of before, a wrong RoPE frequency) gives errors of 1e-3 or more.
REL_TOL = 1e-5
B, S = 2, 17

# Tiny shapes: GQA everywhere (a group structure error cannot hide), head_dim 16, non-power-of-two widths.
_COMMON = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 136,
           "vocab_size": 101, "num_hidden_layers": 2}
# At head_dim 16 and theta 5e5 the RoPE wavelengths are 6.3, 32, 167, 860, ... tokens. An original context
# of 64 with low/high_freq_factor 1/4 keeps wavelengths < 16, divides those > 64 by the factor and
# interpolates between: all three branches of the llama3 rule run (checked in test_llama3_rope_tables_*).
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    # Llama 3.2: llama3 RoPE scaling and tied embeddings.
    "llama3": (LlamaConfig, LlamaForCausalLM, {**_COMMON, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
                                               "rope_parameters": dict(_LLAMA3_ROPE), "tie_word_embeddings": True}),
    # Qwen2.5: q/k/v bias, theta 1e6, untied, and sliding_window == max_position_embeddings as it ships.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {**_COMMON, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                              "tie_word_embeddings": False, "use_sliding_window": False,
                                              "sliding_window": 64, "max_window_layers": 2}),
    # Qwen3: per-head q/k RMSNorm, head_dim given explicitly, theta 1e6.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {**_COMMON, "head_dim": 16, "max_position_embeddings": 64,
                                              "rms_norm_eps": 1e-6,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                              "tie_word_embeddings": False, "attention_bias": False}),
    # Mistral v0.3: no sliding window.
    "mistral": (MistralConfig, MistralForCausalLM, {**_COMMON, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                                    "sliding_window": None, "tie_word_embeddings": False}),
}
ATTN = {"llama3": "eager", "qwen2": "sdpa", "qwen3": "eager", "mistral": "sdpa"}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_hf(family: str, seed: int = 0):
    config_cls, model_cls, values = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**json.loads(json.dumps(values)), attn_implementation=ATTN[family])
    model = model_cls(config).float().eval()
    spread_hf_weights(model)
    return model


def make_batch(vocab: int, seed: int = 1):
    return hf_batch(vocab, B, S, seed)


def ours_from_hf(hf) -> Transformer:
    cfg = config_from_hf(hf.config.to_dict())
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model.eval()


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_logits_loss_and_grads(family):
    hf = make_hf(family)
    cfg = config_from_hf(hf.config.to_dict())
    features = {
        "llama3": dict(rope_scaling="llama3", tie_embeddings=True, qkv_bias=False, qk_norm=False),
        "qwen2": dict(rope_scaling=None, rope_theta=1e6, qkv_bias=True, qk_norm=False, hf_model_type="qwen2"),
        "qwen3": dict(rope_scaling=None, rope_theta=1e6, qkv_bias=False, qk_norm=True, hf_model_type="qwen3"),
        "mistral": dict(rope_scaling=None, qkv_bias=False, qk_norm=False, family="mistral", hf_model_type="mistral"),
    }[family]
    assert {k: getattr(cfg, k) for k in features} == features
    if family == "llama3":
        assert cfg.rope_param("factor") == 8.0
    ours = ours_from_hf(hf)
    names = set(dict(ours.named_parameters()))
    assert ("layers.1.attention.wq.bias" in names) == cfg.qkv_bias
    assert ("layers.1.attention.k_norm.weight" in names) == cfg.qk_norm
    assert "layers.0.attention.wo.bias" not in names
    tokens, labels = make_batch(cfg.vocab_size)

    loss = ours.loss(tokens, labels)
    loss.backward()
    hf_logits = hf(input_ids=tokens).logits
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    hf_loss.backward()

    with torch.no_grad():
        logits = ours(tokens)
        assert logits.shape == hf_logits.shape == (B, S, cfg.vocab_size)
        assert rel_err(logits, hf_logits) <= REL_TOL
        assert rel_err(loss, hf_loss) <= REL_TOL
        # HF's built-in loss shifts `labels` itself: give it the unshifted targets.
        hf_labels = torch.cat([torch.full((B, 1), IGNORE_INDEX), labels[:, :-1]], dim=1)
        assert rel_err(hf(input_ids=tokens, labels=hf_labels).loss, loss) <= REL_TOL

    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    assert set(hf_grads) == set(ours_grads) == names
    for n, g in hf_grads.items():
        assert g.abs().max() > 0, f"gradient of {n} is zero; the test would prove nothing"
    errs = {n: rel_err(ours_grads[n], hf_grads[n]) for n in ours_grads}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= REL_TOL, f"{worst}: rel err {errs[worst]:.3g}"


def test_the_features_matter():
    """Dropping a feature changes the output far beyond REL_TOL, so the conformance test above can fail."""
    tokens, _ = make_batch(101)
    for family, drop in [("llama3", dict(rope_scaling=None, rope_params=())),
                         ("qwen2", dict(qkv_bias=False)), ("qwen3", dict(qk_norm=False))]:
        ours = ours_from_hf(make_hf(family))
        crippled = Transformer(ours.cfg.replace(**drop))
        crippled.load_state_dict(ours.state_dict(), strict=False)
        with torch.no_grad():
            assert rel_err(crippled(tokens), ours(tokens)) > 1e-2, family


def test_llama3_rope_tables_equal_transformers_and_use_all_three_bands():
    hf = make_hf("llama3")
    cfg = config_from_hf(hf.config.to_dict())
    positions = torch.arange(cfg.max_seq_len)
    rope = cfg.layer_specs[0].rope
    cos, sin = rope_tables(positions, rope)
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])

    plain = default_inv_freq(cfg.rope_theta, cfg.head_dim)
    scaled, factor = rope.inv_freq_and_factor(cfg.max_seq_len)
    assert factor == 1.0
    kept, divided = scaled == plain, torch.isclose(scaled, plain / cfg.rope_param("factor"), rtol=1e-6, atol=0)
    between = ~kept & ~divided
    assert kept.any() and divided.any() and between.any(), (plain, scaled)
    # The unscaled primitive is still there for callers that want plain RoPE.
    assert not torch.equal(rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)[0], cos)
    assert all(torch.equal(a, b) for a, b in zip(rope_cos_sin(positions, 16, 1e4),
                                                 rope_tables(positions, ModelConfig(dim=128,
                                                                                    n_heads=8).layer_specs[0].rope)))


def test_head_norm_is_per_head_rms_norm():
    x, w = torch.randn(2, 3, 4, 16), torch.randn(16)
    for cfg in (ModelConfig(norm_eps=1e-6), ModelConfig(norm_eps=1e-6, norm_offset=1.0, family="gemma3_text")):
        expected = torch.stack([rms_norm(x[:, :, h], w, 1e-6, cfg.norm_offset) for h in range(4)], dim=2)
        assert torch.equal(head_norm(x, w, cfg), expected)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_to_torchtsp_to_hf_round_trip(tmp_path, family):
    hf = make_hf(family)
    tokens, _ = make_batch(hf.config.vocab_size)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert_checkpoint(tmp_path / "hf", tmp_path / "tsp") == "torchtsp"
    cfg, _ = load_torchtsp_checkpoint(tmp_path / "tsp")
    assert cfg == config_from_hf(hf.config.to_dict())
    assert convert_checkpoint(tmp_path / "tsp", tmp_path / "hf2") == "hf"

    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    assert written["architectures"] == [type(hf).__name__]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation=ATTN[family]).eval()
    assert type(back) is type(hf) and back.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)


# --------------------------------------------------------------------------- configs and presets

# The public config.json of each model a preset copies (fields torchtsp reads, plus a few it ignores).
REAL_CONFIGS = {
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "vocab_size": 128256, "torch_dtype": "bfloat16", "pretraining_tp": 1,
    },
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "vocab_size": 128256, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
        "use_mrope": False, "vocab_size": 152064, "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936, "torch_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_presets_are_the_real_models(name):
    preset = get_preset(name)
    assert config_from_hf(REAL_CONFIGS[name]) == preset
    shapes = reference_shapes(preset)
    assert ("layers.0.attention.wq.bias" in shapes) == (name == "qwen2.5-7b")
    assert ("layers.0.attention.q_norm.weight" in shapes) == (name == "qwen3-8b")
    if name == "qwen3-8b":
        assert shapes["layers.0.attention.q_norm.weight"] == (preset.head_dim,)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_exports_a_config_transformers_builds(name):
    preset = get_preset(name)
    d = config_to_hf(preset)
    hf_config = AutoConfig.for_model(**d)
    assert hf_config.model_type == preset.hf_model_type and d["architectures"][0].startswith(
        type(hf_config).__name__.removesuffix("Config").removesuffix("Text"))  # Gemma3TextConfig: Gemma3ForCausalLM
    assert config_from_hf(hf_config.to_dict()) == preset == config_from_hf(d)
    assert hash(preset) == hash(config_from_hf(d))


def test_mistral_sliding_window():
    real = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32768, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None}  # Mistral-7B v0.3
    cfg = config_from_hf(real)
    assert cfg.family == "mistral" and cfg.hf_model_type == "mistral" and not (cfg.qkv_bias or cfg.qk_norm)
    assert not cfg.sliding
    assert config_from_hf({**real, "sliding_window": 32768}) == cfg  # never masks anything
    windowed = config_from_hf({**real, "sliding_window": 4096})  # Mistral-7B v0.1: every layer slides
    assert windowed.sliding_window == 4096 and all(windowed.window(i) == 4096 for i in range(32))


def test_qwen_sliding_window_only_where_a_layer_uses_it():
    _, _, values = FAMILIES["qwen2"]
    base = {**values, "model_type": "qwen2"}
    assert not config_from_hf({**base, "sliding_window": 16}).sliding  # use_sliding_window false: no layer slides
    # max_window_layers 2 of 2 layers: full attention everywhere.
    assert not config_from_hf({**base, "use_sliding_window": True, "sliding_window": 16}).sliding
    upper = config_from_hf({**base, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    assert (upper.window(0), upper.window(1)) == (None, 16)
    assert config_from_hf({**base, "use_sliding_window": True, "sliding_window": 16,
                           "layer_types": ["full_attention", "sliding_attention"]}) == upper


def test_head_dim_other_than_dim_over_heads():
    # Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128 (not 64): wq [16·128, 1024], wo its transpose.
    small_qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 3072, "num_hidden_layers": 28, "vocab_size": 151936}
    cfg = config_from_hf(small_qwen3)
    assert cfg.head_dim == 128
    shapes = reference_shapes(cfg)
    assert shapes["layers.0.attention.wq.weight"] == (16 * 128, 1024)
    assert shapes["layers.0.attention.wk.weight"] == (8 * 128, 1024)
    assert shapes["layers.0.attention.wo.weight"] == (1024, 16 * 128)
    assert config_to_hf(cfg)["head_dim"] == 128


def test_model_config_validation():
    with pytest.raises(ValueError, match=r"ModelConfig\.rope_scaling=None: RoPE parameters \['factor'\] need a "
                                         r"scaling type"):
        ModelConfig(rope_params={"factor": 8.0})
    with pytest.raises(ValueError, match=r"ModelConfig\.rope_scaling='nope': rope_type 'nope' is not implemented"):
        ModelConfig(rope_scaling="nope")
    with pytest.raises(ValueError, match=r"rope_type 'llama3' needs low_freq_factor, high_freq_factor, "
                                         r"original_max_position_embeddings"):
        ModelConfig(rope_scaling="llama3", rope_params={"factor": 8.0})
    with pytest.raises(ValueError, match=r"high_freq_factor=1.0 must exceed low_freq_factor=1.0"):
        ModelConfig(rope_scaling="llama3", rope_params={"factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 1.0,
                                                        "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match=r"rope_type 'llama3' takes factor, .*; not 'beta_fast'"):
        ModelConfig(rope_scaling="llama3", rope_params={"factor": 8.0, "low_freq_factor": 1.0, "beta_fast": 32,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match=r"ModelConfig\.family='gemma'"):
        ModelConfig(family="gemma")
    with pytest.raises(ValueError, match=r"family='mistral' needs qkv_bias=False"):
        ModelConfig(family="mistral", qkv_bias=True)
    with pytest.raises(ValueError, match=r"family='qwen2' needs qkv_bias=True"):
        ModelConfig(family="qwen2")
    # One spelling per model: an explicit family equal to the inferred one is stored as None.
    assert ModelConfig(family="qwen2", qkv_bias=True) == ModelConfig(qkv_bias=True)
    assert ModelConfig(family="llama").family is None and ModelConfig(family="mistral").family == "mistral"
    # Old torchtsp.json files (no family fields) still load, with every feature off.
    old = {k: v for k, v in ModelConfig().to_dict().items() if k in ("dim", "n_layers", "rope_theta")}
    assert ModelConfig.from_dict(old) == ModelConfig()
    with pytest.raises(ValueError, match=r"qkv_bias and qk_norm together"):
        config_to_hf(ModelConfig(qkv_bias=True, qk_norm=True))


def test_reference_init_of_biases_and_qk_norms():
    plain, featured = ModelConfig(), ModelConfig(qkv_bias=True, qk_norm=True)
    torch.manual_seed(0)
    a = Transformer(plain).state_dict()
    torch.manual_seed(0)
    b = Transformer(featured).state_dict()
    assert set(b) - set(a) == {f"layers.{i}.attention.{n}" for i in range(2)
                               for n in ("wq.bias", "wk.bias", "wv.bias", "q_norm.weight", "k_norm.weight")}
    for name, t in b.items():
        if name.endswith(".bias"):
            assert torch.equal(t, torch.zeros_like(t)), name
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(t, torch.ones_like(t)), name
        else:  # the features draw no random numbers: every other weight is the plain model's
            assert torch.equal(t, a[name]), name
