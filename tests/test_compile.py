"""``--compile`` (torchtsp.compiled): each scheme's compiled steps against the eager single-device reference model,
no recompilation after the first step, and a clear refusal where TorchInductor cannot compile.

Tolerance: compiled regions fuse elementwise chains (norm, RoPE, silu * up and their transposes) and may reorder
a reduction (the norm's mean of squares) or contract a multiply-add, so a compiled value can differ from eager
by a few fp32 roundings per fused op. Through a few layers and three SGD steps that stays below 1e-5 relative to
the tensor's scale; the eager schemes themselves are already held to the same order against the reference (a
sum over D ranks' partials is reordered too). A wrong compiled piece (a dropped term, a wrong sign in RoPE's
transpose, a stale graph) errs by O(1).
"""

from __future__ import annotations

import time

import pytest
import torch

import torchtsp
from helpers import batch, rel_err
from torchtsp import compiled
from torchtsp.config import ModelConfig

TOL = 1e-5
STEPS, LR = 3, 0.5
# Tiny: compiling on the CPU costs seconds per graph; two layers exercise the step-to-step graph reuse across
# layers (same shapes, other weights).
CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=67, max_seq_len=64)


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def steps_against_reference(world: int, scheme: str, options: dict, B: int = 2, S: int = 32) -> dict:
    """On every rank: ``STEPS`` SGD steps of ``scheme`` compiled and of the eager reference model from the same
    weights and batches; each step's two losses, the worst gradient error, and the graphs compiled per step."""
    from torchtsp.distributed.mesh import init_mesh
    from torchtsp.layout import Layout

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    ref = torchtsp.Transformer(CFG)
    mesh = init_mesh(Layout.resolve(scheme, world, cfg=CFG, seq_len=S, batch=B, **options))
    compiled.enable(True)
    try:
        torch.manual_seed(0)
        model = torchtsp.parallelize(torchtsp.Transformer(CFG, device="meta"), mesh, scheme, **options)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        out = {"loss": [], "ref_loss": [], "grad_err": [], "graphs": [], "step_s": []}
        for step in range(STEPS):
            tokens, labels = batch(CFG, B, S, seed=step)
            start = time.perf_counter()
            loss = model.loss(tokens, labels)
            loss.backward()
            out["step_s"].append(time.perf_counter() - start)
            out["graphs"].append(_graphs())
            compiled.enable(False)  # the reference runs eager
            ref_loss = ref.loss(tokens, labels)
            ref_loss.backward()
            compiled.enable(True)
            grads = model.full_grads()
            out["grad_err"].append(max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters()))
            out["loss"].append(loss.item())
            out["ref_loss"].append(ref_loss.item())
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        return out
    finally:
        compiled.enable(False)


FAMILIES = {
    "tsp": {},
    "tp": {},
    "tp-megatron-sp": {"sequence_parallel": True},
    "sp": {},
    "tp_sp": {},
    "torch_tp": {},
    "dp": {},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_steps_match_eager_reference_and_never_recompile(pools, family):
    scheme = family.split("-")[0]
    world = 4 if scheme == "tp_sp" else 2
    for rank, out in enumerate(pools(world).run(steps_against_reference, world, scheme, FAMILIES[family])):
        for step in range(STEPS):
            assert abs(out["loss"][step] - out["ref_loss"][step]) <= TOL * abs(out["ref_loss"][step]), (rank, step, out)
            assert out["grad_err"][step] < TOL, (rank, step, out)
        assert out["graphs"][0] > 0, "nothing was compiled"
        assert out["graphs"][1] == out["graphs"][-1] == out["graphs"][0], ("a later step compiled again", out)
        print(f"{family} rank {rank}: {out['graphs'][0]} graphs, step times {[round(t, 2) for t in out['step_s']]} s")


def test_compiled_pieces_match_eager_reference_single_process():
    """The reference model with the shared pieces compiled inside its eager blocks (what every scheme calls; the dp
    scheme's whole blocks are the multirank test's), against the eager reference: losses and gradients within
    fp32 round-off, and the second step compiles nothing."""
    torch.manual_seed(0)
    ref = torchtsp.Transformer(CFG)
    tokens, labels = batch(CFG, 2, 32)
    ref_loss = ref.loss(tokens, labels)
    ref_loss.backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = torchtsp.Transformer(CFG)
    compiled.enable(True)
    try:
        graphs = []
        for _ in range(2):
            model.zero_grad()
            loss = model.loss(tokens, labels)
            loss.backward()
            graphs.append(_graphs())
    finally:
        compiled.enable(False)
    assert graphs[0] > 0 and graphs[1] == graphs[0], graphs
    assert rel_err(loss.detach(), ref_loss.detach()) < TOL
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < TOL, name


def test_no_cpp_compiler_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(OSError, match="C\\+\\+ compiler.*run without --compile"):
        compiled.enable(True)
    assert not compiled.enabled()
    with pytest.raises(OSError, match="cpu and cuda"):
        compiled.check_backend("mps")


def test_compile_flags_reach_train_config_and_bench():
    from torchtsp.cli import build_parser

    args = build_parser().parse_args(["bench", "--compile", "--schemes", "tsp"])
    assert args.compile
    from torchtsp.train.config import TrainConfig

    assert TrainConfig(compile=True).compile and not TrainConfig().compile
