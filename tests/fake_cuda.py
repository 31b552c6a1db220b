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

import torchtsp

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
    slots = (ctypes.c_void_p * 2).in_dll(lib, _REGISTRY)  # CPU, CUDA: the first two device types
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


def _size_rank(group) -> tuple[int, int]:
    """(size, rank) of the process group a c10d op receives (boxed as a ScriptObject)."""
    pg = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group
    return pg.size(), pg.rank()


def _collective_tensors(op, tensors):
    _check(all(t.is_contiguous() for t in tensors), op, "NCCL needs contiguous tensors")


def _whole_and_part(op, whole, part, group):
    """An all-gather's output (a reduce-scatter's input) holds one part per rank of the group, in the part's dtype."""
    _collective_tensors(op, (whole, part))
    _check(whole.dtype == part.dtype, op, f"dtypes differ: {whole.dtype}, {part.dtype}")
    _check(whole.numel() == _size_rank(group)[0] * part.numel(), op,
           f"{whole.numel()} elements for {_size_rank(group)[0]} x {part.numel()}")


def _allgather(output, input, group, *rest):
    _whole_and_part("c10d._allgather_base_", output, input, group)


def _reduce_scatter(output, input, group, *rest):
    _whole_and_part("c10d._reduce_scatter_base_", input, output, group)


def _alltoall(output, input, group, output_splits, input_splits, *rest):
    op = "c10d.alltoall_base_"
    _collective_tensors(op, (output, input))
    D = _size_rank(group)[0]
    _check(output.dtype == input.dtype, op, "dtypes differ")
    for t, splits, name in ((output, output_splits, "output"), (input, input_splits, "input")):
        row = t[0].numel() if t.dim() and t.shape[0] else 0
        _check(len(splits) in (0, D), op, f"{len(splits)} {name} splits for {D} ranks")
        _check(not splits or not row or sum(splits) * row == t.numel(), op,
               f"{name} splits {list(splits)} do not cover {t.shape[0]} rows")


def _rooted(tensors, group, *rest, root_arg=0):
    op = "c10d collective"
    _collective_tensors(op, tensors)
    roots = [r for r in rest if isinstance(r, int) and not isinstance(r, bool)]
    _check(not roots or 0 <= roots[root_arg] < _size_rank(group)[0], op,
           f"root {roots and roots[root_arg]} outside the group")


def _p2p(tensors, group, peer, tag):
    _collective_tensors("c10d send/recv", tensors)
    size, rank = _size_rank(group)
    _check(0 <= peer < size and peer != rank, "c10d send/recv", f"peer {peer} of rank {rank} in a group of {size}")


def _log_entry(func, args) -> tuple:
    """What the peers of a c10d op must agree on: its group, kind, peer (or root), shapes, dtype, and tag."""
    name = func.overloadpacket.__name__
    tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0], args[1]]
    group = next(a for a in args if isinstance(a, (torch.ScriptObject, dist.ProcessGroup)))
    pg = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group
    ints = [a for a in args[2:] if isinstance(a, int) and not isinstance(a, bool)]
    peer = ints[0] if name in ("send", "recv_", "broadcast_", "reduce_") else None
    tag = ints[1] if name in ("send", "recv_") else None
    splits = tuple(tuple(a) for a in args[3:5]) if name == "alltoall_base_" else None
    return (pg.group_name, pg.rank(), name, peer, tuple(tuple(t.shape) for t in tensors), str(tensors[0].dtype),
            tag, splits)


def check_pairing(logs: dict[int, list[tuple]]) -> list[str]:
    """Problems in how the ranks' c10d ops would meet, given every rank's ``comm_log`` (global rank -> log):
    in each group every rank issues the same collectives in the same order (kind, shapes, dtype, root), the
    all-to-all splits agree pairwise, and the k-th send from a to b meets the k-th receive at b from a with the
    same shape, dtype and tag. On a GPU a mismatch is a hang or garbage."""
    problems = []
    by_group: dict[str, dict[int, list[tuple]]] = {}
    for log in logs.values():
        for entry in log:
            by_group.setdefault(entry[0], {}).setdefault(entry[1], []).append(entry)
    for group, ranks in sorted(by_group.items()):
        collectives = {r: [e[2:6] if e[2] != "alltoall_base_" else e[2:3] + e[5:6] for e in log
                           if e[2] not in ("send", "recv_")] for r, log in ranks.items()}
        first = min(collectives)
        for r, seq in collectives.items():
            if seq != collectives[first]:
                diff = next((i for i, (a, b) in enumerate(zip(seq, collectives[first])) if a != b),
                            min(len(seq), len(collectives[first])))
                problems.append(f"group {group}: rank {r}'s collectives differ from rank {first}'s at #{diff}: "
                                f"{seq[diff:diff + 1]} vs {collectives[first][diff:diff + 1]}")
        a2a = {r: [e[7] for e in log if e[2] == "alltoall_base_"] for r, log in ranks.items()}
        for k in range(min(map(len, a2a.values()), default=0)):
            for r in a2a:
                for p in a2a:
                    out_r, in_p = a2a[r][k][0], a2a[p][k][1]
                    if out_r and in_p and out_r[p] != in_p[r]:
                        problems.append(f"group {group}: all-to-all #{k}: rank {r} expects {out_r[p]} rows from "
                                        f"{p}, which sends it {in_p[r]}")
        sends, recvs = {}, {}
        for r, log in ranks.items():
            for e in log:
                if e[2] == "send":
                    sends.setdefault((r, e[3]), []).append(e[4:7])
                elif e[2] == "recv_":
                    recvs.setdefault((e[3], r), []).append(e[4:7])
        for pair in sorted(set(sends) | set(recvs)):
            if pair[0] in ranks and pair[1] in ranks and sends.get(pair, []) != recvs.get(pair, []):
                problems.append(f"group {group}: {len(sends.get(pair, []))} sends from rank {pair[0]} to "
                                f"{pair[1]} meet {len(recvs.get(pair, []))} receives (or differ in shape/tag)")
    return problems


c10d = torch.ops.c10d
CONTRACTS = {
    c10d._allgather_base_.default: _allgather,
    c10d._reduce_scatter_base_.default: _reduce_scatter,
    c10d.alltoall_base_.default: _alltoall,
    c10d.broadcast_.default: _rooted,
    c10d.reduce_.default: lambda tensors, group, reduce_op, root, *rest: _rooted(tensors, group, root),
    c10d.allreduce_.default: lambda tensors, group, *rest: _collective_tensors("c10d.allreduce_", tensors),
    c10d.send.default: _p2p,
    c10d.recv_.default: _p2p,

    aten._scaled_dot_product_flash_attention.default: _flash_forward,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
}

# The ops tests/test_tsp_step.py's SyncSpy flags: each one a host-device sync on CUDA.
from test_tsp_step import INDEXING_OPS, SYNC_OPS  # noqa: E402

_LIBRARY_ROOT = os.path.dirname(os.path.realpath(torchtsp.__file__)) + os.sep


def _library_line() -> str:
    """The innermost torchtsp frame of the current stack, "file:line (function)" ('' if none).

    Library code is what lies under the imported package's own folder (``torchtsp.__file__``), never a path that
    merely contains "torchtsp": a clone named torchtsp holds the tests too, and a venv under it holds torch."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.realpath(frame.filename)
        if path.startswith(_LIBRARY_ROOT):
            return f"{path[len(_LIBRARY_ROOT):]}:{frame.lineno} ({frame.name})"
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
        # Every c10d op in issue order: (group name, this rank in it, op, peer or root, shapes, dtype, tag).
        self.comm_log: list[tuple] = []
        self.syncs: list[tuple[str, str]] = []
        self.host_reads: list[str] = []

    def reset(self) -> None:
        self.comm_log.clear()
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
        if func.namespace == "c10d":
            self.comm_log.append(_log_entry(func, args))
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
