"""Pipeline stages around TSP ([pp, dp, tsp] mesh) against the single-device reference."""

import copy

import pytest
import torch

import torchtsp
from helpers import batch, rel_err
from torchtsp.parallel.pipeline import pipeline_parallelize

CFG = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, n_layers=4, max_seq_len=64)
B, S, STEPS = 4, 16, 2


def steps_on_rank(pp, dp, tsp, schedule, microbatches):
    """Loss of every step and every gradient of this rank's stages, pipeline vs reference (SGD between steps)."""
    mesh = torchtsp.init_mesh(pp=pp, dp=dp, tsp=tsp)
    torch.manual_seed(0)
    ref = torchtsp.Transformer(CFG)
    model = pipeline_parallelize(copy.deepcopy(ref), mesh, microbatches=microbatches, schedule=schedule)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_grads = dict(ref.named_parameters())
    out = []
    for step in range(STEPS):
        tokens, labels = batch(CFG, B, S, seed=step)
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


def check_against_reference(results, pp, dp, tsp, microbatches, crossings=1):
    names = set()
    for rank, steps in enumerate(results):
        for step, r in enumerate(steps):
            # float32 round-off: sums over microbatches, ranks and head groups are reordered, ~1e-7 relative.
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (rank, step, r)
            worst = max(r["grad_err"], key=r["grad_err"].get)
            # Gradients sum D partial products and M microbatches in another order than the reference.
            assert r["grad_err"][worst] <= 1e-4, (rank, step, worst, r["grad_err"][worst])
            names |= set(r["grad_err"])
    assert names == {n for n, _ in torchtsp.Transformer(CFG, device="meta").named_parameters()}
    # Rank p of a stage sends its own token shard [B/(dp M), S/tsp, h] to rank p of the next: per microbatch one
    # activation forward and its gradient back, fp32; nothing gathered.
    shard = (B // (dp * microbatches)) * (S // tsp) * CFG.dim * 4
    for rank, steps in enumerate(results):
        assert steps[0]["pp_bytes"] == crossings * microbatches * shard, (rank, steps[0]["pp_bytes"], shard)
        assert steps[0]["pp_sent"] == crossings * microbatches * shard


@pytest.mark.parametrize("schedule,microbatches", [("gpipe", 2), ("1f1b", 4)])
def test_pp2_tsp2_matches_reference(pools, schedule, microbatches):
    results = pools(4).run(steps_on_rank, 2, 1, 2, schedule, microbatches)
    check_against_reference(results, 2, 1, 2, microbatches)


def test_interleaved_1f1b_matches_reference(pools):
    # Two stages per rank (4 stages of one layer each on pp=2): 3 boundaries, each crossed forward and backward
    # per microbatch, so each of the 2 ranks receives (and sends) 3 shards per microbatch.
    results = pools(4).run(steps_on_rank, 2, 1, 2, "interleaved_1f1b", 2)
    check_against_reference(results, 2, 1, 2, 2, crossings=3)


def test_pp2_dp2_tsp2_matches_reference(pools):
    results = pools(8).run(steps_on_rank, 2, 2, 2, "1f1b", 2)
    check_against_reference(results, 2, 2, 2, 2)
