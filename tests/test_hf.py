"""Hugging Face interop: numerical conformance with transformers' Llama, checkpoint I/O, and error messages.

Everything runs on CPU in float32 with tiny random models and never touches the network.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from torchtsp.config import ModelConfig
from torchtsp.convert import convert_checkpoint, detect_checkpoint_kind
from torchtsp.hf import (
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    load_hf_checkpoint,
    load_torchtsp_checkpoint,
    save_hf_checkpoint,
    save_torchtsp_checkpoint,
    to_hf_state_dict,
)
from torchtsp.layers import IGNORE_INDEX
from torchtsp.model import Transformer

# Non-power-of-two sizes everywhere so that a transposed or mis-split weight cannot go unnoticed.
HF_SHAPES = {
    # GQA: 6 query heads share 3 KV heads (g=2), head_dim 16; non-default rope_theta.
    "gqa": {
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "intermediate_size": 200,
        "vocab_size": 101,
        "num_hidden_layers": 3,
        "max_position_embeddings": 64,
        "rope_theta": 5000.0,
        "rms_norm_eps": 1e-6,
    },
    # MHA: 5 heads of 16; non-default rms_norm_eps.
    "mha": {
        "hidden_size": 80,
        "num_attention_heads": 5,
        "num_key_value_heads": 5,
        "intermediate_size": 136,
        "vocab_size": 97,
        "num_hidden_layers": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
    },
}
B, S = 2, 17
MINIMAL_HF_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 100,
    "vocab_size": 50,
}

# Both models compute in float32 (eps = 1.2e-7) but not in the same order: torchtsp runs SDPA on
# explicitly expanded K/V, HF eager runs matmul + float32 softmax (or SDPA with its own masks), and
# the linears/reductions may block differently. Each op is correct to a few ulps; accumulated over a
# few layers, the worst difference seen relative to the tensor's largest entry is ~1e-7 to 1e-6.
# 1e-5 (~100 ulps) leaves headroom for that round-off while any real mapping bug (a swapped
# projection or norm, wrong GQA grouping, a RoPE convention mismatch, wrong eps/theta) shows up as
# errors of 1e-3 or larger.
REL_TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: round-off measured against the tensor's scale (robust to near-zero entries)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_hf(shape: str, tied: bool, attn: str = "eager", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**HF_SHAPES[shape], tie_word_embeddings=tied, attn_implementation=attn)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Not all ones: a swapped input/post-attention norm must change the output.
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                # std 0.1 gives attention scores of order 1, so softmax and RoPE are far from trivial.
                p.normal_(std=0.1)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def make_batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(vocab, (B, S + 1), generator=g)
    tokens, labels = seq[:, :-1], seq[:, 1:].clone()
    labels[0, :4] = IGNORE_INDEX  # a masked prompt
    labels[:, -1] = IGNORE_INDEX  # so HF's own (internally shifting) loss sees the same targets
    return tokens, labels


def ours_from_hf(hf: LlamaForCausalLM) -> Transformer:
    cfg = config_from_hf(hf.config.to_dict())
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model.eval()


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize(
    "shape,tied,attn",
    [("gqa", False, "eager"), ("gqa", True, "sdpa"), ("mha", True, "eager"), ("mha", False, "sdpa")],
)
def test_matches_transformers_logits_loss_and_grads(shape, tied, attn):
    hf = make_hf(shape, tied, attn)
    assert hf.config._attn_implementation == attn
    cfg = config_from_hf(hf.config.to_dict())
    hs = HF_SHAPES[shape]
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (
        hs["hidden_size"],
        hs["num_attention_heads"],
        hs["num_key_value_heads"],
        hs["intermediate_size"],
    )
    assert cfg.rope_theta == hs.get("rope_theta", 10000.0) and cfg.norm_eps == hs["rms_norm_eps"]
    assert cfg.tie_embeddings == tied
    ours = ours_from_hf(hf)
    tokens, labels = make_batch(cfg.vocab_size)

    # Forward + loss + backward on both.
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
    assert set(hf_grads) == set(ours_grads)
    assert ("output.weight" in ours_grads) == (not tied)
    errs = {n: rel_err(ours_grads[n], hf_grads[n]) for n in ours_grads}
    for n, g in hf_grads.items():
        assert g.abs().max() > 0, f"gradient of {n} is zero; the test would prove nothing"
    worst = max(errs, key=errs.get)
    assert errs[worst] <= REL_TOL, f"{worst}: rel err {errs[worst]:.3g}"


def test_state_dict_round_trip_is_exact_renaming():
    for tied in (False, True):
        hf = make_hf("gqa", tied)
        cfg = config_from_hf(hf.config.to_dict())
        sd = from_hf_state_dict(hf.state_dict(), cfg)
        back = to_hf_state_dict(sd, cfg)
        expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
        assert list(back) and set(back) == set(expected)
        assert all(back[k] is expected[k] or torch.equal(back[k], expected[k]) for k in back)


# --------------------------------------------------------------------------- configs


def test_config_to_hf_is_a_valid_llama_config_and_round_trips():
    cfg = ModelConfig(
        dim=96,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=200,
        vocab_size=101,
        max_seq_len=77,
        rope_theta=123456.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    )
    d = config_to_hf(cfg)
    assert d["model_type"] == "llama" and d["architectures"] == ["LlamaForCausalLM"]
    assert d["torch_dtype"] == "float32"
    assert config_from_hf(d) == cfg
    hf_cfg = LlamaConfig(**d)
    assert config_from_hf(hf_cfg.to_dict()) == cfg
    assert hf_cfg.tie_word_embeddings is True and hf_cfg.num_key_value_heads == 2


def test_config_from_hf_legacy_and_defaults():
    base = MINIMAL_HF_CONFIG
    cfg = config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": None})  # transformers 4.x style
    assert cfg.rope_theta == 500000.0 and cfg.n_kv_heads == 4 and not cfg.tie_embeddings
    cfg = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 2.5e5}})  # 5.x
    assert cfg.rope_theta == 2.5e5
    assert config_from_hf(base).rope_theta == 10000.0
    assert config_from_hf({**base, "num_key_value_heads": None, "head_dim": 16}).n_kv_heads == 4


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model_type": "gemma"}, r"model_type='gemma'"),
        ({"attention_bias": True}, r"attention_bias=True"),
        ({"model_type": "qwen3", "attention_bias": True}, r"attention_bias=True: in qwen3 it also biases o_proj"),
        # Windows and other head widths are supported (tests/test_hybrid.py); what transformers cannot run or
        # torchtsp does not compute is refused.
        ({"model_type": "mistral", "sliding_window": 1024, "layer_types": ["full_attention"] * 2},
         r"layer_types=.*slides in every layer"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
         r"sliding_window=null"),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, r"use_bidirectional_attention"),
        ({"mlp_bias": True}, r"mlp_bias=True"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"head_dim": 31}, r"head_dim=31 must be positive and even"),
        # A type transformers knows and torchtsp does not (rope.KNOWN_ELSEWHERE).
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, r"rope_scaling.*'proportional'"),
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 5e5, "factor": 8.0}},
         r"rope_parameters.*'proportional'"),
        # llama3 scaling is supported, but only complete.
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
            r"rope_parameters=.*rope_type 'llama3' needs low_freq_factor, high_freq_factor",
        ),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
        ({"num_key_value_heads": 3}, r"n_kv_heads=3"),
        ({"vocab_size": None}, r"vocab_size"),
    ],
)
def test_config_from_hf_rejects_unsupported(change, match):
    base = MINIMAL_HF_CONFIG
    with pytest.raises(ValueError, match=match):
        config_from_hf({**base, **change})


# --------------------------------------------------------------------------- state-dict errors


def test_state_dict_errors_name_keys_and_shapes():
    hf = make_hf("mha", tied=False)
    cfg = config_from_hf(hf.config.to_dict())
    sd = dict(hf.state_dict())
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing keys: model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf_state_dict(missing, cfg)
    with pytest.raises(ValueError, match=r"unexpected keys: model\.layers\.9\.foo"):
        from_hf_state_dict({**sd, "model.layers.9.foo": torch.zeros(1)}, cfg)
    bad = {**sd, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 80)}
    with pytest.raises(ValueError, match=r"k_proj\.weight: expected \(80, 80\), found \(16, 80\)"):
        from_hf_state_dict(bad, cfg)
    # inv_freq buffers from old checkpoints are ignored.
    assert set(from_hf_state_dict({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, cfg)) == set(
        Transformer(cfg).state_dict()
    )
    ours = from_hf_state_dict(sd, cfg)
    with pytest.raises(ValueError, match=r"missing keys: output\.weight"):
        to_hf_state_dict({k: v for k, v in ours.items() if k != "output.weight"}, cfg)

    tied_cfg = cfg.replace(tie_embeddings=True)
    tied_sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert "output.weight" not in from_hf_state_dict(tied_sd, tied_cfg)
    same = {**tied_sd, "lm_head.weight": tied_sd["model.embed_tokens.weight"].clone()}
    assert "output.weight" not in from_hf_state_dict(same, tied_cfg)
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        from_hf_state_dict(sd, tied_cfg)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_torchtsp_to_hf_round_trip(tmp_path, tied):
    hf = make_hf("gqa", tied)
    tokens, _ = make_batch(hf.config.vocab_size)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)

    assert convert_checkpoint(tmp_path / "hf", tmp_path / "tsp") == "torchtsp"
    assert detect_checkpoint_kind(tmp_path / "tsp") == "torchtsp"
    meta = json.loads((tmp_path / "tsp" / "torchtsp.json").read_text())
    assert meta["format"] == "torchtsp" and meta["version"] == 1
    cfg, sd = load_torchtsp_checkpoint(tmp_path / "tsp")
    assert cfg == config_from_hf(hf.config.to_dict())
    ours = Transformer(cfg)
    ours.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
        assert rel_err(ours(tokens), ref) <= REL_TOL

    assert convert_checkpoint(tmp_path / "tsp", tmp_path / "hf2") == "hf"
    with safe_open(tmp_path / "hf2" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not tied)  # a tied embedding is stored once
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert back.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, ref)


def test_sharded_checkpoints(tmp_path):
    hf = make_hf("gqa", tied=False)
    cfg = config_from_hf(hf.config.to_dict())
    expected = from_hf_state_dict(hf.state_dict(), cfg)
    tokens, _ = make_batch(cfg.vocab_size)

    # Written by transformers.
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    cfg2, sd = load_hf_checkpoint(tmp_path / "hf")
    assert cfg2 == cfg and set(sd) == set(expected)
    assert all(torch.equal(sd[k], expected[k]) for k in sd)

    # Written by us, read by transformers and by us.
    save_hf_checkpoint(tmp_path / "ours", expected, cfg, max_shard_bytes=100_000)
    shards = sorted((tmp_path / "ours").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "ours" / "model.safetensors").exists()
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(to_hf_state_dict(expected, cfg))
    cfg3, sd3 = load_hf_checkpoint(tmp_path / "ours")
    assert cfg3 == cfg and all(torch.equal(sd3[k], expected[k]) for k in expected)
    back = LlamaForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)

    # Re-saving unsharded into the same directory removes the stale shards and index.
    save_hf_checkpoint(tmp_path / "ours", expected, cfg)
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]


def test_single_oddly_named_safetensors_and_noncontiguous_tensors(tmp_path):
    hf = make_hf("mha", tied=False)
    cfg = config_from_hf(hf.config.to_dict())
    sd = from_hf_state_dict(hf.state_dict(), cfg)
    # A transposed-twice view is non-contiguous; saving must still work and round-trip exactly.
    sd["layers.0.attention.wq.weight"] = sd["layers.0.attention.wq.weight"].t().contiguous().t()
    assert not sd["layers.0.attention.wq.weight"].is_contiguous()
    save_hf_checkpoint(tmp_path, sd, cfg)
    os.rename(tmp_path / "model.safetensors", tmp_path / "weights.safetensors")
    cfg2, sd2 = load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg and all(torch.equal(sd2[k], sd[k]) for k in sd)


# --------------------------------------------------------------------------- checkpoint errors


@pytest.fixture
def hf_dir(tmp_path):
    make_hf("mha", tied=True).save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf"


def test_missing_directory_and_files(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist"):
        load_torchtsp_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"torchtsp\.json.*looks like a Hugging Face checkpoint"):
        load_torchtsp_checkpoint(hf_dir)
    os.remove(hf_dir / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights in .*hf"):
        load_hf_checkpoint(hf_dir)
    os.remove(hf_dir / "config.json")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_checkpoint(hf_dir)
    with pytest.raises(FileNotFoundError, match=r"neither torchtsp\.json .* nor config\.json"):
        convert_checkpoint(hf_dir, tmp_path / "out")


def test_missing_shard(tmp_path):
    make_hf("mha", tied=False).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    os.remove(shards[1])
    with pytest.raises(FileNotFoundError, match=re.escape(shards[1].name) + r".*re-download"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("keep", [0, 5, 100, 0.5, -1])
def test_truncated_safetensors(hf_dir, keep):
    path = hf_dir / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, int(size * keep) if isinstance(keep, float) else (keep % size))
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file \(truncated"):
        load_hf_checkpoint(hf_dir)


def test_truncated_torchtsp_weights(tmp_path, hf_dir):
    convert_checkpoint(hf_dir, tmp_path / "tsp")
    path = tmp_path / "tsp" / "model.safetensors"
    os.truncate(path, path.stat().st_size // 3)
    with pytest.raises(ValueError, match=r"tsp.model\.safetensors is not a readable safetensors file"):
        load_torchtsp_checkpoint(tmp_path / "tsp")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"attention_bias": True}, r"config\.json: unsupported attention_bias=True"),
        (
            {"rope_scaling": {"rope_type": "proportional", "factor": 4.0}},
            r"config\.json: unsupported rope_scaling rope_type='proportional'",
        ),
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "factor": 4.0}},
         r"rope_parameters.*'proportional'"),
    ],
)
def test_unsupported_config_json(hf_dir, change, match):
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(hf_dir)


def test_invalid_json(tmp_path, hf_dir):
    (hf_dir / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf_checkpoint(hf_dir)
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        convert_checkpoint(hf_dir, tmp_path / "out")

    make_hf("mha", tied=False).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        load_hf_checkpoint(tmp_path / "sharded")


def test_torchtsp_checkpoint_shape_and_format_errors(tmp_path):
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=30)
    sd = Transformer(cfg).state_dict()
    save_torchtsp_checkpoint(tmp_path, sd, cfg)
    loaded_cfg, loaded = load_torchtsp_checkpoint(tmp_path)
    assert loaded_cfg == cfg and all(torch.equal(loaded[k], sd[k]) for k in sd)

    meta_path = tmp_path / "torchtsp.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "model": {**meta["model"], "ffn_dim": 64}}))
    with pytest.raises(ValueError, match=r"feed_forward\.w_gate\.weight: expected \(64, 32\), found \(48, 32\)"):
        load_torchtsp_checkpoint(tmp_path)
    meta_path.write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(ValueError, match=r"torchtsp\.json: unsupported version=99"):
        load_torchtsp_checkpoint(tmp_path)
    meta_path.write_text(json.dumps({**meta, "model": {**meta["model"], "bogus": 1}}))
    with pytest.raises(
        ValueError, match=r"torchtsp\.json: invalid model config: unknown ModelConfig field\(s\): bogus"
    ):
        load_torchtsp_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"shape mismatches: tok_embeddings\.weight"):
        save_torchtsp_checkpoint(tmp_path / "x", sd, cfg.replace(vocab_size=31))


def test_convert_refuses_to_overwrite(tmp_path, hf_dir):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match=r"not empty; pass --overwrite"):
        convert_checkpoint(hf_dir, dst)
    with pytest.raises(ValueError, match=r"is the source directory"):
        convert_checkpoint(hf_dir, hf_dir, to="hf", overwrite=True)
    with pytest.raises(ValueError, match=r"to='gguf'"):
        convert_checkpoint(hf_dir, tmp_path / "other", to="gguf")

    assert convert_checkpoint(hf_dir, dst, overwrite=True) == "torchtsp"
    # Overwriting a torchtsp checkpoint with an HF one must leave a directory detected as HF.
    assert convert_checkpoint(hf_dir, dst, to="hf", overwrite=True) == "hf"
    assert detect_checkpoint_kind(dst) == "hf"
    assert not (dst / "torchtsp.json").exists() and (dst / "keep.txt").exists()
    cfg, sd = load_hf_checkpoint(dst)
    cfg0, sd0 = load_hf_checkpoint(hf_dir)
    assert cfg == cfg0 and all(torch.equal(sd[k], sd0[k]) for k in sd0)


def test_an_exported_model_names_its_special_tokens_for_transformers(tmp_path):
    """config.json's bos/eos/pad ids and generation_config.json, as save_pretrained writes them: transformers'
    generate reads its EOS from there."""
    import json

    from transformers import GenerationConfig

    from helpers import tiny_hf_llama

    eos = tiny_hf_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "</s>"}))
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # transformers 5's file
    convert_checkpoint(tmp_path / "hf", tmp_path / "tsp")
    convert_checkpoint(tmp_path / "tsp", tmp_path / "out")
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    bos = json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"]
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (bos, eos, eos)
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (bos, eos, eos)
