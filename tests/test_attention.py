"""The zigzag attention kernel against PyTorch's causal SDPA, with the fused CPU kernel and the portable one."""

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from torchtsp.distributed import attention, zigzag


@pytest.fixture(params=["fused_cpu", "portable"])
def kernel(request, monkeypatch):
    if request.param == "portable":  # the path every non-CPU device takes, checked here on the CPU
        monkeypatch.setattr(attention, "_flash_forward", attention.portable_forward)
        monkeypatch.setattr(attention, "_flash_backward", attention.portable_backward)
        monkeypatch.setattr(attention, "KEY_BLOCK", 5)  # several key blocks per part
    return request.param


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_attention_equals_causal_sdpa(kernel, world):
    torch.manual_seed(world)
    B, H, S, d = 2, 3, 24, 8
    q, k, v = (torch.randn(B, H, S, d, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    outs, dqs, dk, dv = [], [], 0, 0
    for rank in range(world):  # every rank's queries against the full keys, as after the K/V all-gather
        q_local = zigzag.shard(q.detach(), world, rank, dim=2).requires_grad_()
        k_full, v_full = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = attention.zigzag_causal_attention(q_local, k_full, v_full, rank, world)
        gq, gk, gv = torch.autograd.grad(out, (q_local, k_full, v_full), zigzag.shard(grad, world, rank, dim=2))
        outs.append(out.detach())
        dqs.append(gq)
        dk, dv = dk + gk, dv + gv
    # float32 round-off: the LSE merge and the per-part backward sum in another order than SDPA.
    assert rel_err(zigzag.unshard(torch.stack(outs), 2), ref) < 1e-6
    for got, want in zip((zigzag.unshard(torch.stack(dqs), 2), dk, dv), ref_grads):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_portable_kernel_matches_fused_cpu_kernel(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 12, 8)
    k = torch.randn(2, 3, 12 if causal else 17, 8)
    v = torch.randn_like(k)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    dout = torch.randn_like(out)
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    p_out, p_lse = attention.portable_forward(q, k, v, causal)
    assert rel_err(p_out, out) < 1e-6 and rel_err(p_lse, lse) < 1e-6
    for got, want in zip(attention.portable_backward(dout, q, k, v, p_out, p_lse, causal), fused):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("world,group", [(1, 2), (2, 2), (2, 4), (3, 3)])
def test_gqa_without_expanded_kv_equals_causal_sdpa(kernel, world, group):
    """Fewer K/V heads than query heads: the kernel never sees expanded K/V, yet equals SDPA on expanded K/V."""
    torch.manual_seed(world)
    B, H_kv, S, d = 2, 2, 12 * world, 8
    q = torch.randn(B, H_kv * group, S, d, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, d, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    outs, dqs, dk, dv = [], [], 0, 0
    for rank in range(world):
        q_local = zigzag.shard(q.detach(), world, rank, dim=2).requires_grad_()
        k_full, v_full = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = attention.zigzag_causal_attention(q_local, k_full, v_full, rank, world)
        gq, gk, gv = torch.autograd.grad(out, (q_local, k_full, v_full), zigzag.shard(grad, world, rank, dim=2))
        outs.append(out.detach())
        dqs.append(gq)
        dk, dv = dk + gk, dv + gv
    # float32 round-off, as above; dK/dV also sum the g query heads in another order.
    assert rel_err(zigzag.unshard(torch.stack(outs), 2), ref) < 1e-6
    for got, want in zip((zigzag.unshard(torch.stack(dqs), 2), dk, dv), ref_grads):
        assert rel_err(got, want) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_cuda_kernels_match_portable_kernel(dtype, causal):
    """The fused CUDA ops (efficient for fp32, flash for bf16) against the portable kernel, forward and backward."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 64, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 3, 64 if causal else 96, 64, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    out, lse = attention._flash_forward(q, k, v, causal)
    dout = torch.randn_like(out)
    p_out, p_lse = attention.portable_forward(q, k, v, causal)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: 8 mantissa bits, fp32 accumulation in both
    assert rel_err(out.float(), p_out.float()) < tol and rel_err(lse, p_lse) < tol
    fused = attention._flash_backward(dout, q, k, v, out, lse, causal)
    for got, want in zip(fused, attention.portable_backward(dout, q, k, v, p_out, p_lse, causal)):
        assert rel_err(got.float(), want.float()) < tol
