"""CUDA tensors without a GPU: torch's FakeTensorMode on a CPU-only build, made to run autograd, plus the
stricter argument checks of the fused attention kernels that torch's meta rules leave out.

Everything here changes process-wide state that cannot be undone (a device guard registered for CUDA,
torch.cuda functions replaced), so it is only ever installed in a process of its own
(``tests/fake_cuda_cases.py``, run by ``tests/test_fake_cuda.py``).

How it works, and why each piece is needed on torch 2.13 CPU builds:

* FakeTensorMode gives tensors the device "cuda" and runs each op's meta (shape and dtype) rule. Moving a
  tensor to "cuda" still enters a device guard in C++, which a CPU build lacks (and torch's own
  ``_ensureCUDADeviceGuardSet`` only fills it in on CUDA builds without a device): ``install`` registers the
  CPU no-op guard for CUDA, through the C++ registry libc10 exports.
* The autograd engine gives every CUDA tensor a stream and an event, and refuses when no accelerator is
  compiled in. C++ therefore sees fake tensors on the meta device (``prim.device`` answers "meta"), while
  Python code, the library's included, sees "cuda" (``tensor.device``). C++ builds some tensors from a fake
  one's options (gradient formulas, wrapped scalars): a factory on the meta device without tensor arguments
  is made on the fake GPU, and a real meta tensor meeting fake ones is taken as a fake CUDA one.
* Ops without any fake tensor or CUDA device in their arguments run for real: host-side bookkeeping (the
  device mesh's rank table, init seeds, a reference model on the CPU) keeps its values.
* ``_local_scalar_dense`` (``.item()``, ``.tolist()``, ``bool(t)``) has no value on a fake tensor: it answers 0
  and is recorded in ``host_reads``, with the library line that asked, so a test can see each host read.
"""

from __future__ import annotations

import ctypes
import math
import os
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree

CUDA = torch.device("cuda", 0)
META = torch.device("meta")
aten = torch.ops.aten

_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry
_REGISTER = "_ZN3c104impl19registerDeviceGuardENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterfaceE"


def install() -> None:
    """Make this process able to hold fake CUDA tensors: a CUDA device guard and a one-GPU torch.cuda."""
    if torch.cuda.is_available():
        raise RuntimeError("fake CUDA is for CPU-only builds; this torch has a GPU")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    slots = (ctypes.c_void_p * 64).in_dll(lib, _REGISTRY)
    register = getattr(lib, _REGISTER)
    register.argtypes = [ctypes.c_int8, ctypes.c_void_p]
    cpu, cuda = 0, 1  # c10::DeviceType
    if not slots[cuda]:
        register(cuda, slots[cpu])
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # c10d asks it before broadcasting
    torch.Generator = _Generator
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)  # pipelining forks the RNG
    torch.cuda.set_rng_state = lambda state, device="cuda": None


class _Generator(torch._C.Generator):
    """A CUDA generator is a CPU one here (CPU builds have none): sampling's random draws are not exercised."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu" if torch.device(device).type == "cuda" else device)


def init_world(rank: int, world: int) -> None:
    """This process as rank ``rank`` of ``world`` on torch's ``fake`` process-group backend (every collective
    answers at once, moving nothing). Re-initialises to play another rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtsp.distributed import comm

    comm.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


# ------------------------------------------------------------------ kernel contracts


class KernelContractError(AssertionError):
    """A fused CUDA attention op was called with arguments its CUDA kernel refuses (or misreads)."""


def _check(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise KernelContractError(f"{op}: {what}")


def _common_qkv(op, q, k, v):
    _check(q.dim() == k.dim() == v.dim() == 4, op, "q, k, v must be 4-d [B, H, L, d]")
    _check(q.dtype == k.dtype == v.dtype, op, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check(q.shape[0] == k.shape[0] == v.shape[0], op, "batch sizes differ")
    _check(k.shape[:3] == v.shape[:3], op, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    _check(q.shape[1] == k.shape[1], op, f"head counts differ: q {q.shape[1]}, k {k.shape[1]} (no GQA here)")
    _check(q.shape[3] == k.shape[3], op, "q and k head dims differ")
    _check(all(t.stride(-1) == 1 for t in (q, k, v)), op, "the last dimension must be contiguous")


def _flash_forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None):
    op = "_scaled_dot_product_flash_attention"
    _common_qkv(op, q, k, v)
    _check(q.dtype in (torch.float16, torch.bfloat16), op, f"flash takes fp16/bf16, got {q.dtype}")


def _flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
                    scale=None):
    op = "_scaled_dot_product_flash_attention_backward"
    _common_qkv(op, q, k, v)
    _check(dout.shape == out.shape == q.shape, op, f"dout {tuple(dout.shape)}, out {tuple(out.shape)} and q "
                                                   f"{tuple(q.shape)} must have one shape")
    _check(dout.dtype == out.dtype == q.dtype, op, "dout, out and q dtypes differ")
    _check(lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3]), op,
           f"logsumexp must be float32 {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
    _check(lse.is_contiguous(), op, "logsumexp must be contiguous")
    _check(cum_q is None and cum_k is None, op, "cum_seq_q/k are for nested batches only")
    _check((max_q, max_k) == (q.shape[2], k.shape[2]), op, f"max_q, max_k = {max_q}, {max_k} but q and k "
                                                            f"hold {q.shape[2]} and {k.shape[2]} tokens")


def _efficient_forward(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
    op = "_scaled_dot_product_efficient_attention"
    _common_qkv(op, q, k, v)
    _check(compute_log_sumexp, op, "the LSE is needed (compute_log_sumexp=True)")


def _efficient_backward(dout, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                        is_causal=False, scale=None):
    op = "_scaled_dot_product_efficient_attention_backward"
    _common_qkv(op, q, k, v)
    _check(dout.shape == out.shape == q.shape, op, "dout, out and q must have one shape")
    _check(dout.dtype == out.dtype == q.dtype, op, "dout, out and q dtypes differ")
    # The CUDA kernel pads the LSE to a multiple of 32 queries; ROCm's does not (torch's meta rule, issue 146848).
    rows = q.shape[2] if torch.version.hip else math.ceil(q.shape[2] / 32) * 32
    _check(lse.dtype == torch.float32 and tuple(lse.shape) == (*q.shape[:2], rows), op,
           f"logsumexp must be float32 {(*q.shape[:2], rows)}, got {lse.dtype} {tuple(lse.shape)}")
    _check(lse.is_contiguous(), op, "logsumexp must be contiguous")
    _check(len(grad_input_mask) == 4 and not grad_input_mask[3] or attn_bias is not None, op,
           "grad_input_mask asks a bias gradient without a bias")


CONTRACTS = {
    aten._scaled_dot_product_flash_attention.default: _flash_forward,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
}

# The ops tests/test_tsp_step.py's SyncSpy flags: each one a host-device sync on CUDA.
from test_tsp_step import INDEXING_OPS, SYNC_OPS  # noqa: E402


def _library_line() -> str:
    """The innermost torchtsp frame of the current stack, "file:line (function)" ('' if none)."""
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}torchtsp{os.sep}" in frame.filename:
            return f"{frame.filename.split(os.sep + 'torchtsp' + os.sep)[-1]}:{frame.lineno} ({frame.name})"
    return ""


class FakeCuda(FakeTensorMode):
    """``with FakeCuda() as fake:`` tensors made on "cuda" are fake; ``fake.ops`` counts every op run on fake
    tensors (c10d collectives included), ``fake.syncs`` lists the host-syncing ops (``SYNC_OPS``, boolean-mask
    indexing) with the library line that issued them, ``fake.host_reads`` the ``.item()`` calls among them."""

    def __init__(self, host_values: dict | None = None):
        super().__init__(allow_non_fake_inputs=True)
        # Answers to host reads issued from a given source file (path suffix -> value), for reads whose value
        # a real run knows: e.g. the pipelining schedule's vote on static shapes.
        self.host_values = host_values or {}
        self.ops: Counter = Counter()
        self.syncs: list[tuple[str, str]] = []
        self.host_reads: list[str] = []

    def reset(self) -> None:
        self.ops.clear()
        self.syncs.clear()
        self.host_reads.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # C++ asking: see the module docstring
            return META
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        devices = [d for d in leaves if isinstance(d, torch.device)]
        fake = any(isinstance(t, FakeTensor) for t in tensors)
        factory_from_fake = not tensors and any(d.type == "meta" for d in devices)
        if not fake and not factory_from_fake and not any(d.type == "cuda" for d in devices):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(self._onto_fake_gpu, (args, kwargs))
        self.ops[str(func.overloadpacket) if func.namespace == "c10d" else func] += 1
        if func in CONTRACTS:
            CONTRACTS[func](*args, **kwargs)
        if func in SYNC_OPS or (func in INDEXING_OPS and any(
                t is not None and t.dtype in (torch.bool, torch.uint8) for t in (args[1] if len(args) > 1 else ()))):
            self.syncs.append((str(func), _library_line()))
        if func is aten._local_scalar_dense.default:
            files = [frame.filename for frame in traceback.extract_stack()]
            for suffix, value in self.host_values.items():
                if any(f.endswith(suffix) for f in files):
                    return value
            self.host_reads.append(_library_line())
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _onto_fake_gpu(self, x):
        if isinstance(x, torch.device) and x.type == "meta":
            return CUDA
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) and x.device.type == "meta":
            return FakeTensor(self, x, CUDA)
        return x

    def count(self, name: str) -> int:
        """Calls of ops whose name contains ``name`` (e.g. "flash_attention_backward", "c10d.broadcast_")."""
        return sum(n for op, n in self.ops.items() if name in str(op))
