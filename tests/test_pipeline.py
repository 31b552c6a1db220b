"""Pipeline stages around TSP ([pp, dp, tsp] mesh), TP and SP against the single-device reference."""

import copy

import pytest
import torch

import torchtsp
from helpers import batch, rel_err
from torchtsp.parallel.pipeline import pipeline_parallelize

CFG = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, n_layers=4, max_seq_len=64)
# Qwen-style features through the stages: q/k/v bias, per-head q/k norm, one KV head copied on both TSP ranks.
FAMILY = CFG.replace(qkv_bias=True, qk_norm=True, n_kv_heads=1)
B, S, STEPS = 4, 16, 2


def steps_on_rank(pp, dp, tsp, schedule, microbatches, recompute=False, cfg=CFG, scheme="tsp"):
    """Loss of every step and every gradient of this rank's stages, pipeline vs reference (SGD between steps).
    ``tsp``: the degree of ``scheme``'s axis."""
    mesh = torchtsp.init_mesh(pp=pp, dp=dp, **{scheme: tsp})
    torch.manual_seed(0)
    ref = torchtsp.Transformer(cfg)
    model = pipeline_parallelize(copy.deepcopy(ref), mesh, scheme, microbatches=microbatches, schedule=schedule,
                                 recompute=recompute)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_grads = dict(ref.named_parameters())
    out = []
    for step in range(STEPS):
        tokens, labels = batch(cfg, B, S, seed=step)
        with model.pp.counting() as pp_traffic:
            loss = model.forward_backward(tokens, labels)
        ref_loss = ref.loss(tokens, labels)
        ref_loss.backward()
        grads = model.full_grads()
        out.append({"loss": loss.item(), "ref_loss": ref_loss.item(), "pp_bytes": pp_traffic.bytes_recv["pipeline_p2p"],
                    "pp_sent": pp_traffic.bytes_sent["pipeline_p2p"],
                    "grad_err": {n: rel_err(g, ref_grads[n].grad) for n, g in grads.items()}})
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    return out


def check_against_reference(results, pp, dp, tsp, microbatches, crossings=1, cfg=CFG, tokens=S // 2):
    names = set()
    for rank, steps in enumerate(results):
        for step, r in enumerate(steps):
            # float32 round-off: sums over microbatches, ranks and head groups are reordered, ~1e-7 relative.
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (rank, step, r)
            worst = max(r["grad_err"], key=r["grad_err"].get)
            # Gradients sum D partial products and M microbatches in another order than the reference.
            assert r["grad_err"][worst] <= 1e-4, (rank, step, worst, r["grad_err"][worst])
            names |= set(r["grad_err"])
    assert names == {n for n, _ in torchtsp.Transformer(cfg, device="meta").named_parameters()}
    # Rank p of a stage sends its own token shard [B/(dp M), S/tsp, h] to rank p of the next: per microbatch one
    # activation forward and its gradient back, fp32; nothing gathered.
    shard = (B // (dp * microbatches)) * tokens * CFG.dim * 4
    for rank, steps in enumerate(results):
        assert steps[0]["pp_bytes"] == crossings * microbatches * shard, (rank, steps[0]["pp_bytes"], shard)
        assert steps[0]["pp_sent"] == crossings * microbatches * shard


@pytest.mark.parametrize("schedule,microbatches,recompute,cfg", [("gpipe", 2, False, CFG), ("1f1b", 4, True, CFG),
                                                                ("1f1b", 2, "selective", CFG),
                                                                ("1f1b", 2, False, FAMILY)],
                         ids=["gpipe", "1f1b-recompute", "1f1b-selective", "1f1b-qwen-features"])
def test_pp2_tsp2_matches_reference(pools, schedule, microbatches, recompute, cfg):
    results = pools(4).run(steps_on_rank, 2, 1, 2, schedule, microbatches, recompute, cfg)
    check_against_reference(results, 2, 1, 2, microbatches, cfg=cfg)


@pytest.mark.parametrize("scheme", ["tp", "sp"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_with_tp2_or_sp2_matches_reference(pools, scheme, schedule):
    # Stages of any scheme: the reference model cut into two 2-layer sub-models, each split over tp (or sp). The
    # same bounds as pp x tsp: float32 sums reordered (TP's partial products summed over the tp ranks, SP's
    # gradients over the sp ranks, microbatches accumulated), ~1e-7 relative each.
    results = pools(4).run(steps_on_rank, 2, 1, 2, schedule, 2, False, CFG, scheme)
    # A TP rank holds every token of its rows, and sends them all; an SP rank its zigzag shard, S/2.
    check_against_reference(results, 2, 1, 2, 2, tokens=S if scheme == "tp" else S // 2)


def test_interleaved_1f1b_matches_reference(pools):
    # Two stages per rank (4 stages of one layer each on pp=2): 3 boundaries, each crossed forward and backward
    # per microbatch, so each of the 2 ranks receives (and sends) 3 shards per microbatch.
    results = pools(4).run(steps_on_rank, 2, 1, 2, "interleaved_1f1b", 2)
    check_against_reference(results, 2, 1, 2, 2, crossings=3)


def test_pp2_dp2_tsp2_matches_reference(pools):
    results = pools(8).run(steps_on_rank, 2, 2, 2, "1f1b", 2)
    check_against_reference(results, 2, 2, 2, 2)


# ---------------------------------------------------------------- training, checkpoints across splits

TRAIN = {"preset": "tiny", "batch_size": 4, "seq_len": 32, "steps": 4, "sample_tokens": 0, "checkpoint_every": 2}


def train(pools, tmp_path, name, **settings):
    from torchtsp.train.config import TrainConfig
    from torchtsp.train.trainer import run_training

    cfg = TrainConfig(**{**TRAIN, "out": str(tmp_path / name), **settings})
    return pools(4).run(run_training, cfg)[0]


def test_training_with_pp_matches_tsp_and_resumes_on_another_split(pools, tmp_path):
    piped = train(pools, tmp_path, "pp", pp=2, tsp=2, schedule="gpipe")
    flat = train(pools, tmp_path, "tsp", tsp=4)
    assert piped["mesh"] == {"pp": 2, "dp": 1, "sp": 1, "tp": 1, "tsp": 2}
    # The same model, batch and AdamW: float32 round-off only (reordered sums), compounded over 4 steps.
    for step, (a, b) in enumerate(zip(piped["losses"], flat["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    # Resume each run's step-2 checkpoint on the other split: the DCP checkpoint (reference names) reshards.
    for source, settings, expected in (("pp", {"tsp": 4}, flat), ("tsp", {"pp": 2, "tsp": 2}, piped)):
        step2 = tmp_path / source / "checkpoints" / "step_000002"
        resumed = train(pools, tmp_path, f"from_{source}", resume=str(step2), **settings)
        assert resumed["last_step"] == 4 and len(resumed["losses"]) == 2
        for a, b in zip(resumed["losses"], expected["losses"][2:]):
            assert abs(a - b) <= 1e-5 * abs(b), (source, a, b)


@pytest.mark.parametrize("scheme", ["tp", "sp"])
def test_training_pp2_with_tp_or_sp_matches_single_device(pools, tmp_path, scheme):
    """``torchtsp train --nproc 4 --pp 2 --scheme tp --tp 2`` (and sp) against the single-device training loop."""
    from torchtsp.presets import get_preset
    from torchtsp.train.config import TrainConfig
    from torchtsp.train.single import train_single

    piped = train(pools, tmp_path, scheme, pp=2, scheme=scheme, **{scheme: 2})
    assert piped["mesh"]["pp"] == 2 and piped["mesh"][scheme] == 2
    want = train_single(get_preset(TRAIN["preset"]), TRAIN["steps"], TRAIN["batch_size"], TRAIN["seq_len"],
                        lr=TrainConfig.lr, seed=0, prompt=None)
    # The same model, batch and AdamW: float32 round-off only (reordered sums), compounded over 4 steps.
    for step, (a, b) in enumerate(zip(piped["losses"], want, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)


# ---------------------------------------------------------------- clear errors, before any communication


@pytest.mark.parametrize("pp,microbatches,batch,n_layers,match", [
    (2, 1, 4, 4, "fewer than the 2 pipeline stages"),
    (3, 3, 6, 4, "4 layers do not divide into 3 stages"),
    (2, 3, 4, 4, "does not divide into 3 microbatches"),
])
def test_bad_pipeline_splits_are_refused(pp, microbatches, batch, n_layers, match):
    from torchtsp.schemes import check_pipeline, get_scheme

    with pytest.raises(ValueError, match=match):
        check_pipeline(get_scheme("tsp"), CFG.replace(n_layers=n_layers), pp, microbatches, batch, {"dp": 1})


def test_pipeline_defaults_and_refusals():
    from torchtsp.schemes import check_pipeline, get_scheme
    from torchtsp.train.config import TrainConfig

    assert check_pipeline(get_scheme("tsp"), CFG, 2, None, 4, {"dp": 1}) == 2  # one microbatch per stage
    for scheme in ("tp", "sp"):  # stages of any scheme whose model runs in three parts
        assert check_pipeline(get_scheme(scheme), CFG, 2, None, 4, {"dp": 1}) == 2
    with pytest.raises(ValueError, match="does not run as pipeline stages"):
        check_pipeline(get_scheme("tp_sp"), CFG, 2, None, 4, {"dp": 1})
    moe = CFG.replace(n_experts=4, moe_top_k=2, moe_ffn_dim=32)
    with pytest.raises(ValueError, match="mixture-of-experts model with a load-balancing loss"):
        check_pipeline(get_scheme("tsp"), moe.replace(router_aux_loss_coef=0.01), 2, None, 4, {"dp": 1})
    assert check_pipeline(get_scheme("tsp"), moe, 2, None, 4, {"dp": 1}) == 2  # no aux loss: stages are exact
    with pytest.raises(ValueError, match="tied embeddings"):
        check_pipeline(get_scheme("tsp"), CFG.replace(tie_embeddings=True), 2, None, 4, {"dp": 1})
    with pytest.raises(ValueError, match="4 stages"):  # interleaved: two stages per rank
        check_pipeline(get_scheme("tsp"), CFG.replace(n_layers=2), 2, None, 4, {"dp": 1}, "interleaved_1f1b")
    with pytest.raises(ValueError, match="applies to pipeline stages"):
        TrainConfig(microbatches=2)


# ---------------------------------------------------------------- two "nodes" on this machine


def test_two_node_torchrun_launch_matches_one_launcher(pools, tmp_path):
    """Two torchrun agents (--nnodes 2, one per "node", 2 ranks each) meet at a local c10d rendezvous. torchrun
    numbers each agent's ranks contiguously and the mesh is [pp, tsp] with pp outermost, so each node holds one
    stage's TSP group and only the stage boundary crosses between the nodes."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    flags = ["--pp", "2", "--tsp", "2", "--batch-size", "4", "--seq-len", "32", "--steps", "3", "--sample-tokens", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    agents = [subprocess.Popen([str(torchrun), "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pp",
                                "-m", "torchtsp", "train", *flags, "--out", str(tmp_path / "nodes")],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for rank in (0, 1)]
    try:
        logs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    assert all(agent.returncode == 0 for agent in agents), logs
    two_nodes = [json.loads(line)["loss"] for line in (tmp_path / "nodes" / "metrics.jsonl").open()]
    one = train(pools, tmp_path, "one", pp=2, tsp=2, steps=3, checkpoint_every=0)
    assert len(two_nodes) == 3
    # The same ranks, mesh and operations, only launched differently: identical float32 results.
    assert two_nodes == one["losses"]


# ---------------------------------------------------------------- the pipeline model (plan) against measurement


def test_bench_cells_match_the_pipeline_model(pools):
    from torchtsp.analysis.pipeline_model import predict_pipeline
    from torchtsp.bench.pipeline import pipeline_cells_on_rank

    cfg = torchtsp.ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, vocab_size=257,
                               max_seq_len=256)
    (cell,) = pools(4).run(pipeline_cells_on_rank, cfg, 2, 2, 4, [256], 2, "1f1b", 1, 1, 0, 120)[0]
    plan = predict_pipeline(cfg, 4, 256, pp=2, tsp=2, microbatches=2, dtype_bytes=4, foreach=False)
    # The stage-boundary sends comm.py counted are exactly the model's: M shards of [B/M, S/tsp, h] in fp32.
    assert cell["pipeline"]["p2p_recv_bytes_max"] == plan.p2p_bytes_per_rank == 2 * 2 * 128 * 128 * 4
    for stage, (measured, predicted) in enumerate(zip(cell["pipeline"]["stage_peak_bytes"],
                                                      [s.total for s in plan.stages])):
        # The TSP walk is calibrated to a few percent; the pipeline adds microbatches in flight, accumulated
        # gradients and the library's receive buffers (docs/analysis.md): 10% leaves room for allocator order.
        assert abs(measured - predicted) <= 0.10 * measured, (stage, measured, predicted)
    assert cell["baseline"]["median_step_s"] > 0 and cell["pipeline"]["median_step_s"] > 0


def test_plan_places_tsp_inside_a_node_and_names_the_slow_axes():
    from torchtsp.analysis.pipeline_model import axis_nodes, pipeline_bubble

    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble(2, 2, "interleaved_1f1b") == pytest.approx(1 / 5)
    # 4 nodes of 8 GPUs, [pp=2, dp=2, tsp=8]: TSP fills a node, dp spans 2 nodes, pp 2 nodes (stride 16).
    assert axis_nodes(2, 2, 8, 8) == {"pp": 2, "dp": 2, "tsp": 1}
    assert axis_nodes(2, 1, 4, 8) == {"pp": 1, "dp": 1, "tsp": 1}  # all inside one node
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "torchtsp", "plan", "--preset", "paper-7b", "--seq-len", "32768",
                          "--batch-size", "16", "--pp", "4", "--microbatches", "8", "--gpus-per-node", "8",
                          "--nodes", "8", "--inter-node-gbps", "400", "--json"], capture_output=True, text=True,
                         check=True)
    plan = json.loads(out.stdout)
    assert plan["inputs"]["tsp"] == 8 and plan["inputs"]["dp"] == 2
    assert plan["pipeline"]["bubble"] == pytest.approx(3 / 11)
    where = plan["placement"]
    assert not where["tsp"]["crosses_nodes"] and where["pp"]["crosses_nodes"] and where["dp"]["crosses_nodes"]
    # pp's cost: 8 GPUs of a node each send their boundary shards over the node's 400 Gbit/s link.
    assert where["pp"]["seconds_per_step"] == pytest.approx(8 * plan["pipeline"]["p2p_bytes_per_rank"] / 50e9)
    bad = subprocess.run([sys.executable, "-m", "torchtsp", "plan", "--pp", "3", "--gpus", "6", "--preset", "tiny"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "do not divide into 3 stages" in bad.stderr


# ---------------------------------------------------------------- a stalled stage is an error, not a hang


def stalled_stage_on_rank(timeout_s):
    import time

    from torchtsp.distributed import comm

    mesh = torchtsp.init_mesh(pp=2, tsp=2, timeout_s=timeout_s)
    torch.manual_seed(0)
    model = pipeline_parallelize(torchtsp.Transformer(CFG, device="meta"), mesh, timeout_s=timeout_s)
    if comm.global_rank() == 3:  # one rank of the last stage never joins the step
        time.sleep(3 * timeout_s)
        return None
    tokens, labels = batch(CFG, B, S)
    start = time.monotonic()
    try:
        model.forward_backward(tokens, labels)
    except Exception as e:  # noqa: BLE001 - whatever the library raises, it must raise, and soon
        return time.monotonic() - start, f"{type(e).__name__}: {e}"[:300]
    return time.monotonic() - start, "finished"


def test_a_stalled_stage_times_out_instead_of_hanging():
    from torchtsp import spawn

    timeout_s = 3.0
    results = spawn(stalled_stage_on_rank, 4, timeout_s, timeout_s=120)
    for rank, result in enumerate(results[:3]):
        waited, what = result
        # The ranks waiting on the stalled one (a send or receive on the pipeline group, a TSP collective on the
        # axis) give up after about one timeout, and those waiting on them in turn after about one more.
        assert what != "finished" and waited < 3 * timeout_s, (rank, waited, what)
