"""Gemma 3 and a windowed Mistral through every inference engine, against transformers' own ``generate``.

Gemma 3 brings every model feature beyond Llama that the layer core has: (1 + w) and sandwich norms, GeGLU, scaled
embeddings, q/k norm, query_pre_attn_scalar, RoPE per layer type (linear scaling on global layers, its own base on
local ones) and sliding windows on every second layer; the Mistral has a window on every layer. The prompts are
longer than the window (5 tokens), so decode and chunked prefill both meet keys that left it.

For each engine and cache layout at D = 2 — TSP's heads, grouped (a one-KV-head Gemma) and sequence layouts with
both prefill schedules, chunked and not, and the sequence layout's weights-move decode; TP, SP, DP — and TSP's
grouped layout at D = 4 with n_kv = 2: greedy tokens equal transformers', and so do every step's logits. The
reference engine (one device) is checked the same way without ranks.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtsp  # noqa: E402
from helpers import rel_err  # noqa: E402
from torchtsp.infer import generate  # noqa: E402

pytest.importorskip("transformers")

from test_hybrid import make_hf, ours_from_hf  # noqa: E402

WINDOW = 5
NEW = 6
PROMPT_LENGTHS = (13, 9)  # longer than the window; padded to 16 at D = 2 (zigzag chunks of 4) and D = 4 (of 2)
# As tests/test_hybrid.py: two float32 implementations summing in different orders (HF's eager softmax on expanded
# K/V; our block-wise kernel, log-sum-exp merges of per-rank partials, sums of row-parallel partials) differ by
# ~1e-7 to 1e-6 of the logits' largest entry; a window off by one, a missing 1 + w, embedding scale or GeGLU, or a
# wrong RoPE table for one layer type is off by 1e-3 or more.
LOGITS_TOL = 1e-5

# The models: (family, transformers config values replaced).
MODELS = {"gemma3": ("gemma3", {}), "gemma3-kv1": ("gemma3", {"num_key_value_heads": 1}),
          "mistral": ("mistral", {})}
# (id, scheme, model, generate options) per world size. Chunks of 4 tokens: one zigzag block of 2D at D = 2.
RUNS = {
    2: [("tsp-heads-weights", "tsp", "gemma3", {"kv_layout": "heads", "schedule": "weights", "prefill_chunk": 4}),
        ("tsp-heads-activations", "tsp", "gemma3", {"kv_layout": "heads", "schedule": "activations"}),
        ("tsp-grouped-weights", "tsp", "gemma3-kv1", {"kv_layout": "grouped", "schedule": "weights",
                                                      "prefill_chunk": 4}),
        ("tsp-grouped-activations", "tsp", "gemma3-kv1", {"kv_layout": "grouped", "schedule": "activations"}),
        # "weights" decodes with the weights moving too: the sequence layout's other decode
        ("tsp-sequence-weights", "tsp", "gemma3", {"kv_layout": "sequence", "schedule": "weights",
                                                   "prefill_chunk": 4}),
        ("tsp-sequence-activations", "tsp", "gemma3", {"kv_layout": "sequence", "schedule": "activations",
                                                       "prefill_chunk": 8}),
        ("tp", "tp", "gemma3", {}), ("sp", "sp", "gemma3", {"prefill_chunk": 4}), ("dp", "dp", "gemma3", {}),
        ("mistral-tsp-heads", "tsp", "mistral", {"kv_layout": "heads", "prefill_chunk": 4}),
        ("mistral-tsp-sequence", "tsp", "mistral", {"kv_layout": "sequence", "schedule": "weights"}),
        ("mistral-tp", "tp", "mistral", {}), ("mistral-sp", "sp", "mistral", {})],
    4: [("tsp-grouped", "tsp", "gemma3", {"kv_layout": "grouped", "prefill_chunk": 8})],
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(101, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_generate(hf, batch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens per prompt (each alone, unpadded) and its logits [NEW, B, V] of every step."""
    tokens, logits = [], []
    hf.generation_config.eos_token_id = None  # run NEW steps whatever is chosen, as generate here does
    with torch.no_grad():
        for p in batch:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0].tolist())
            logits.append(torch.cat(out.logits).float())  # [NEW, V]
    return tokens, list(torch.stack(logits, dim=1))


@pytest.fixture(scope="module")
def setup():
    batch, models, expected = prompts(), {}, {}
    for name, (family, overrides) in MODELS.items():
        hf = make_hf(family, WINDOW, **overrides)
        ours = ours_from_hf(hf)
        models[name] = (ours.cfg, ours.state_dict())
        expected[name] = hf_generate(hf, batch)
    return dict(batch=batch, models=models, expected=expected)


def assert_equal_to_transformers(result, expected, where) -> None:
    tokens, logits = expected
    assert result["tokens"] == tokens, where
    assert len(result["logits"]) == NEW
    for t in range(NEW):
        assert rel_err(result["logits"][t], logits[t]) <= LOGITS_TOL, (where, t)


def test_the_reference_engine_runs_gemma3_and_windows_as_transformers(setup):
    for name, (cfg, state) in setup["models"].items():
        model = torchtsp.Transformer(cfg)
        model.load_state_dict(state)
        r = generate(model.eval(), setup["batch"], NEW, return_logits=True)
        assert_equal_to_transformers(dict(tokens=r.tokens, logits=r.logits), setup["expected"][name], name)


def families_on_rank(world, models, batch):
    out, meshes = {}, {}
    for run_id, scheme, name, options in RUNS[world]:
        cfg, state = models[name]
        model = torchtsp.Transformer(cfg)
        model.load_state_dict(state)
        mesh = meshes.setdefault(scheme, torchtsp.init_mesh(**{scheme: world}))
        r = generate(torchtsp.parallelize(model.eval(), mesh, scheme), batch, NEW, return_logits=True, **options)
        out[run_id] = dict(tokens=r.tokens, logits=[t.clone() for t in r.logits], layout=r.kv_layout,
                           schedule=r.schedule)
    return out


@pytest.fixture(scope="module")
def results(pools, setup):
    return {world: pools(world).run(families_on_rank, world, setup["models"], setup["batch"]) for world in RUNS}


CASES = [(world, run_id, name, options) for world, runs in RUNS.items() for run_id, _, name, options in runs]


@pytest.mark.parametrize("world,run_id,name,options", CASES, ids=[f"{w}-{r}" for w, r, *_ in CASES])
def test_every_engine_and_layout_generates_as_transformers(results, setup, world, run_id, name, options):
    for rank, result in enumerate(results[world]):
        if "kv_layout" in options:
            assert result[run_id]["layout"] == options["kv_layout"]
        if options.get("schedule") == "weights" and options.get("kv_layout") == "sequence":
            assert result[run_id]["schedule"] == {"prefill": "weights", "decode": "weights"}
        assert_equal_to_transformers(result[run_id], setup["expected"][name], (rank, run_id))


# --------------------------------------------------------------------------- long-context RoPE types

# tests/test_rope_families.py's models (YaRN, LongRoPE, dynamic NTK) through every engine and cache layout at D = 2,
# with its prompts: one past the threshold of 16 tokens from the start, one crossing it in decode (LongRoPE's cache
# rebuilt there, dynamic NTK's base growing each step), one short of it. "-kv1": one KV head (the grouped layout).
ROPE_MODELS = ("qwen3-yarn", "qwen3-yarn-window", "phi3", "llama-dynamic")
_EVERY_LAYOUT = [
    ("tsp-heads-weights", "tsp", "", {"kv_layout": "heads", "schedule": "weights", "prefill_chunk": 4}),
    ("tsp-heads-activations", "tsp", "", {"kv_layout": "heads", "schedule": "activations"}),
    ("tsp-grouped-weights", "tsp", "-kv1", {"kv_layout": "grouped", "schedule": "weights", "prefill_chunk": 4}),
    ("tsp-grouped-activations", "tsp", "-kv1", {"kv_layout": "grouped", "schedule": "activations"}),
    ("tsp-sequence-weights", "tsp", "", {"kv_layout": "sequence", "schedule": "weights", "prefill_chunk": 4}),
    ("tsp-sequence-activations", "tsp", "", {"kv_layout": "sequence", "schedule": "activations", "prefill_chunk": 8}),
    ("tp", "tp", "", {}), ("sp", "sp", "", {"prefill_chunk": 4}), ("dp", "dp", "", {})]
# The context-dependent types on every layout; YaRN (one table at every length) on the sequence layout, tp and sp.
ROPE_RUNS = [(f"{model}-{run_id}", scheme, model + suffix, options)
             for model in ROPE_MODELS for run_id, scheme, suffix, options in _EVERY_LAYOUT
             if model in ("phi3", "llama-dynamic") or run_id in ("tsp-sequence-weights", "tp", "sp")]


@pytest.fixture(scope="module")
def rope_setup():
    import test_rope_families

    batch, models, expected = test_rope_families.prompts(), {}, {}
    for name in {model for _, _, model, _ in ROPE_RUNS}:
        overrides = {"num_key_value_heads": 1} if name.endswith("-kv1") else {}
        hf = test_rope_families.make_hf(name.removesuffix("-kv1"), **overrides)
        ours = test_rope_families.ours_from_hf(hf)
        models[name] = (ours.cfg, ours.state_dict())
        expected[name] = test_rope_families.hf_generate(hf, batch)
    return dict(batch=batch, models=models, expected=expected)


def rope_families_on_rank(models, batch):
    out, meshes = {}, {}
    for run_id, scheme, name, options in ROPE_RUNS:
        cfg, state = models[name]
        model = torchtsp.Transformer(cfg)
        model.load_state_dict(state)
        mesh = meshes.setdefault(scheme, torchtsp.init_mesh(**{scheme: 2}))
        r = generate(torchtsp.parallelize(model.eval(), mesh, scheme), batch, NEW, return_logits=True, **options)
        out[run_id] = dict(tokens=r.tokens, logits=[t.clone() for t in r.logits], layout=r.kv_layout)
    return out


def test_long_context_rope_on_every_engine_and_layout_generates_as_transformers(pools, rope_setup):
    """Greedy tokens and every step's logits equal transformers' generate (each prompt alone) on every engine and
    cache layout: each sequence of the batch reads its own length, on every rank."""
    results = pools(2).run(rope_families_on_rank, rope_setup["models"], rope_setup["batch"])
    for rank, result in enumerate(results):
        for run_id, _, name, options in ROPE_RUNS:
            if "kv_layout" in options:
                assert result[run_id]["layout"] == options["kv_layout"], run_id
            assert_equal_to_transformers(result[run_id], rope_setup["expected"][name], (rank, run_id))
