"""TSP's ``heads`` KV-cache layout (infer/tsp_heads.py): rank j caches every token of KV head group j.

* greedy tokens equal Hugging Face's ``generate`` (per prompt, unpadded) and every step's logits the reference
  model's full forward, at D = 1, 2 and 4: ragged prompts, both prefill schedules, chunked prefill (the weights
  moving over several chunks reads earlier chunks' keys from their owner), MHA and GQA;
* a model with q/k/v biases, q/k norms and mixture-of-experts layers gives the reference model's tokens and logits;
* seeded sampling gives the reference's tokens;
* KV bytes per rank: n_kv/D heads of every slot, 1/D of the single-device cache of the same slots;
* one decode step issues exactly TP's collectives and bytes on the same model and ranks;
* the server's continuous batching (serve/batch.py) gives each request its alone-output; the paged pool's blocks
  hold block_size tokens of every sequence (no sharing of tokens between ranks);
* kv_layout="heads" where n_kv % D != 0 is a one-line error naming n_kv and D.

Each world size runs ONE pool job doing every case; the tests read it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchtsp
from test_infer import assert_step_logits_are_the_reference_forwards, make_hf, prompts, reference
from torchtsp.infer import generate, make_engine

transformers = pytest.importorskip("transformers")

from torchtsp.hf import config_from_hf, from_hf_state_dict  # noqa: E402

NEW = 8
WORLDS = (1, 2, 4)
# q/k/v biases, q/k norms, a shared expert, top-k 2 of 4 experts and a dense layer; 4 KV heads split over D = 1, 2, 4.
FEATURES = torchtsp.ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=101,
                                max_seq_len=64, qkv_bias=True, qk_norm=True, n_experts=4, moe_top_k=2,
                                moe_ffn_dim=48, shared_expert_ffn_dim=32, moe_norm_topk=False, dense_layers=(1,))
SAMPLING = dict(temperature=1.0, top_k=None, top_p=None, seed=7)


def runs(world):
    """(id, model, generate options): chunks are 1 and 2 blocks of 2D tokens (the prompts pad to 16 at D = 4)."""
    chunk = 2 * world
    return [("gqa", "gqa", {}),  # auto: activations move in prefill at this batch
            ("gqa-weights", "gqa", {"schedule": "weights"}),
            ("mha-weights-chunked", "mha", {"schedule": "weights", "prefill_chunk": chunk}),
            ("mha-activations-chunked", "mha", {"schedule": "activations", "prefill_chunk": chunk}),
            ("features-weights-chunked", "features", {"schedule": "weights", "prefill_chunk": chunk}),
            ("features-activations", "features", {"schedule": "activations"}),
            ("gqa-sample", "gqa", SAMPLING)]


def features_state():
    """FEATURES with random biases, q/k norm weights and norms (zeros and ones would hide a misplaced one)."""
    torch.manual_seed(0)
    model = torchtsp.Transformer(FEATURES)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.state_dict()


def decode_step_traffic(model, batch):
    """Prefill ``batch`` on ``model``'s engine, then count one decode step: (calls, bytes received) per operation."""
    engine = make_engine(model, "heads" if model.scheme == "tsp" else "auto")
    lengths = torch.tensor([len(p) for p in batch])
    tokens = torch.zeros(len(batch), 16, dtype=torch.long)
    for i, p in enumerate(batch):
        tokens[i, :len(p)] = torch.tensor(p)
    engine.choose_schedule("auto", len(batch), 16)
    engine.start(len(batch), 16, 2)
    with torch.inference_mode():
        engine.prefill(tokens, lengths, 16)
        with engine.comm.counting() as stats:
            engine.decode(tokens[:, 0], lengths)
    return dict(stats.calls), dict(stats.bytes_recv)


def checks_on_rank(world, models, batch):
    out = {}
    mesh = torchtsp.init_mesh(tsp=world)
    for run_id, name, options in runs(world):
        cfg, state = models[name]
        r = generate(torchtsp.parallelize(reference(cfg, state), mesh, "tsp"), batch, NEW, return_logits=True,
                     kv_layout="heads", **options)
        out[run_id] = dict(tokens=r.tokens, logits=r.logits, kv=r.kv_cache_bytes, schedule=r.schedule,
                           layout=r.kv_layout)
    if world > 1:
        cfg, state = models["gqa"]
        tp = torchtsp.parallelize(reference(cfg, state), torchtsp.init_mesh(tp=world), "tp")
        out["traffic"] = {"heads": decode_step_traffic(torchtsp.parallelize(reference(cfg, state), mesh, "tsp"),
                                                       batch),
                          "tp": decode_step_traffic(tp, batch)}
    return out


@pytest.fixture(scope="module")
def setup():
    hf = {name: make_hf(name) for name in ("mha", "gqa")}
    models = {"features": (FEATURES, features_state())}
    for name, model in hf.items():
        cfg = config_from_hf(model.config.to_dict())
        models[name] = (cfg, from_hf_state_dict(model.state_dict(), cfg))
    batch = prompts()
    expected = {}
    with torch.no_grad():
        for name, model in hf.items():
            expected[name] = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                             max_new_tokens=NEW, do_sample=False)[0].tolist() for p in batch]
    expected["features"] = generate(reference(*models["features"]), batch, NEW).tokens
    return dict(models=models, batch=batch, expected=expected)


@pytest.fixture(scope="module")
def results(pools, setup):
    return {world: pools(world).run(checks_on_rank, world, setup["models"], setup["batch"]) for world in WORLDS}


def _cases(sampled=False):
    return [(w, run_id, name, opts) for w in WORLDS for run_id, name, opts in runs(w)
            if bool(opts.get("temperature")) == sampled]


@pytest.mark.parametrize("world,run_id,name,options", _cases(), ids=[f"{w}-{r}" for w, r, *_ in _cases()])
def test_greedy_tokens_equal_hugging_face_and_the_reference(results, setup, world, run_id, name, options):
    for rank_result in results[world]:
        r = rank_result[run_id]
        assert r["layout"] == "heads"
        assert r["schedule"] == {"prefill": options.get("schedule", "activations"), "decode": "activations"}
        assert r["tokens"] == setup["expected"][name]  # HF's generate (llama models) or the reference's (features)


@pytest.mark.parametrize("world,run_id,name,options", _cases() + _cases(sampled=True),
                         ids=[f"{w}-{r}" for w, r, *_ in _cases() + _cases(sampled=True)])
def test_logits_of_every_step_equal_the_reference_forward(results, setup, world, run_id, name, options):
    assert_step_logits_are_the_reference_forwards(reference(*setup["models"][name]), results[world][0][run_id],
                                                  setup["batch"], NEW)


def test_seeded_sampling_gives_the_reference_tokens(results, setup):
    expected = generate(reference(*setup["models"]["gqa"]), setup["batch"], NEW, **SAMPLING).tokens
    assert expected != setup["expected"]["gqa"], "sampling at temperature 1 should differ from greedy here"
    for world in WORLDS:
        assert all(r["gqa-sample"]["tokens"] == expected for r in results[world])


def test_kv_bytes_per_rank_are_one_dth_of_the_single_device_cache(results, setup):
    batch = setup["batch"]
    longest = max(len(p) for p in batch)
    for name in ("mha", "gqa", "features"):
        cfg, state = setup["models"][name]
        for world in WORLDS:
            slots = -(-longest // (2 * world)) * 2 * world + NEW - 1  # the prompts padded to 2D, then NEW - 1 tokens
            single = 2 * cfg.n_layers * len(batch) * cfg.n_kv_heads * cfg.head_dim * 4 * slots  # float32 K and V
            run_id = next(r for r, n, _ in runs(world) if n == name)
            assert [r[run_id]["kv"] for r in results[world]] == [single // world] * world, (name, world)


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
def test_a_decode_step_issues_exactly_tps_collectives(results, setup, world):
    cfg, _ = setup["models"]["gqa"]
    for rank_result in results[world]:
        traffic = rank_result["traffic"]
        calls, recv = traffic["heads"]
        assert sum(calls.values()) == 1 + 2 * cfg.n_layers  # the embedding's sum, then wo's and the MLP's per layer
        assert traffic["heads"] == traffic["tp"]


# ---------------------------------------------------------------- the server's continuous batching


def serve_on_rank(schedule):
    from test_serve_batch import _model, serve_script

    reference_model = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference_model), torchtsp.init_mesh(tsp=2), "tsp").eval()
    return serve_script(model, reference_model, schedule=schedule, prefill_chunk=8, kv_layout="heads")


@pytest.mark.parametrize("schedule", ["weights", "activations"])
def test_continuous_batching_gives_each_request_its_alone_output(pools, schedule):
    from test_serve_batch import CANCEL_IN_PREFILL, _check

    for served, alone, done, left in pools(2).run(serve_on_rank, schedule):
        _check(served, alone, done)
        assert done[CANCEL_IN_PREFILL] == "cancelled" and left == 0


def long_next_to_short_on_rank():
    """A 40-token prompt asking for 8 tokens (47 cache slots), a 1-token prompt asking for 40 (40 slots) and one of
    41 + 9 - 1 = 49 slots, on the heads layout over a pool of 12 blocks of 4: every rank keeps every token of its
    heads, so a block id covers 4 tokens and the pool 48. The first two fit alone, not together (the newer is
    preempted and recomputed); the third never fits. Returns (served, alone, how each ended, figures)."""
    from test_serve_batch import _model, run_steps, serving
    from torchtsp.serve.plan import Admission, Sampling

    reference_model = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference_model), torchtsp.init_mesh(tsp=2), "tsp").eval()
    requests = [Admission(0, list(range(1, 41)), 8, Sampling()), Admission(1, [5], 40, Sampling()),
                Admission(2, list(range(41)), 9, Sampling())]
    alone = [generate(reference_model, [a.prompt], a.max_tokens).new_tokens[0] for a in requests[:2]]
    runner, scheduler, http = serving(model, num_blocks=12, block_size=4, prefill_chunk=8, kv_layout="heads",
                                      max_model_len=64)
    for a in requests:
        http.send(("submit", a))
    served, ended = {0: [], 1: []}, {}
    for _ in range(200):
        run_steps(runner, scheduler, served, ended)
        if len(ended) == len(requests):
            break
    paged = scheduler.paged
    figures = (runner.block_tokens, paged.blocks.capacity_tokens, paged.num_preemptions, paged.blocks.pool.num_free)
    return [served[0], served[1]], alone, ended, figures


def test_the_server_admits_by_the_heads_blocks_real_size(pools):
    for served, alone, ended, (block_tokens, capacity, preemptions, free) in pools(2).run(long_next_to_short_on_rank):
        assert (block_tokens, capacity) == (4, 12 * 4)
        assert served == alone and ended == {0: "length", 1: "length", 2: "too_long"}
        assert preemptions > 0 and free == 12


# ---------------------------------------------------------------- a layout the model does not allow


def refusal_on_rank():
    from torchtsp.infer.tsp import TSPEngine

    cfg = torchtsp.ModelConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=101,
                               max_seq_len=64)
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(tsp=4), "tsp")
    errors = []
    for attempt in (lambda: generate(model, [[1, 2, 3]], 2, kv_layout="heads"),
                    lambda: TSPEngine(model.shard_view(), "heads")):
        try:
            attempt()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors, generate(model, [[1, 2, 3]], 2).kv_layout


def test_heads_where_n_kv_does_not_divide_d_is_a_one_line_error(pools):
    for errors, auto in pools(4).run(refusal_on_rank):
        for message in errors:
            assert message is not None and "n_kv=2" in message and "D=4" in message and "\n" not in message
        assert auto != "heads"
