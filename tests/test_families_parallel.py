"""Model families under the parallel schemes, against transformers: loss and every gradient of Llama 3 (llama3
RoPE scaling, tied), Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm) and Mistral, at D = 2 and 4, under tsp, tp,
sp and dp (tsp also with fewer KV heads than ranks); generated tokens; Hugging Face checkpoints read slice by
slice under tsp and exported again.

The transformers model runs once in the test process; the ranks get its weights, loss and gradients (mapped
to torchtsp names) and compare their scheme's against them. A scheme that does not implement a feature yet
refuses the model with a clear error (tested too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
import torchtsp  # noqa: E402
from test_families import FAMILIES, make_hf, rel_err  # noqa: E402
from torchtsp.hf import config_from_hf, from_hf_state_dict  # noqa: E402
from torchtsp.layers import IGNORE_INDEX  # noqa: E402
from torchtsp.schemes import MODEL_FEATURES, get_scheme  # noqa: E402

# One float32 model against another (within 1e-5 of each other, see tests/test_families.py), plus the
# scheme's own round-off from summing partial results over ranks in another order (~1e-7): 2e-5 leaves room
# for both, while a feature applied wrongly on a shard (a bias on the wrong heads, a norm gradient not summed
# over ranks) is off by 1e-3 or more.
TOL = 2e-5
B, S = 4, 16  # S divisible by 2·D for zigzag at D = 4; B by D for dp
# D = 4 needs query heads divisible by 4 (and 4 KV heads for tp): the same features at 8 heads / 4 KV heads.
WIDE = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}
# tsp at D = 4 with 2 KV heads, each copied on two ranks.
WIDE_KV2 = {**WIDE, "num_key_value_heads": 2}


def hf_reference(family: str, world: int, shape: dict | None = None):
    config_cls, model_cls, values = FAMILIES[family]
    shape = shape if shape is not None else WIDE if world == 4 else None
    if shape:
        FAMILIES[family] = (config_cls, model_cls, {**values, **shape})
    try:
        hf = make_hf(family)
    finally:
        FAMILIES[family] = (config_cls, model_cls, values)
    cfg = config_from_hf(hf.config.to_dict())
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(cfg.vocab_size, (B, S), generator=g)
    labels[0, :3] = IGNORE_INDEX
    logits = hf(input_ids=tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    weights = from_hf_state_dict({n: p.detach() for n, p in hf.named_parameters()}, cfg)
    grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    return cfg, weights, grads, loss.item(), tokens, labels


def check_against_transformers(results, grads, hf_loss, scheme):
    for loss, full in results:
        assert abs(loss - hf_loss) <= TOL * hf_loss, (scheme, loss, hf_loss)
        assert full.keys() == grads.keys()
        errs = {n: rel_err(full[n], g) for n, g in grads.items()}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (scheme, worst, errs[worst])


def scheme_on_rank(cfg, weights, tokens, labels, scheme, degrees):
    model = torchtsp.Transformer(cfg)
    model.load_state_dict(weights)
    pmodel = torchtsp.parallelize(model, torchtsp.init_mesh(**degrees), scheme)
    loss = pmodel.loss(tokens, labels)
    loss.backward()
    return loss.item(), pmodel.full_grads()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_under_every_scheme_that_implements_it(pools, family, world):
    cfg, weights, grads, hf_loss, tokens, labels = hf_reference(family, world)
    for scheme, degrees in (("tsp", {"tsp": world}), ("tp", {"tp": world}), ("sp", {"sp": world}),
                            ("dp", {"dp": world})):
        spec = get_scheme(scheme)
        if any(getattr(cfg, f) and f not in spec.features for f in MODEL_FEATURES):
            with pytest.raises(ValueError, match=f"scheme '{scheme}' does not implement the model's"):
                spec.validate(cfg, B, S, degrees)
            continue
        check_against_transformers(pools(world).run(scheme_on_rank, cfg, weights, tokens, labels, scheme, degrees),
                                   grads, hf_loss, scheme)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_family_features_under_tsp_with_kv_head_copies(pools, family):
    """2 KV heads over 4 ranks: biases of a copied KV head and the q/k norms equal transformers' gradients."""
    cfg, weights, grads, hf_loss, tokens, labels = hf_reference(family, 4, WIDE_KV2)
    assert cfg.n_kv_heads == 2
    check_against_transformers(pools(4).run(scheme_on_rank, cfg, weights, tokens, labels, "tsp", {"tsp": 4}),
                               grads, hf_loss, "tsp")


def traffic_on_rank(cfg, scheme, degrees):
    from torchtsp.distributed.comm import Traffic

    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(**degrees), scheme)
    tokens = torch.randint(cfg.vocab_size, (B, S))
    with Traffic(model.comms()) as traffic:
        model.loss(tokens, tokens).backward()
    return traffic.recv, model.traffic_seq_rank()


@pytest.mark.parametrize("scheme,degrees", [("tp", {"tp": 4}), ("tp_sp", {"tp": 2, "sp": 2}), ("sp", {"sp": 4}),
                                            ("tp", {"dp": 2, "tp": 2}), ("tsp", {"tsp": 4}),
                                            ("tsp", {"dp": 2, "tsp": 2})])
def test_feature_parameters_are_in_the_traffic_formula(pools, scheme, degrees):
    from torchtsp.analysis import predict_comm

    cfg = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=101, n_layers=2)
    for features in (dict(qkv_bias=True, qk_norm=False), dict(qkv_bias=False, qk_norm=True)):
        cfg = cfg.replace(**features)
        for got, seq_rank in pools(4).run(traffic_on_rank, cfg, scheme, degrees):
            assert got == predict_comm(scheme, cfg, B, S, **degrees, seq_rank=seq_rank).total, (features, seq_rank)


def generate_on_rank(cfg, weights, prompt, scheme, degrees, **options):
    from torchtsp.infer import generate

    model = torchtsp.Transformer(cfg)
    model.load_state_dict(weights)
    if scheme != "reference":
        model = torchtsp.parallelize(model, torchtsp.init_mesh(**degrees), scheme)
    result = generate(model, [prompt], 4, return_logits=True, **options)
    return result.tokens[0], [t.float() for t in result.logits]


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_generate_with_family_features_equals_transformers(pools, family):
    """Greedy tokens equal transformers' generate; every step's logits its forward, for each scheme that
    implements the family's features (1e-4: logits are summed over 2 ranks and 4 decode steps in float32)."""
    cfg, weights, _, _, _, _ = hf_reference(family, 2)
    hf = make_hf(family)
    prompt = [3, 17, 5, 42, 8, 1, 9]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, min_new_tokens=4)[0].tolist()
    for scheme, degrees, options in (("reference", {}, {}), ("tp", {"tp": 2}, {}), ("sp", {"sp": 2}, {}),
                                     ("dp", {"dp": 2}, {}), ("tsp", {"tsp": 2}, {"schedule": "weights"}),
                                     ("tsp", {"tsp": 2}, {"schedule": "activations"})):
        runs = [generate_on_rank(cfg, weights, prompt, scheme, degrees)] if scheme == "reference" else \
            pools(2).run(generate_on_rank, cfg, weights, prompt, scheme, degrees, **options)
        for tokens, logits in runs:
            assert tokens == expected, (scheme, tokens, expected)
            with torch.no_grad():
                full = hf(torch.tensor([tokens[:-1]])).logits[0]
            for step, step_logits in enumerate(logits):
                assert rel_err(step_logits.reshape(-1), full[len(prompt) - 1 + step]) <= 1e-4, (scheme, step)


def hf_round_trip_on_rank(src, dst):
    """Read an HF checkpoint slice by slice into tsp (nothing whole on any rank), export what the ranks hold."""
    from torchtsp.hf import open_hf_weights, save_hf_checkpoint

    cfg, weights = open_hf_weights(src)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg, device="meta"), torchtsp.init_mesh(tsp=2), "tsp",
                                 weights=weights)
    full = model.full_state_dict()
    if torch.distributed.get_rank() == 0:
        save_hf_checkpoint(dst, full, cfg)
    return full


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_checkpoint_loads_under_tsp_and_exports_back(pools, tmp_path, family):
    """transformers' save_pretrained -> sharded tsp loading -> export -> transformers' from_pretrained: the same
    weights (bit for bit) and the same logits."""
    hf = make_hf(family)
    hf.save_pretrained(tmp_path / "src", safe_serialization=True, max_shard_size="200KB")  # several files + index
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    cfg = config_from_hf(hf.config.to_dict())
    expected = from_hf_state_dict({n: p.detach() for n, p in hf.named_parameters()}, cfg)
    for full in pools(2).run(hf_round_trip_on_rank, str(tmp_path / "src"), str(tmp_path / "dst")):
        assert full.keys() == expected.keys()
        assert all(torch.equal(full[n], expected[n]) for n in expected)
    back = type(hf).from_pretrained(tmp_path / "dst", attn_implementation=hf.config._attn_implementation).eval()
    tokens = torch.randint(cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)


def hybrid_reference(family: str, window: int, seq_len: int = S):
    """tests/test_hybrid.py's tiny transformers model of ``family`` with ``window``: its config, weights, loss and
    gradients (torchtsp names) on this file's batch shape (``seq_len`` tokens)."""
    import test_hybrid

    hf = test_hybrid.make_hf(family, window)
    cfg = config_from_hf(hf.config.to_dict())
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(cfg.vocab_size, (B, seq_len), generator=g)
    labels = torch.randint(cfg.vocab_size, (B, seq_len), generator=g)
    labels[0, :3] = IGNORE_INDEX
    loss = F.cross_entropy(hf(input_ids=tokens).logits.flatten(0, 1).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX)
    loss.backward()
    weights = from_hf_state_dict({n: p.detach() for n, p in hf.named_parameters()}, cfg)
    grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    return cfg, weights, grads, loss.item(), tokens, labels


# Zigzag chunks of 4 tokens on the sequence axis (S = 8·D): a window of 3 lies inside one, a window of 9 spans
# three, so a query chunk's window keys come from one rank or from several (one of them possibly itself).
HYBRID_SEQ = {2: 16, 4: 32}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family,window", [("gemma3", 3), ("mistral", 9)])
def test_hybrid_attention_under_tsp_tp_sp(pools, family, window, world):
    """Gemma 3 (sliding and full layers, its own norms, GeGLU, scaled embeddings, attention scale) and Mistral's
    window at D = 2 and 4 give transformers' loss and every gradient under tsp, sp and tp x sp, whose sliding
    layers exchange only the window's K/V (and tp at D = 2, which exchanges none)."""
    seq_len = HYBRID_SEQ[world]
    cfg, weights, grads, hf_loss, tokens, labels = hybrid_reference(family, window, seq_len)
    assert cfg.sliding
    runs = [("tsp", {"tsp": world}), ("sp", {"sp": world}),
            ("tp_sp", {"tp": world // 2, "sp": 2} if world == 4 else {"tp": 1, "sp": 2})]
    runs += [("tp", {"tp": 2})] if world == 2 else []
    for scheme, degrees in runs:
        check_against_transformers(pools(world).run(scheme_on_rank, cfg, weights, tokens, labels, scheme, degrees),
                                   grads, hf_loss, scheme)


def hybrid_traffic_on_rank(cfg, scheme, degrees, seq_len, collectives=False):
    """(bytes received, ``traffic_args``, K/V bytes received by op) in one training step of a hybrid model;
    ``collectives``: the axes run gloo's collectives, as NCCL runs them, instead of point-to-point transfers."""
    from torchtsp.distributed.comm import Traffic

    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(**degrees), scheme)
    if collectives:
        for comm in model.comms().values():
            comm._point_to_point = comm.weights._point_to_point = False
    tokens = torch.randint(cfg.vocab_size, (B, seq_len))
    with Traffic(model.comms()) as traffic:
        model.loss(tokens, tokens).backward()
    return traffic.recv, model.traffic_args(), traffic.by_op


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_traffic_equals_the_model_on_every_rank(pools, world):
    """The bytes every rank counts in a step of a model with sliding and full layers equal ``predict_comm`` for
    that rank exactly, under tsp, sp and tp x sp, with a window inside a chunk and one spanning several (the
    sliding layers' K/V move point to point: "exchange"); TSP also with gloo's collectives for the full layers,
    as on NCCL. Chunks are S/2D = 4 tokens."""
    from torchtsp.analysis import predict_comm

    seq_len = HYBRID_SEQ[world]
    base = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=101, n_layers=2,
                                layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    runs = [("tsp", {"tsp": world}, False), ("sp", {"sp": world}, False), ("tp_sp", {"tp": world // 2, "sp": 2}, False)]
    runs += [("tsp", {"tsp": world}, True)] if world == 4 else []
    for window in (3, 9):
        cfg = base.replace(sliding_window=window)
        for scheme, degrees, collectives in runs:
            for got, args, by_op in pools(world).run(hybrid_traffic_on_rank, cfg, scheme, degrees, seq_len,
                                                     collectives):
                axis = "tsp" if scheme == "tsp" else "sp"
                assert by_op[axis].get("exchange", 0) > 0, (scheme, by_op)  # the window's keys moved
                expected = predict_comm(scheme, cfg, B, seq_len, **degrees, **args).total
                assert got == expected, (scheme, degrees, window, collectives, args, got, expected)


# --------------------------------------------------------------------------- long-context RoPE types

# tests/test_rope_families.py's models with 8 query heads and 2 KV heads (tp and tsp at D = 4 copy each KV head on
# two ranks), at S = 32: past every model's threshold of 16 tokens, and zigzag chunks of 4 at D = 4.
ROPE_SHAPE = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2}
ROPE_SEQ = 32
# Every scheme in one world of 4: tsp at D = 4 and at D = 2 (beside dp), tp, sp, tp x sp, dp, and two pipeline
# stages of tsp at D = 2 (two microbatches).
ROPE_RUNS = (("tsp", {"tsp": 4}), ("tsp", {"dp": 2, "tsp": 2}), ("tp", {"tp": 4}), ("sp", {"sp": 4}),
             ("tp_sp", {"tp": 2, "sp": 2}), ("dp", {"dp": 4}), ("pipeline", {"pp": 2, "tsp": 2}))
# Packed rows (a document past the threshold and one short of it) on the schemes that cut the sequence.
PACKED_RUNS = (("tsp", {"tsp": 4}), ("sp", {"sp": 4}))


def rope_reference(family: str):
    """The transformers model's loss and gradients (torchtsp names) on a [B, ROPE_SEQ] batch, its config and
    weights."""
    import test_rope_families

    hf = test_rope_families.make_hf(family, **ROPE_SHAPE)
    cfg = config_from_hf(hf.config.to_dict())
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(cfg.vocab_size, (B, ROPE_SEQ), generator=g)
    labels = torch.randint(cfg.vocab_size, (B, ROPE_SEQ), generator=g)
    labels[0, :3] = IGNORE_INDEX
    loss = F.cross_entropy(hf(input_ids=tokens).logits.flatten(0, 1).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX)
    loss.backward()
    weights = from_hf_state_dict({n: p.detach() for n, p in hf.named_parameters()}, cfg)
    grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    return cfg, weights, grads, loss.item(), tokens, labels


def rope_schemes_on_rank(cfg, weights, tokens, labels, document_ids):
    """(loss, full gradients) of every run of ROPE_RUNS on this rank, then of PACKED_RUNS on ``document_ids``."""
    from torchtsp.parallel.pipeline import pipeline_parallelize

    out = []
    for runs, documents in ((ROPE_RUNS, None), (PACKED_RUNS, document_ids)):
        for scheme, degrees in runs:
            model = torchtsp.Transformer(cfg)
            model.load_state_dict(weights)
            mesh = torchtsp.init_mesh(**degrees)
            if scheme == "pipeline":
                pmodel = pipeline_parallelize(model, mesh, "tsp", microbatches=2)
                loss = pmodel.forward_backward(tokens, labels)
            else:
                pmodel = torchtsp.parallelize(model, mesh, scheme)
                loss = pmodel.loss(tokens, labels, document_ids=documents)
                loss.backward()
            out.append((loss.item(), pmodel.full_grads()))
    return out


@pytest.mark.parametrize("family", ["qwen3-yarn", "qwen3-yarn-window", "phi3", "llama-dynamic"])
def test_long_context_rope_under_every_scheme(pools, family):
    """YaRN (Qwen3, with a window too), LongRoPE (Phi-3) and dynamic NTK (Llama) give transformers' loss and every
    gradient under tsp (D = 4, and D = 2 with dp), tp, sp, tp x sp, dp and two pipeline stages: the tables read
    the whole sequence's length on every rank, never its chunk's. Packed rows under tsp and sp equal the
    reference model's (itself transformers' forward of each document alone, tests/test_rope_families.py): a token
    reads its document's length wherever its rank holds it."""
    cfg, weights, grads, hf_loss, tokens, labels = rope_reference(family)
    document_ids = torch.zeros(B, ROPE_SEQ, dtype=torch.long)
    document_ids[:, 24:] = 1  # 24 tokens (past 16), then 8
    ref = torchtsp.Transformer(cfg)
    ref.load_state_dict(weights)
    ref_loss = ref.loss(tokens, labels, document_ids=document_ids)
    ref_loss.backward()
    packed_grads = {n: p.grad for n, p in ref.named_parameters()}
    results = pools(4).run(rope_schemes_on_rank, cfg, weights, tokens, labels, document_ids)
    staged = set()  # a pipeline rank holds its stage's gradients: every one on some rank
    for rank_results in results:
        for (loss, full), (scheme, _) in zip(rank_results, ROPE_RUNS):
            if scheme == "pipeline":
                staged |= set(full)
                grads_here = {n: g for n, g in grads.items() if n in full}
            check_against_transformers([(loss, full)], grads_here if scheme == "pipeline" else grads, hf_loss,
                                       (family, scheme))
        for (loss, full), (scheme, _) in zip(rank_results[len(ROPE_RUNS):], PACKED_RUNS):
            check_against_transformers([(loss, full)], packed_grads, ref_loss.item(), (family, scheme, "packed"))
    assert staged == set(grads)
