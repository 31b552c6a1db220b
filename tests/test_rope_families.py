"""The long-context RoPE types against transformers: YaRN (Qwen3, with and without windows), LongRoPE (Phi-3, with
its fused q/k/v and gate/up weights) and dynamic NTK (Llama), on tiny random models at sequences longer than the
context the scaling starts from, so that every type's scaling shows.

Tables bit for bit against transformers' rotary embeddings (per sequence length, per row of a KV cache step and
per packed document); the reference model's logits, loss and every gradient; packed documents against each
document alone; configs in and out (presets, refusals, the length a type takes); checkpoints through ``convert``
back into transformers. CPU, float32, offline, one process (the schemes: tests/test_families_parallel.py).
"""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from helpers import hf_batch, rel_err, spread_hf_weights  # noqa: E402
from torchtsp.config import ModelConfig  # noqa: E402
from torchtsp.convert import convert_checkpoint  # noqa: E402
from torchtsp.hf import config_from_hf, config_to_hf, from_hf_state_dict, to_hf_state_dict  # noqa: E402
from torchtsp.layers import IGNORE_INDEX, rope_tables  # noqa: E402
from torchtsp.model import Transformer  # noqa: E402
from torchtsp.presets import get_preset  # noqa: E402
from torchtsp.rope import KNOWN_ELSEWHERE, ROPE_TYPES  # noqa: E402

# As tests/test_families.py: two float32 implementations summing in different orders (eager or SDPA softmax on
# expanded K/V there, our fused kernel here) differ by ~1e-7 to 1e-6 of a tensor's largest entry. The tables are
# bitwise transformers' (tested below), so a RoPE bug shows at full size: the attention factor on one of cos and
# sin only, the chunk's length for dynamic NTK, or the long factors picked at another length are off by 1e-3 or
# more.
REL_TOL = 1e-5
B, S = 2, 32  # S is past every model's threshold below (16), and divisible by 2·D for the zigzag at D = 4

_COMMON = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 136,
           "vocab_size": 101, "num_hidden_layers": 2, "tie_word_embeddings": False}
# Head dim 16: 8 frequencies with wavelengths 2π·1e4^(i/8) = 6.3, 20, 63, 199, ... tokens. Over an original
# context of 16 tokens they turn 2.5, 0.8, 0.25, ... times, so YaRN's beta_fast 2 / beta_slow 0.25 keep the first,
# interpolate those past the third and ramp between: all three bands run (test_yarn_uses_all_three_bands).
_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 2.0, "beta_slow": 0.25}
_SHORT = [1.0 + 0.05 * i for i in range(8)]
_LONG = [1.0 + 1.5 * i for i in range(8)]
FAMILIES = {
    # Qwen3 with YaRN: q/k norm, explicit head_dim, attention factor 0.1 ln 4 + 1 on cos and sin.
    "qwen3-yarn": (Qwen3Config, Qwen3ForCausalLM, {**_COMMON, "head_dim": 16, "max_position_embeddings": 64,
                                                   "rms_norm_eps": 1e-6, "rope_parameters": dict(_YARN)}),
    # Qwen3 with YaRN and a window of 5 in its upper layer; GPT-OSS's truncate False; the attention factor from
    # mscale / mscale_all_dim (DeepSeek's way).
    "qwen3-yarn-window": (Qwen3Config, Qwen3ForCausalLM, {
        **_COMMON, "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "use_sliding_window": True,
        "sliding_window": 5, "max_window_layers": 1,
        "rope_parameters": {**_YARN, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    # Phi-3 with LongRoPE: long factors past 16 tokens (the top-level original_max_position_embeddings), attention
    # factor sqrt(1 + ln(64 / 16) / ln 16). pad_token_id None: transformers' embedding would give the pad row no
    # gradient (nn.Embedding's padding_idx), a training detail torchtsp does not copy (tests/test_hybrid.py).
    "phi3": (Phi3Config, Phi3ForCausalLM, {**_COMMON, "max_position_embeddings": 64,
                                           "original_max_position_embeddings": 16, "rms_norm_eps": 1e-5,
                                           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
                                           "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                               "short_factor": _SHORT, "long_factor": _LONG}}),
    # Llama with dynamic NTK x2 from 16 tokens: every sequence here runs past max_position_embeddings.
    "llama-dynamic": (LlamaConfig, LlamaForCausalLM, {**_COMMON, "max_position_embeddings": 16, "rms_norm_eps": 1e-5,
                                                      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                          "rope_theta": 1e4}}),
}
# Each family's threshold: the length past which its table changes (LongRoPE's switch, dynamic's base).
THRESHOLD = 16


def make_hf(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, values = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**json.loads(json.dumps({**values, **overrides})), attn_implementation="eager")
    model = model_cls(config).float().eval()
    spread_hf_weights(model)
    return model


def ours_from_hf(hf) -> Transformer:
    cfg = config_from_hf(hf.config.to_dict())
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model.eval()


def hf_tables(hf, positions: torch.Tensor):
    """transformers' cos/sin for one forward at ``positions`` [1, L] (a fresh rotary embedding: dynamic NTK and
    LongRoPE keep state between forwards)."""
    rotary = type(hf.model.rotary_emb)(hf.config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


# --------------------------------------------------------------------------- tables


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tables_equal_transformers_at_every_length(family):
    """Bit for bit at lengths below, at, just past and well past the threshold, as transformers computes them for
    one forward of that length; and per row of a KV cache step (each row at its own length), where nine rows
    exercise the vectorised kernels as one row does."""
    hf = make_hf(family)
    rope = config_from_hf(hf.config.to_dict()).rope
    lengths = [5, THRESHOLD, THRESHOLD + 1, 3 * THRESHOLD]
    expected = {n: hf_tables(hf, torch.arange(n)[None]) for n in lengths}
    for n in lengths:
        cos, sin = rope_tables(torch.arange(n), rope, n)
        assert torch.equal(cos, expected[n][0]) and torch.equal(sin, expected[n][1]), (family, n)
    rows = [lengths[i % len(lengths)] for i in range(9)]
    positions = torch.arange(5).expand(len(rows), 5)
    cos, sin = rope_tables(positions, rope, torch.tensor(rows).unsqueeze(1))
    for b, n in enumerate(rows):
        assert torch.equal(cos[b], expected[n][0][:5]) and torch.equal(sin[b], expected[n][1][:5]), (family, b, n)
    if rope.reads_length:  # the length matters: past the threshold the table is another one
        assert not torch.equal(expected[THRESHOLD][0], expected[THRESHOLD + 1][0][:THRESHOLD])
    else:  # YaRN's is one table at every length
        assert torch.equal(expected[THRESHOLD][0], expected[THRESHOLD + 1][0][:THRESHOLD])


def test_yarn_uses_all_three_bands_and_both_attention_factors():
    rope = config_from_hf(make_hf("qwen3-yarn").config.to_dict()).rope
    inv_freq, factor = rope.inv_freq_and_factor(S)
    plain = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
    kept, interpolated = inv_freq == plain, torch.isclose(inv_freq, plain / 4.0, rtol=1e-6, atol=0)
    assert kept.any() and interpolated.any() and (~kept & ~interpolated).any(), (inv_freq, plain)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    windowed = config_from_hf(make_hf("qwen3-yarn-window").config.to_dict()).rope
    assert windowed.inv_freq_and_factor(S)[1] == pytest.approx((0.1 * 1.3862944 + 1) / (0.05 * 1.3862944 + 1))


def test_yarn_covers_gpt_oss():
    """GPT-OSS's YaRN (factor 32 over 4096, truncate False, base 150000, heads of 64): its rotary embedding's
    tables (half-width: it rotates halves without repeating them) are ours bit for bit, past 4096 tokens."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = GptOssConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, intermediate_size=64, num_local_experts=4, vocab_size=101)
    params = {k: v for k, v in config.rope_parameters.items() if k not in ("rope_type", "rope_theta")}
    assert params["truncate"] is False and params["factor"] == 32.0
    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=64, max_seq_len=131072,
                      rope_theta=config.rope_parameters["rope_theta"], rope_scaling="yarn", rope_params=params)
    positions = torch.arange(4090, 4100)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    ours_cos, ours_sin = rope_tables(positions, cfg.rope)
    assert torch.equal(ours_cos[:, :32], cos[0]) and torch.equal(ours_sin[:, :32], sin[0])
    assert cfg.max_length == 131072


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_logits_loss_and_grads(family):
    hf = make_hf(family)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.rope_scaling == {"qwen3-yarn": "yarn", "qwen3-yarn-window": "yarn", "phi3": "longrope",
                                "llama-dynamic": "dynamic"}[family]
    assert cfg.sliding == (family == "qwen3-yarn-window")
    ours = ours_from_hf(hf)
    tokens, labels = hf_batch(cfg.vocab_size, B, S)
    loss = ours.loss(tokens, labels)
    loss.backward()
    hf_logits = hf(input_ids=tokens).logits
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    hf_loss.backward()
    with torch.no_grad():
        assert rel_err(ours(tokens), hf_logits) <= REL_TOL
        assert rel_err(loss, hf_loss) <= REL_TOL
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    assert set(hf_grads) == set(ours_grads)
    for n, g in hf_grads.items():
        assert g.abs().max() > 0, f"gradient of {n} is zero; the test would prove nothing"
    errs = {n: rel_err(ours_grads[n], hf_grads[n]) for n in ours_grads}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= REL_TOL, f"{worst}: rel err {errs[worst]:.3g}"


def test_phi3_window_slides_in_every_layer():
    """Phi-3 with ``sliding_window`` (Phi-3-mini-4k's 2047) masks every layer as transformers' Phi-3 does."""
    hf = make_hf("phi3", sliding_window=5)
    ours = ours_from_hf(hf)
    assert all(ours.cfg.window(i) == 5 for i in range(ours.cfg.n_layers))
    assert config_to_hf(ours.cfg)["sliding_window"] == 5
    tokens, _ = hf_batch(101, B, S)
    with torch.no_grad():
        assert rel_err(ours(tokens), hf(input_ids=tokens).logits) <= REL_TOL


def test_the_scaling_matters():
    """Without its scaling (or with LongRoPE's short factors throughout) each model is far from itself, so the
    conformance test above can fail."""
    tokens, _ = hf_batch(101, B, S)
    for family in FAMILIES:
        ours = ours_from_hf(make_hf(family))
        changes = [dict(rope_scaling=None, rope_params=(), max_seq_len=max(ours.cfg.max_seq_len, S))]
        if family == "phi3":  # the short factors where the long ones apply
            params = dict(ours.cfg.rope_params)
            changes.append(dict(rope_params={**params, "long_factor": params["short_factor"]}))
        for change in changes:
            crippled = Transformer(ours.cfg.replace(**change))
            crippled.load_state_dict(ours.state_dict())
            with torch.no_grad():
                assert rel_err(crippled(tokens), ours(tokens)) > 1e-3, (family, change)


@pytest.mark.parametrize("family", ["phi3", "llama-dynamic"])
def test_packed_documents_read_their_own_length(family):
    """Packed rows: each document's tokens equal transformers' forward of that document alone (its own length's
    table: one document past the threshold, one short of it), never the longest document's of the batch."""
    hf = make_hf(family)
    ours = ours_from_hf(hf)
    tokens, _ = hf_batch(101, 1, S)
    cut = 3 * THRESHOLD // 2  # 24 tokens, then 8
    document_ids = torch.cat([torch.zeros(1, cut), torch.ones(1, S - cut)], dim=1).long()
    with torch.no_grad():
        packed = ours(tokens, document_ids=document_ids)[0]
        for lo, hi in ((0, cut), (cut, S)):
            alone = hf(input_ids=tokens[:, lo:hi]).logits[0]
            assert rel_err(packed[lo:hi], alone) <= REL_TOL, (family, lo, hi)


# --------------------------------------------------------------------------- lengths


def test_dynamic_ntk_runs_past_max_seq_len_and_the_others_refuse():
    dynamic = ours_from_hf(make_hf("llama-dynamic"))
    assert dynamic.cfg.max_seq_len == THRESHOLD and dynamic.cfg.max_length is None
    # ``max_seq_len`` raised (as the trainer does for a long --seq-len) changes no table: the trained context is
    # fixed in the config.
    assert dynamic.cfg.replace(max_seq_len=4096).rope == dynamic.cfg.rope
    phi3 = ours_from_hf(make_hf("phi3"))
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds the model's max_seq_len=64"):
        phi3(torch.zeros(1, 65, dtype=torch.long))
    yarn = config_from_hf(make_hf("qwen3-yarn").config.to_dict())
    assert yarn.max_length == 64  # factor 4 x 16, not past the config's own 64
    qwen3_128k = get_preset("qwen3-8b-yarn-128k")
    assert (qwen3_128k.max_seq_len, qwen3_128k.max_length) == (40960, 131072)
    with pytest.raises(ValueError, match=r"exceeds the model's yarn RoPE's context of 131072 tokens"):
        qwen3_128k.check_length(131073)


# --------------------------------------------------------------------------- configs


# Qwen3-8B's config.json with the rope_scaling its model card adds for 128K.
QWEN3_8B_YARN = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}


def phi35_mini_config() -> dict:
    """Phi-3.5-mini-instruct's config.json (its factor lists are the preset's own)."""
    params = dict(get_preset("phi-3.5-mini").rope_params)
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_dropout": 0.0, "bos_token_id": 1,
            "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
            "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
            "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "rope_scaling": {"type": "longrope", "long_factor": list(params["long_factor"]),
                             "short_factor": list(params["short_factor"])},
            "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32064}


def test_presets_are_the_real_models():
    assert config_from_hf(QWEN3_8B_YARN) == get_preset("qwen3-8b-yarn-128k")
    phi35 = config_from_hf(phi35_mini_config())
    assert phi35 == get_preset("phi-3.5-mini")
    # LongRoPE's factor from max_position_embeddings / original (Phi-3 ships none): attention factor ~1.19.
    assert phi35.rope_param("factor") == 32.0
    assert phi35.rope.inv_freq_and_factor(None)[1] == pytest.approx(1.1902380714238083)
    # transformers 4's early name of LongRoPE in Phi-3 configs, and its top-level original context.
    su = phi35_mini_config()
    su["rope_scaling"]["type"] = "su"
    assert config_from_hf(su) == phi35
    # Phi-3's top-level original_max_position_embeddings wins over the rope dict's, as in transformers' Phi3Config.
    other = phi35_mini_config()
    other["rope_scaling"]["original_max_position_embeddings"] = 8192
    assert config_from_hf(other) == phi35


def test_refusals_name_what_to_do():
    base = phi35_mini_config()
    with pytest.raises(ValueError, match=r"unsupported partial_rotary_factor=0.75: torchtsp rotates the full"):
        config_from_hf({**base, "partial_rotary_factor": 0.75})  # Phi-4-mini
    with pytest.raises(ValueError, match=r"unsupported resid_pdrop=0.1: torchtsp trains without dropout"):
        config_from_hf({**base, "resid_pdrop": 0.1})
    short = {**base["rope_scaling"], "short_factor": base["rope_scaling"]["short_factor"][:-1]}
    with pytest.raises(ValueError, match=r"short_factor has 47 entries; it needs one per rotated pair, head_dim / "
                                         r"2 = 48"):
        config_from_hf({**base, "rope_scaling": short})
    for name, users in KNOWN_ELSEWHERE.items():  # every type transformers knows and torchtsp does not: named
        assert name not in ROPE_TYPES
        with pytest.raises(ValueError, match=re.escape(f"rope_type '{name}' (used by {users}) is not implemented")):
            config_from_hf({**QWEN3_8B_YARN, "rope_scaling": {"rope_type": name, "factor": 2.0}})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) <= set(ROPE_TYPES) | set(KNOWN_ELSEWHERE)
    with pytest.raises(ValueError, match=r"rope_type 'yarn' needs original_max_position_embeddings"):
        ModelConfig(rope_scaling="yarn", rope_params={"factor": 4.0})
    with pytest.raises(ValueError, match=r"phi3 has no yarn RoPE scaling"):
        config_to_hf(get_preset("tiny-yarn").replace(family="phi3"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_round_trip_through_convert(tmp_path, family):
    """HF -> torchtsp -> HF: the same config (dynamic NTK's trained context back as max_position_embeddings,
    Phi-3's q/k/v and gate/up fused again), transformers' own state dict, the same logits bit for bit."""
    hf = make_hf(family)
    cfg = config_from_hf(hf.config.to_dict())
    sd = from_hf_state_dict(hf.state_dict(), cfg)
    exported = to_hf_state_dict(sd, cfg)
    assert exported.keys() == hf.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in hf.state_dict().items())
    if family == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight" in exported and "layers.0.attention.wk.weight" in sd
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert_checkpoint(tmp_path / "hf", tmp_path / "tsp") == "torchtsp"
    assert convert_checkpoint(tmp_path / "tsp", tmp_path / "hf2") == "hf"
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert written["max_position_embeddings"] == hf.config.max_position_embeddings
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert type(back) is type(hf) and config_from_hf(back.config.to_dict()) == cfg
    tokens, _ = hf_batch(cfg.vocab_size, 2, S)
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)


# --------------------------------------------------------------------------- generate

NEW = 6
# Past the threshold from the prompt on (19: a chunked prefill's chunks all read its length), during decode (13 + 6:
# dynamic NTK's base grows every step from 17 tokens on; LongRoPE's cache is rebuilt at 17) and not at all (9 + 6),
# in one batch: each sequence reads its own length.
PROMPT_LENGTHS = (19, 13, 9)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(101, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_generate(hf, batch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens per prompt (each alone, from a fresh rotary embedding: dynamic NTK's keeps the
    longest length it saw) and its logits [NEW, B, V] of every step."""
    tokens, logits = [], []
    hf.generation_config.eos_token_id = None  # run NEW steps whatever is chosen, as generate here does
    with torch.no_grad():
        for p in batch:
            hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0].tolist())
            logits.append(torch.cat(out.logits).float())  # [NEW, V]
    return tokens, list(torch.stack(logits, dim=1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_generate_equals_transformers(family):
    """Greedy tokens and every step's logits equal transformers' generate: dynamic NTK's decode reads each step's
    length, LongRoPE's cache is rebuilt with the long factors when the sequence passes 16 tokens (as transformers'
    Phi-3 drops its cache there), YaRN's one table throughout; chunked prefill reads the whole prompt's length."""
    from torchtsp.infer import generate

    hf = make_hf(family)
    batch = prompts()
    expected_tokens, expected_logits = hf_generate(hf, batch)
    ours = ours_from_hf(hf)
    for chunk in (None, 4):
        result = generate(ours, batch, NEW, return_logits=True, prefill_chunk=chunk)
        assert result.tokens == expected_tokens, (family, chunk)
        for t in range(NEW):
            assert rel_err(result.logits[t], expected_logits[t]) <= REL_TOL, (family, chunk, t)


@pytest.mark.parametrize("family", ["phi3", "llama-dynamic"])
def test_serving_gives_transformers_tokens(family):
    """The server's core (rank 0's paged scheduler driving the reference engine, prompts prefilled in chunks of 4,
    the three requests in one batch) gives each request transformers' greedy tokens and their log-probabilities:
    every chunk reads its whole prompt's length, a LongRoPE sequence passing 16 tokens is computed again (the
    scheduler frees and re-queues it), and no prefix block is reused (a block's K/V depend on the length of the
    sequence that wrote it)."""
    from test_serve_batch import drive, serving
    from torchtsp.serve.plan import Admission, Sampling

    hf = make_hf(family)
    batch = prompts()
    expected, logits = hf_generate(hf, batch)
    runner, scheduler, http = serving(ours_from_hf(hf), num_blocks=32, block_size=4, prefill_chunk=4,
                                      max_model_len=48)
    for wave in (0, 1):  # the same prompts again: nothing from the prefix cache
        got = drive(runner, scheduler, http, [Admission(3 * wave + i, p, NEW, Sampling(), logprobs=0)
                                              for i, p in enumerate(batch)])
        for i, p in enumerate(batch):
            out = got[3 * wave + i]
            assert p + out["tokens"] == expected[i], (family, wave, i)
            hf_logprobs = [torch.log_softmax(logits[t][i], -1)[token].item() for t, token in enumerate(out["tokens"])]
            # 1e-5 of the logits' scale (~10) in float32, as the generate tests' logits tolerance
            assert max(abs(a - b) for (a, _), b in zip(out["logprobs"], hf_logprobs)) <= 1e-4, (family, wave, i)
    assert scheduler.paged.blocks.prefix_hits == 0


def test_phi3_checkpoint_reads_slice_by_slice(tmp_path):
    """``open_hf_weights`` (what a rank reads under a scheme) gives every part of Phi-3's fused q/k/v and gate/up
    matrices, whole and as any rank's rows or columns, equal to the same piece of the split weights."""
    from torchtsp.hf import open_hf_weights

    hf = make_hf("phi3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, weights = open_hf_weights(tmp_path)
    expected = from_hf_state_dict(hf.state_dict(), cfg)
    for name in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w_gate.weight",
                 "feed_forward.w_up.weight"):
        full = expected[f"layers.1.{name}"]
        assert torch.equal(weights.get(f"layers.1.{name}"), full), name
        for dim in (0, 1):
            for index in range(4):
                assert torch.equal(weights.get(f"layers.1.{name}", dim, 4, index), full.chunk(4, dim)[index]), \
                    (name, dim, index)
