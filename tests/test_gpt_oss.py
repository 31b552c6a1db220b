"""GPT-OSS (``gpt_oss``) against transformers' ``GptOssForCausalLM``: attention sinks, q/k/v/o biases, windows of W
alternating with full layers, the biased router, the biased experts with the clamped SwiGLU, MXFP4 experts.

The sink is where sequence-parallel code goes wrong: it must enter the softmax once, after the partial attentions
of every key block and rank are merged. The unit tests below check ``apply_sinks`` against a softmax with the sink
as an extra column written out here, and that applying it per partial result (the known bug) is wrong; the
family tests check the whole model, loss and every gradient, on the reference and every scheme that runs it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

import torchtsp  # noqa: E402
from helpers import rel_err  # noqa: E402
from torchtsp.hf import config_from_hf, config_to_hf, from_hf_state_dict, to_hf_state_dict  # noqa: E402
from torchtsp.layers import IGNORE_INDEX, apply_sinks, attend, attend_with_sinks  # noqa: E402
from torchtsp.masks import CAUSAL, FULL  # noqa: E402
from torchtsp.schemes import get_scheme  # noqa: E402

# float32 against transformers' eager float32 attention (softmax over [scores, sink] then dropping the sink, where
# ours merges (out, lse) and scales once): the round-off seen is ~1e-7 to 2e-6 relative to a tensor's largest
# entry; a sink applied per key part, a dropped router bias or an up projection not shifted by 1 is off by 1e-2.
TOL = 2e-5
B, S = 2, 24  # S > the window (8) and divisible by 2·D for zigzag at D = 2 (and 4: 8 | 24? no: D = 4 uses S_WIDE)


def make_hf(seed: int = 0, heads: int = 4, kv_heads: int = 2, window: int = 8, layers: int = 2,
            rope: dict | None = None, **extra) -> GptOssForCausalLM:
    """A tiny random GPT-OSS: norms, biases, sinks and experts perturbed so that none is an identity or zero."""
    torch.manual_seed(seed)
    extra = {"router_aux_loss_coef": 0.02, "intermediate_size": 48, **extra}
    config = GptOssConfig(hidden_size=64, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, vocab_size=101, sliding_window=window, max_position_embeddings=256,
                          rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
                          attn_implementation="eager",
                          # A limit the projections of these weights cross often (7 in the published models), so
                          # that the clamps run in both directions.
                          swiglu_limit=0.25, **extra)
    hf = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return hf.eval()


def hf_reference(hf, tokens, labels):
    """transformers' loss (cross-entropy plus the router's aux loss, as ``outputs.loss`` adds it) and gradients in
    torchtsp names."""
    cfg = config_from_hf(hf.config.to_dict())
    hf.zero_grad()
    shifted = torch.cat([torch.full((tokens.shape[0], 1), IGNORE_INDEX), labels[:, :-1]], dim=1)  # HF shifts itself
    loss = hf(input_ids=tokens, labels=shifted, output_router_logits=True).loss
    loss.backward()
    weights = from_hf_state_dict({n: p.detach() for n, p in hf.named_parameters()}, cfg)
    grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    return cfg, weights, grads, loss.item()


def make_batch(vocab: int, batch: int = B, seq_len: int = S, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, seq_len), generator=g)
    labels = torch.randint(vocab, (batch, seq_len), generator=g)
    labels[:, -1] = IGNORE_INDEX  # transformers' shift drops the last position's target
    labels[0, :3] = IGNORE_INDEX
    return tokens, labels


def worst_grad(full: dict, grads: dict) -> tuple[str, float]:
    assert full.keys() == grads.keys()
    errs = {n: rel_err(full[n], g) for n, g in grads.items()}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


# --------------------------------------------------------------------------- sinks, from the formula


def softmax_with_sink_column(q, k, v, sinks, causal: bool):
    """Attention with the sink as one more logit column of every row, dropped after the softmax (the definition)."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def test_sinks_equal_the_extra_softmax_column_once_merged_and_not_per_part():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(3))
    sinks = torch.randn(3, generator=g)
    expected = softmax_with_sink_column(q, k, v, sinks, causal=False)
    out, lse = attend(q, k, v, FULL)
    assert rel_err(apply_sinks(out, lse, sinks)[0], expected) < 1e-6
    # Two key parts merged by their LSE first, then the sink once: the same. The sink per part: wrong.
    (o1, l1), (o2, l2) = attend(q, k[:, :, :4], v[:, :, :4], FULL), attend(q, k[:, :, 4:], v[:, :, 4:], FULL)
    lse12 = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - lse12).unsqueeze(-1) + o2 * torch.exp(l2 - lse12).unsqueeze(-1)
    assert rel_err(apply_sinks(merged, lse12, sinks)[0], expected) < 1e-6
    (s1, t1), (s2, t2) = apply_sinks(o1, l1, sinks), apply_sinks(o2, l2, sinks)
    per_part = s1 * torch.exp(t1 - torch.logaddexp(t1, t2)).unsqueeze(-1) + \
        s2 * torch.exp(t2 - torch.logaddexp(t1, t2)).unsqueeze(-1)
    assert rel_err(per_part, expected) > 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_sink_attention_gradients_equal_autograd_through_the_definition(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()  # GQA: 4 query heads, 2 KV
    sinks = torch.randn(4, generator=g, requires_grad=True)
    dout = torch.randn(2, 4, 12, 8, generator=g)
    ours = attend_with_sinks(q, k2, v2, CAUSAL if causal else FULL, sinks)
    grads = torch.autograd.grad(ours, (q, k2, v2, sinks), dout)
    ref = softmax_with_sink_column(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), sinks, causal)
    ref_grads = torch.autograd.grad(ref, (q, k2, v2, sinks), dout)
    assert rel_err(ours, ref) < 1e-6
    for name, a, b in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        assert rel_err(a, b) < 1e-5, name


# --------------------------------------------------------------------------- the reference model


def test_reference_equals_transformers_logits_loss_and_every_gradient():
    hf = make_hf()
    tokens, labels = make_batch(101)
    cfg, weights, grads, hf_loss = hf_reference(hf, tokens, labels)
    assert cfg.hf_model_type == "gpt_oss" and cfg.attention_sinks and cfg.o_bias and cfg.router_bias
    assert [s.attention.window for s in cfg.layer_specs] == [8, None]  # even layers slide, odd ones are full
    ours = torchtsp.Transformer(cfg)
    ours.load_state_dict(weights)
    loss = ours.loss(tokens, labels)
    loss.backward()
    with torch.no_grad():
        assert rel_err(ours(tokens), hf(input_ids=tokens).logits) <= TOL
    assert abs(loss.item() - hf_loss) <= TOL * hf_loss
    worst, err = worst_grad({n: p.grad for n, p in ours.named_parameters()}, grads)
    assert err <= TOL, (worst, err)
    for name in ("layers.0.attention.sinks", "layers.1.feed_forward.router.bias",
                 "layers.0.feed_forward.experts.up_bias", "layers.1.attention.wo.bias"):
        assert grads[name].abs().max() > 0, f"{name}'s gradient is zero: the comparison would prove nothing"


def test_each_gpt_oss_variant_matters():
    """Dropping any one of the variants changes the logits far beyond TOL, so the comparison above can fail."""
    hf = make_hf()
    cfg = config_from_hf(hf.config.to_dict())
    ours = torchtsp.Transformer(cfg)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    tokens, _ = make_batch(101)
    with torch.no_grad():
        full = ours(tokens)
        for name in ("attention.sinks", "attention.wo.bias", "feed_forward.router.bias",
                     "feed_forward.experts.up_bias"):
            crippled = torchtsp.Transformer(cfg)
            crippled.load_state_dict({n: torch.zeros_like(t) if n.endswith(name) else t
                                      for n, t in ours.state_dict().items()})
            assert rel_err(crippled(tokens), full) > 1e-3, name
        unclamped = torchtsp.Transformer(cfg.replace(swiglu_limit=1e9))
        unclamped.load_state_dict(ours.state_dict())
        assert rel_err(unclamped(tokens), full) > 1e-3


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    from torchtsp.hf import save_hf_checkpoint

    hf = make_hf()
    cfg = config_from_hf(hf.config.to_dict())
    sd = from_hf_state_dict(hf.state_dict(), cfg)
    assert torch.equal(to_hf_state_dict(sd, cfg)["model.layers.0.mlp.experts.gate_up_proj"],
                       hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"])
    save_hf_checkpoint(tmp_path, sd, cfg)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    back = GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens, _ = make_batch(101)
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)


# --------------------------------------------------------------------------- every scheme


def scheme_on_rank(cfg, weights, tokens, labels, scheme, degrees, pp: int = 1):
    model = torchtsp.Transformer(cfg)
    model.load_state_dict(weights)
    if pp > 1:
        from torchtsp.parallel.pipeline import pipeline_parallelize

        pmodel = pipeline_parallelize(model, torchtsp.init_mesh(pp=pp, **degrees), scheme)
        loss = pmodel.forward_backward(tokens, labels).item()
    else:
        pmodel = torchtsp.parallelize(model, torchtsp.init_mesh(**degrees), scheme)
        loss = pmodel.loss(tokens, labels)
        loss.backward()
        loss = loss.item()
    return loss, pmodel.full_grads()


@pytest.mark.parametrize("world", [2, 4])
def test_every_scheme_equals_transformers(pools, world):
    """Loss and every gradient under tsp (whole experts per rank, sinks moving with their head group's shard), tp
    (every expert's FFN slice, the down bias added once), sp and dp, and tsp as two pipeline stages."""
    hf = make_hf()
    tokens, labels = make_batch(101)
    cfg, weights, grads, hf_loss = hf_reference(hf, tokens, labels)
    runs = [("tsp", {"tsp": world}, 1), ("tp", {"tp": world}, 1), ("sp", {"sp": world}, 1), ("dp", {"dp": 2}, 1)]
    if world == 4:
        runs = [("tsp", {"tsp": 4}, 1), ("tp", {"tp": 4}, 1), ("sp", {"sp": 4}, 1)]
    for scheme, degrees, pp in runs:
        for loss, full in pools(world).run(scheme_on_rank, cfg, weights, tokens, labels, scheme, degrees, pp):
            assert abs(loss - hf_loss) <= TOL * hf_loss, (scheme, degrees, loss, hf_loss)
            worst, err = worst_grad(full, grads)
            assert err <= TOL, (scheme, degrees, pp, worst, err)


def test_pipeline_stages_of_tsp_equal_transformers(pools):
    """Two stages of tsp at D = 2 (pipeline stages need no load-balancing loss: its statistics span every layer)."""
    hf = make_hf(layers=4, router_aux_loss_coef=0.0)
    tokens, labels = make_batch(101)
    cfg, weights, grads, hf_loss = hf_reference(hf, tokens, labels)
    covered = set()
    for loss, full in pools(4).run(scheme_on_rank, cfg, weights, tokens, labels, "tsp", {"tsp": 2}, 2):
        assert abs(loss - hf_loss) <= TOL * hf_loss, (loss, hf_loss)
        worst, err = worst_grad(full, {n: grads[n] for n in full})  # a rank holds its stage's parameters
        assert err <= TOL, (worst, err)
        covered |= full.keys()
    assert covered == grads.keys()


def test_schemes_without_the_features_refuse_in_one_line():
    cfg = config_from_hf(make_hf().config.to_dict())
    for scheme in ("tp_sp", "torch_tp"):
        with pytest.raises(ValueError, match=f"scheme '{scheme}' does not implement the model's"):
            get_scheme(scheme).check_model(cfg, {"tp": 2, "sp": 2} if scheme == "tp_sp" else {"tp": 2})


# --------------------------------------------------------------------------- generate, every KV layout

NEW = 5
PROMPTS = ([3, 17, 5, 42, 8, 1, 9, 33, 12, 70, 2, 64, 11], [7, 99, 23, 5, 61, 4, 18, 40, 88])  # longer than the window
# (id, scheme, KV heads, generate options) per world size; prefill chunks of 4 = one zigzag block of 2D at D = 2.
GENERATE_RUNS = {
    2: [("tsp-heads-weights", "tsp", 2, {"kv_layout": "heads", "schedule": "weights", "prefill_chunk": 4}),
        ("tsp-heads-activations", "tsp", 2, {"kv_layout": "heads", "schedule": "activations"}),
        ("tsp-grouped-weights", "tsp", 1, {"kv_layout": "grouped", "schedule": "weights", "prefill_chunk": 4}),
        ("tsp-grouped-activations", "tsp", 1, {"kv_layout": "grouped", "schedule": "activations"}),
        ("tsp-sequence-weights", "tsp", 2, {"kv_layout": "sequence", "schedule": "weights", "prefill_chunk": 4}),
        ("tsp-sequence-activations", "tsp", 2, {"kv_layout": "sequence", "schedule": "activations",
                                                "prefill_chunk": 8}),
        ("tp", "tp", 2, {}), ("sp", "sp", 2, {"prefill_chunk": 4}), ("dp", "dp", 2, {})],
    4: [("tsp-grouped", "tsp", 2, {"kv_layout": "grouped", "prefill_chunk": 8}),
        ("tsp-sequence", "tsp", 2, {"kv_layout": "sequence", "schedule": "weights", "prefill_chunk": 8})],
}


def hf_generate(hf):
    """transformers' greedy tokens per prompt (each alone) and the logits [NEW, V] of every step."""
    hf.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            r = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
            out.append((r.sequences[0].tolist(), torch.cat(r.logits).float()))
    return out


def generate_on_rank(models, runs):
    from torchtsp.infer import generate

    results = {}
    for run_id, scheme, kv_heads, options in runs:
        cfg, weights = models[kv_heads]
        model = torchtsp.Transformer(cfg)
        model.load_state_dict(weights)
        if scheme != "reference":
            world = torch.distributed.get_world_size()
            model = torchtsp.parallelize(model, torchtsp.init_mesh(**{scheme: world}), scheme)
        r = generate(model, [list(p) for p in PROMPTS], NEW, return_logits=True, **options)
        results[run_id] = (r.tokens, [t.float() for t in r.logits], r.kv_layout)
    return results


def test_generate_on_every_kv_layout_equals_transformers(pools):
    """Greedy tokens and every step's logits of transformers' generate (each prompt alone), for the reference engine
    and every scheme and KV layout, the sinks applied once where each layout merges its partial attentions."""
    models, expected = {}, {}
    for kv_heads in (1, 2):
        hf = make_hf(kv_heads=kv_heads)
        cfg = config_from_hf(hf.config.to_dict())
        models[kv_heads] = (cfg, from_hf_state_dict(hf.state_dict(), cfg))
        expected[kv_heads] = hf_generate(hf)
    checks = [(generate_on_rank(models, [("reference", "reference", 2, {})]), [("reference", "reference", 2, {})])]
    for world, runs in GENERATE_RUNS.items():
        checks += [(result, runs) for result in pools(world).run(generate_on_rank, models, runs)]
    for result, runs in checks:
        for run_id, _, kv_heads, options in runs:
            tokens, logits, layout = result[run_id]
            assert layout == options.get("kv_layout", layout), run_id
            for b, (want_tokens, want_logits) in enumerate(expected[kv_heads]):
                assert tokens[b] == want_tokens, (run_id, b)
                for t in range(NEW):
                    # Logits summed over ranks and decode steps in another order: ~1e-6 of their largest entry.
                    assert rel_err(logits[t][b], want_logits[t]) <= 1e-5, (run_id, b, t)


# --------------------------------------------------------------------------- MXFP4 checkpoints


def test_mxfp4_experts_dequantize_as_transformers_and_load_slice_by_slice(tmp_path, capsys):
    """A folder as OpenAI publishes GPT-OSS (experts as MXFP4 ``*_blocks`` and ``*_scales``): the weights read equal
    transformers' own dequantization (``convert_moe_packed_tensors``), slice by slice and whole."""
    import json

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from torchtsp.hf import load_hf_checkpoint, open_hf_weights

    hf = make_hf(intermediate_size=64)  # MXFP4 blocks of 32 values: widths divisible by 32
    E, h, F_ = 4, 64, 64
    g = torch.Generator().manual_seed(3)
    packed = {}
    for i in range(2):
        for name, rows, inner in (("gate_up_proj", 2 * F_, h), ("down_proj", h, F_)):
            blocks = torch.randint(0, 256, (E, rows, inner // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 130, (E, rows, inner // 32), generator=g, dtype=torch.uint8)
            packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
            packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
            with torch.no_grad():  # transformers' dequantization is the reference: [E, in, out] as the model holds it
                getattr(hf.model.layers[i].mlp.experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    tensors = {n: p.detach().contiguous() for n, p in hf.state_dict().items()
               if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    cfg = config_from_hf(hf.config.to_dict())
    expected = from_hf_state_dict(hf.state_dict(), cfg)
    got_cfg, weights = open_hf_weights(tmp_path)
    assert got_cfg == cfg and "MXFP4 experts dequantized to bf16" in capsys.readouterr().err
    for name in ("layers.1.feed_forward.experts.w_gate", "layers.0.feed_forward.experts.w_up",
                 "layers.1.feed_forward.experts.w_down"):
        assert torch.equal(weights.get(name), expected[name]), name
        assert torch.equal(weights.get(name, 0, 2, 1), expected[name][2:]), name  # experts 2, 3 (a tsp rank's)
        assert torch.equal(weights.get(name, 1, 2, 0), expected[name].chunk(2, dim=1)[0]), name  # a tp slice
    _, sd = load_hf_checkpoint(tmp_path)
    assert all(torch.equal(sd[n], expected[n]) for n in expected)

    config["quantization_config"] = {"quant_method": "gptq"}
    with pytest.raises(ValueError, match="unsupported quantization_config quant_method='gptq'"):
        config_from_hf(config)


def test_mxfp4_without_room_to_dequantize_refuses_in_one_line(monkeypatch, tmp_path):
    from torchtsp.hf import files

    cfg = config_from_hf(make_hf(intermediate_size=64).config.to_dict())
    monkeypatch.setattr(files, "_available_host_bytes", lambda: 1000)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    needed = 2 * 4 * 3 * 64 * 64 * 2  # layers x experts x (gate, up, down) x F x h x bf16: the whole model here
    assert files.mxfp4_dequantized_bytes(cfg) == needed
    with pytest.raises(ValueError, match=r"need 0\.0 GiB for their share, 0\.0 GiB is free; use more ranks"):
        files.check_dequantize_room(cfg, tmp_path)
