"""The ``grouped`` KV-cache layout of TSP inference (infer/tsp_grouped.py): D % n_kv == 0, D > n_kv.

* greedy tokens equal transformers' ``generate`` and the single-device reference's at D = 2 (n_kv = 1) and
  D = 4 (n_kv = 1 and 2), ragged prompts, both prefill schedules, chunked prefill; every step's logits equal
  the reference model's forward; q/k/v biases with q/k norms, and a mixture of experts, against the reference;
* seeded sampling gives the reference's tokens;
* the server's continuous batching (``BatchRunner``) gives each request what it gets alone; a block id covers
  block_size x c tokens;
* KV bytes per rank are 1/D of the single-device cache where TP's (copying KV heads) are 1/n_kv;
* a decode step's collectives are counted: the embedding's sum, then per layer the q all-gather and the
  (O, LSE) all-to-all inside the KV-head group and two sums over the D ranks, with the in-group bytes of the
  arithmetic.

Each world size runs ONE pool job doing every case; the tests read it.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import torchtsp
from torchtsp.infer import generate, make_engine

transformers = pytest.importorskip("transformers")

from test_infer import assert_step_logits_are_the_reference_forwards, make_hf, prompts, reference  # noqa: E402
from test_kv_replication import reference as biased_reference  # noqa: E402
from test_serve_batch import CANCEL_IN_PREFILL, _check, serve_script  # noqa: E402
from torchtsp.hf import config_from_hf, from_hf_state_dict  # noqa: E402

SHAPES = {
    "kv1": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, intermediate_size=96),
    "kv2": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                tie_word_embeddings=True),
}
# Beyond Llama, against the reference only: q/k/v biases with q/k norms (Qwen-like), and experts.
EXTRA = {
    "bias_norm": torchtsp.ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=1, ffn_dim=96, vocab_size=101,
                                      max_seq_len=64, qkv_bias=True, qk_norm=True),
    "moe": torchtsp.ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=101,
                                max_seq_len=64, n_experts=4, moe_top_k=2, moe_ffn_dim=48, shared_expert_ffn_dim=32,
                                dense_layers=(1,)),
}
NEW = 8
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.9, seed=3)
RUNS = {  # (id, model, generate options); prompts of lengths 5, 13, 7: padding inside every zigzag share
    2: [("kv1", "kv1", {}), ("kv1-weights", "kv1", {"schedule": "weights"}),
        ("kv1-activations", "kv1", {"schedule": "activations"}),
        ("kv1-weights-chunked", "kv1", {"schedule": "weights", "prefill_chunk": 4}),
        ("kv1-activations-chunked", "kv1", {"schedule": "activations", "prefill_chunk": 4}),
        ("kv1-sample", "kv1", SAMPLING), ("bias_norm", "bias_norm", {"prefill_chunk": 4})],
    4: [("kv1", "kv1", {}), ("kv2", "kv2", {}), ("kv1-weights-chunked", "kv1", {"schedule": "weights",
                                                                                "prefill_chunk": 8}),
        ("kv2-weights-chunked", "kv2", {"schedule": "weights", "prefill_chunk": 8}),
        ("kv2-activations-chunked", "kv2", {"schedule": "activations", "prefill_chunk": 8}),
        ("kv2-sample", "kv2", SAMPLING), ("bias_norm", "bias_norm", {}),
        ("moe", "moe", {"schedule": "weights", "prefill_chunk": 8}), ("moe-activations", "moe",
                                                                      {"schedule": "activations"})],
}
BYTES_PROMPTS = [[3, 17, 5, 42, 8, 1, 9, 11], [4, 5, 6, 7, 9]]  # padded to 8 (2D at D = 4): no padding slack
BYTES_NEW = 5  # 4 decoded tokens stored: a multiple of every c here


def _models():
    out = {}
    for name, shape in SHAPES.items():
        hf = make_hf(shape)
        cfg = config_from_hf(hf.config.to_dict())
        out[name] = (cfg, from_hf_state_dict(hf.state_dict(), cfg), hf)
    for name, cfg in EXTRA.items():
        model = biased_reference(cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if not n.endswith((".bias", "norm.weight")):
                    p.normal_(std=0.1)
        out[name] = (cfg, model.state_dict(), None)
    return out


def _decode_step_transfers(model, batch):
    """The transfers (process group, operation, label) and bytes sent by kind of one grouped decode step."""
    engine = make_engine(model, "grouped")
    B, multiple = len(batch), engine.token_multiple
    S = -(-max(len(p) for p in batch) // multiple) * multiple
    tokens = torch.zeros(B, S, dtype=torch.long)
    for i, p in enumerate(batch):
        tokens[i, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in batch])
    engine.choose_schedule("auto", B, S)
    engine.start(B, S, 2)
    with torch.inference_mode():
        engine.prefill(tokens, lengths, S)
        with model.comm.counting() as stats:
            engine.decode(torch.tensor([1] * B), lengths)
    return [(t.group, t.op, t.label) for t in stats.transfers], dict(stats.bytes_sent)


def grouped_on_rank(world, models, batch):
    torch.manual_seed(0)
    mesh = torchtsp.init_mesh(tsp=world)
    build = lambda name, scheme="tsp", m=mesh: torchtsp.parallelize(reference(*models[name][:2]), m, scheme)
    out = {}
    for run_id, name, options in RUNS[world]:
        r = generate(build(name), batch, NEW, return_logits=True, kv_layout="grouped", **options)
        out[run_id] = dict(tokens=r.tokens, logits=[t.clone() for t in r.logits], layout=r.kv_layout,
                           schedule=r.schedule)
    for name in ("kv1", "kv2")[:world // 2]:
        out[f"bytes-{name}"] = generate(build(name), BYTES_PROMPTS, BYTES_NEW, kv_layout="grouped").kv_cache_bytes
        tp = build(name, "tp", torchtsp.init_mesh(tp=world))
        out[f"tp-bytes-{name}"] = generate(tp, BYTES_PROMPTS, BYTES_NEW).kv_cache_bytes
        out[f"step-{name}"] = _decode_step_transfers(build(name), batch)
    out["auto"] = make_engine(build("kv1")).kv_layout
    return out


@pytest.fixture(scope="module")
def setup():
    models = _models()
    batch = prompts()
    hf_tokens = {}
    with torch.no_grad():
        for name in SHAPES:
            hf = models[name][2]
            hf_tokens[name] = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                           max_new_tokens=NEW, do_sample=False)[0].tolist() for p in batch]
    plain = {name: (cfg, state) for name, (cfg, state, _) in models.items()}
    return dict(models=plain, batch=batch, hf=hf_tokens)


@pytest.fixture(scope="module")
def results(pools, setup):
    return {world: pools(world).run(grouped_on_rank, world, setup["models"], setup["batch"]) for world in RUNS}


def _each(greedy_only=False):
    return [(w, run_id, name, opts) for w, runs in RUNS.items() for run_id, name, opts in runs
            if not (greedy_only and opts.get("temperature"))]


@pytest.mark.parametrize("world,run_id,name,options", _each(), ids=[f"{w}-{r}" for w, r, *_ in _each()])
def test_tokens_equal_the_reference_and_transformers(results, setup, world, run_id, name, options):
    cfg, state = setup["models"][name]
    batch = setup["batch"]
    expected = generate(reference(cfg, state), batch, NEW, **options).tokens
    if name in SHAPES and not options.get("temperature"):
        assert expected == setup["hf"][name]
    for rank_result in results[world]:  # every rank returns every prompt's tokens
        assert rank_result[run_id]["layout"] == "grouped"
        assert rank_result[run_id]["tokens"] == expected, rank_result[run_id]["tokens"]
        assert rank_result[run_id]["schedule"]["decode"] == "activations"
    if "schedule" in options:
        assert results[world][0][run_id]["schedule"]["prefill"] == options["schedule"]


@pytest.mark.parametrize("world,run_id,name,options", _each(), ids=[f"{w}-{r}" for w, r, *_ in _each()])
def test_logits_of_every_step_equal_the_reference_forward(results, setup, world, run_id, name, options):
    cfg, state = setup["models"][name]
    assert_step_logits_are_the_reference_forwards(reference(cfg, state), results[world][0][run_id], setup["batch"],
                                                  NEW)


def test_auto_picks_grouped_where_n_kv_is_below_d(results):
    assert all(r["auto"] == "grouped" for w in RUNS for r in results[w])


def test_kv_bytes_per_rank_are_one_dth_where_tp_holds_one_n_kvth(results, setup):
    for world in RUNS:
        for name in ("kv1", "kv2")[:world // 2]:
            cfg, state = setup["models"][name]
            single = generate(reference(cfg, state), BYTES_PROMPTS, BYTES_NEW).kv_cache_bytes
            assert single == 2 * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4 * (8 + BYTES_NEW - 1)
            for r in results[world]:
                assert r[f"bytes-{name}"] * world == single, (world, name, r[f"bytes-{name}"], single)
                assert r[f"tp-bytes-{name}"] * cfg.n_kv_heads == single, (world, name, r[f"tp-bytes-{name}"])


def test_a_decode_step_gathers_q_and_merges_inside_the_group_and_sums_over_all_ranks(results, setup):
    for world in RUNS:
        for name in ("kv1", "kv2")[:world // 2]:
            cfg, _ = setup["models"][name]
            B, L, d, hq = len(setup["batch"]), cfg.n_layers, cfg.head_dim, cfg.n_heads // world
            c = world // cfg.n_kv_heads
            for rank, r in enumerate(results[world]):
                transfers, sent = r[f"step-{name}"]
                # gloo: sums of a few kB are all-gathers summed locally (engine.sum_over_ranks).
                every = lambda label: ("tsp", "all_gather", label)
                layer = [("tsp.kv_replicas", "all_gather", "infer.q"),
                         ("tsp.kv_replicas", "all_to_all", "infer.attention.merge"),
                         every("infer.attention"), every("infer.mlp")]
                assert transfers == [every("infer.embedding")] + layer * L, (world, name, rank, transfers)
                q_bytes = (c - 1) * B * hq * d * 4  # this rank's q to the c - 1 others of its group, per layer
                merge_bytes = (c - 1) * B * hq * (d + 1) * 4  # (O, LSE) float32 of the others' heads
                sums = (1 + 2 * L) * (world - 1) * B * cfg.dim * 4
                assert sent == {"all_gather": L * q_bytes + sums, "all_to_all": L * merge_bytes}, (world, rank, sent)


# ---------------------------------------------------------------- the server's continuous batching


def _serve_on_ranks(n_kv, world, schedule):
    from test_serve_batch import _model

    reference_model = _model()
    if n_kv != reference_model.cfg.n_kv_heads:
        torch.manual_seed(0)
        reference_model = torchtsp.Transformer(dataclasses.replace(reference_model.cfg, n_kv_heads=n_kv)).eval()
        with torch.no_grad():
            for p in reference_model.parameters():
                p.normal_(std=0.1)
    mesh = torchtsp.init_mesh(tsp=world)
    model = torchtsp.parallelize(copy.deepcopy(reference_model), mesh, "tsp").eval()
    assert make_engine(model).kv_layout == "grouped"
    return serve_script(model, reference_model, schedule=schedule, prefill_chunk=8)


@pytest.mark.parametrize("n_kv,world,schedule", [(1, 2, "weights"), (2, 4, "weights"), (2, 4, "activations")])
def test_batch_runner_gives_each_request_its_alone_output(pools, n_kv, world, schedule):
    for served, alone, done, left in pools(world).run(_serve_on_ranks, n_kv, world, schedule):
        _check(served, alone, done)
        assert done[CANCEL_IN_PREFILL] == "cancelled" and left == 0


def _grouped_error(world):
    cfg = torchtsp.ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=32, vocab_size=64)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(tsp=world), "tsp")
    try:
        make_engine(model, "grouped")
    except ValueError as e:
        return str(e)
    return None


def test_grouped_needs_fewer_kv_heads_than_ranks(pools):
    message = pools(2).run(_grouped_error, 2)[0]
    assert message is not None and "n_kv=2" in message and "D=2" in message and "\n" not in message


def _scheduler_on_ranks():
    """On the grouped layout at D = 4 with n_kv = 2 (c = 2 ranks share a KV head and split its tokens), blocks of
    2 slots per rank: a block id covers 2 x 2 = 4 tokens, a pool of 9 blocks 36. Requests of 20 + 4 - 1 = 23
    slots (6 blocks) and 3 + 10 - 1 = 12 (3 blocks) fill it exactly, together; 30 + 8 - 1 = 37 never fits."""
    from test_serve_batch import _model, run_steps, serving
    from torchtsp.serve.plan import Admission

    reference_model = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference_model), torchtsp.init_mesh(tsp=4), "tsp").eval()
    runner, scheduler, http = serving(model, num_blocks=9, block_size=2, max_num_seqs=3, prefill_chunk=8,
                                      max_model_len=64)
    requests = [Admission(0, [(5 * i) % 101 for i in range(20)], 4), Admission(1, [3, 1, 4], 10),
                Admission(2, [(3 * i) % 101 for i in range(30)], 8)]
    for a in requests:
        http.send(("submit", a))
    out, ended, together = {0: [], 1: []}, {}, 0
    for _ in range(100):
        run_steps(runner, scheduler, out, ended)
        together = max(together, len(scheduler.paged.running))
        if len(ended) == len(requests):
            break
    alone = [generate(reference_model, [a.prompt], a.max_tokens).new_tokens[0] for a in requests[:2]]
    paged = scheduler.paged
    figures = (runner.engine.kv_layout, runner.block_tokens, paged.blocks.capacity_tokens, paged.num_preemptions,
               together)
    return figures, ended, [out[0], out[1]], alone


def test_the_scheduler_sizes_grouped_blocks_by_the_ranks_sharing_a_kv_head(pools):
    for figures, ended, served, alone in pools(4).run(_scheduler_on_ranks):
        assert figures == ("grouped", 2 * 2, 9 * 2 * 2, 0, 2)  # both ran at once, with no preemption
        assert ended == {0: "length", 1: "length", 2: "too_long"}
        assert served == alone
