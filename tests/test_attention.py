"""The zigzag attention kernel against PyTorch's causal SDPA, with the fused CPU kernel and the portable one."""

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from torchtsp import kernels
from torchtsp.distributed import attention, zigzag
from torchtsp.distributed.comm import AxisComm


@pytest.fixture(params=["fused_cpu", "portable"])
def kernel(request, monkeypatch):
    if request.param == "portable":  # the path every non-CPU device takes, checked here on the CPU
        monkeypatch.setattr(kernels, "_flash_forward", kernels.portable_forward)
        monkeypatch.setattr(kernels, "_flash_backward", kernels.portable_backward)
        monkeypatch.setattr(kernels, "KEY_BLOCK", 5)  # several key blocks per part
    return request.param


def zigzag_vs_sdpa(q, k, v, world):
    """Every rank's zigzag attention (forward and backward functions) against causal SDPA on the whole sequence:
    (outputs, dq, dk, dv) of the ranks reassembled in global order, and SDPA's (output, dq, dk, dv)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    # Every rank's local K/V [2, B, S/D, Hkv, d], token-major, stacked rank by rank as the all-gather returns them.
    kv_local = [zigzag.shard(torch.stack([k, v]).detach().transpose(2, 3), world, r, dim=2) for r in range(world)]
    gathered = torch.stack(kv_local)
    outs, dqs, dkv = [], [], 0
    for rank in range(world):
        # token-major queries (memory [B, S/D, H, d]), as the projections deliver them
        q_local = zigzag.shard(q.detach().transpose(1, 2), world, rank, dim=1).transpose(1, 2)
        out, lse = attention.zigzag_attention_forward(q_local, gathered, rank, world)
        dout = zigzag.shard(grad, world, rank, dim=2)
        dq, dkv_rank = attention.zigzag_attention_backward(dout, q_local, gathered, out, lse, rank, world)
        outs.append(out)
        dqs.append(dq)
        dkv = dkv + dkv_rank  # the reduce-scatter's sum over ranks
    full_dkv = zigzag.unshard(dkv, dim=2).transpose(2, 3)  # [2, B, Hkv, S, d]
    got = (zigzag.unshard(torch.stack(outs), 2), zigzag.unshard(torch.stack(dqs), 2), full_dkv[0], full_dkv[1])
    return got, (ref.detach(), *ref_grads)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_attention_equals_causal_sdpa(kernel, world):
    torch.manual_seed(world)
    B, H, S, d = 2, 3, 24, 8
    got, want = zigzag_vs_sdpa(*(torch.randn(B, H, S, d) for _ in range(3)), world)
    # float32 round-off: the LSE merge and the per-part backward sum in another order than SDPA.
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6


def test_attention_autograd_over_a_one_rank_axis_equals_causal_sdpa():
    """``zigzag_causal_attention`` (the autograd op SP and TP x SP use): gather, attention and reduce-scatter on
    a one-rank axis, against SDPA."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    kv = torch.stack([k, v]).transpose(2, 3).detach().requires_grad_()
    out = attention.zigzag_causal_attention(q, kv, AxisComm(None, "sp"))
    dq, dkv = torch.autograd.grad(out, (q, kv), grad)
    assert rel_err(out, ref) < 1e-6  # float32 round-off, as above
    for g, w in zip((dq, *dkv.transpose(2, 3)), ref_grads):
        assert rel_err(g, w) < 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_portable_kernel_matches_fused_cpu_kernel(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 12, 8)
    k = torch.randn(2, 3, 12 if causal else 17, 8)
    v = torch.randn_like(k)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    dout = torch.randn_like(out)
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    p_out, p_lse = kernels.portable_forward(q, k, v, causal)
    assert rel_err(p_out, out) < 1e-6 and rel_err(p_lse, lse) < 1e-6
    for got, want in zip(kernels.portable_backward(dout, q, k, v, p_out, p_lse, causal), fused):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("world,group", [(1, 2), (2, 2), (2, 4), (3, 3)])
def test_gqa_without_expanded_kv_equals_causal_sdpa(kernel, world, group):
    """Fewer K/V heads than query heads: the kernel never sees expanded K/V, yet equals SDPA on expanded K/V."""
    torch.manual_seed(world)
    B, H_kv, S, d = 2, 2, 12 * world, 8
    got, want = zigzag_vs_sdpa(torch.randn(B, H_kv * group, S, d), torch.randn(B, H_kv, S, d),
                               torch.randn(B, H_kv, S, d), world)
    # float32 round-off, as above; dK/dV also sum the g query heads in another order.
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_cuda_kernels_match_portable_kernel(dtype, causal):
    """The fused CUDA ops (efficient for fp32, flash for bf16) against the portable kernel, forward and backward."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 64, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 3, 64 if causal else 96, 64, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    out, lse = kernels._flash_forward(q, k, v, causal)
    dout = torch.randn_like(out)
    p_out, p_lse = kernels.portable_forward(q, k, v, causal)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: 8 mantissa bits, fp32 accumulation in both
    assert rel_err(out.float(), p_out.float()) < tol and rel_err(lse, p_lse) < tol
    fused = kernels._flash_backward(dout, q, k, v, out, lse, causal)
    for got, want in zip(fused, kernels.portable_backward(dout, q, k, v, p_out, p_lse, causal)):
        assert rel_err(got.float(), want.float()) < tol
