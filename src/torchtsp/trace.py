"""Trace one rank's real training step at any size: shapes without storage, collectives without peers.

``trace_step`` runs, in this one process, what rank ``rank`` of a job of ``layout.world`` ranks runs for a training
step (``parallelize``, forward, backward, the gradient sum over replicas, the trainer's clipping and AdamW step),
under ``FakeTensorMode`` (tensors have shapes and dtypes, no memory, no arithmetic) with torch's fake process group
(every collective returns tensors of the right shape, ``comm.init_fake_process_group``). It measures what a real
run measures: the live-tensor peak of the second step, the optimizer state present (``memory.measure_peak_by_kind``,
as ``torchtsp bench`` and ``train`` measure it), and the bytes this rank receives, counted by our comm layer
(``comm.Traffic``). A paper-scale step then costs the host's time to walk the code, not the GPUs' memory.

``trace_generate`` does the same for inference: a rank's ``generate`` (a prefill that fills the KV cache, then
decode steps), measured over the call as ``torchtsp bench --mode infer`` measures it.

What it is not: values (a traced loss has none; a mixture of experts' routing is assumed balanced, ``ROUTING``),
time on a device, or memory outside live tensors (CUDA context,
NCCL buffers, fragmentation: ``docs/analysis.md`` says what the analytic model leaves out, the same here).

The bytes follow the backend the fake group plays (``stands_for``): "nccl" runs every transfer as the collective
``torchtsp plan`` counts; "gloo" runs what a CPU rank runs, K/V exchanges point to point and pruned to what
causality reads (``AxisComm.point_to_point``), so its bytes depend on the rank, as a real gloo run's do. AdamW
follows it too: "nccl" takes torch's multi-tensor step, the CUDA default (sqrt(v) of every parameter at once),
"gloo" the per-tensor loop a CPU rank takes.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import torch

from .config import ModelConfig
from .distributed import comm
from .distributed.comm import Traffic
from .distributed.mesh import init_mesh
from .host import tracing
from .layout import Layout
from .memory import measure_peak_by_kind
from .model import Transformer
from .parallel.pipeline import parallelize_layout
from .train.accumulate import forward_backward
from .train.optim import ReplicatedAdamW
from .train.zero import ZeroOptimizer

LR, WEIGHT_DECAY, GRAD_CLIP = 1e-4, 0.1, 1.0  # the trainer's defaults' kind; a trace has no values to train
DTYPES = ("float32", "bfloat16")
# A fake tensor has no values, so a mixture of experts' routing, which is data, cannot be read: the split sizes the
# host needs are those of every expert taking its equal share of the (token, slot) pairs (``host.counts_on_host``).
ROUTING = "balanced (assumed)"  # bfloat16: float32 masters of bfloat16 weights, as torchtsp train keeps them


class TraceError(RuntimeError):
    """The real code failed while traced: which layout and rank, in which phase, and the first line of why."""

    def __init__(self, label: str, rank: int, phase: str, error: BaseException):
        self.label, self.rank, self.phase = label, rank, phase
        first = (str(error).strip().splitlines() or [""])[0]
        self.first_line = f"{type(error).__name__}: {first}" if first else type(error).__name__
        super().__init__(f"{label} rank {rank}, {phase}: {self.first_line}")


@dataclass(frozen=True)
class Traced:
    """One rank's traced training step (bytes per rank; ``categories`` at the peak, summing to ``peak_bytes``)."""

    rank: int
    peak_bytes: int
    categories: dict[str, int]
    comm_bytes: int
    comm_bytes_by_op: dict[str, dict[str, int]]
    comm_path: str  # "collectives" (NCCL's, what plan counts) or "point_to_point" (gloo's: K/V pruned by causality)
    seq_rank: int | None  # this rank's place on the sequence axis where its bytes depend on it (else None)
    largest_allocation_bytes: int
    wall_s: float
    routing: str | None = None  # a mixture of experts': what the trace assumed of its data-dependent routing
    kv_cache_bytes: int | None = None  # inference (``trace_generate``): this rank's KV cache, part of the peak

    def to_dict(self) -> dict:
        routing = {"routing": self.routing} if self.routing else {}
        kv = {"kv_cache_bytes": self.kv_cache_bytes} if self.kv_cache_bytes is not None else {}
        return {**routing, **kv, "rank": self.rank, "peak_bytes": self.peak_bytes, "categories": dict(self.categories),
                "comm_bytes": self.comm_bytes, "comm_bytes_by_op": self.comm_bytes_by_op, "comm_path": self.comm_path,
                "seq_rank": self.seq_rank, "largest_allocation_bytes": self.largest_allocation_bytes,
                "wall_s": round(self.wall_s, 2)}


class _LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest storage any operation returns (fake or real): the biggest single allocation of the step."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)``, as ``torchtsp generate --dtype`` casts the parallel model, done in place: ``Module.to``
    swaps fake parameters for new ones, which fails where a scheme's modules hold them elsewhere too."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                module._buffers[name] = b.to(dtype)


def zigzag_ranks(layout: Layout) -> tuple[int, ...]:
    """The ranks whose step differs where a layout's sequence is split in zigzag chunks: the first and the last of
    the sequence axis (rank 0 pairs chunks 0 and 2D-1, rank D-1 chunks D-1 and D; on point-to-point backends their
    K/V traffic differs most). Rank 0 alone where nothing is split along the sequence."""
    sizes = layout.sizes
    seq = sizes.get("tsp", 1) * sizes.get("sp", 1)
    if seq == 1:
        return (0,)
    # Global rank of the last rank of the sequence axis with every other axis at 0: the mesh is [dp, sp, tp, tsp].
    last = (sizes["sp"] - 1) * sizes["tp"] * sizes["tsp"] + (sizes["tsp"] - 1)
    return (0, last)


def _check_request(layout: Layout, rank: int, dtype: str) -> None:
    """What every trace refuses before it starts (a ValueError, one line)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if layout.pp > 1:
        raise ValueError("tracing pipeline stages (pp > 1) is not supported yet")
    if not 0 <= rank < layout.world:
        raise ValueError(f"rank {rank} is outside the world of {layout.world} ranks")


def _traced(cfg: ModelConfig, model, rank: int, peak: int, parts: dict[str, int], traffic: Traffic,
            largest: _LargestAllocation, start: float, **extra) -> Traced:
    """The record of one traced rank, from what its measured call left: the peak by part, the bytes received (and
    over which path), the largest allocation."""
    point_to_point = any(c.point_to_point for c in model.comms().values())
    return Traced(rank=rank, peak_bytes=peak, categories=parts, comm_bytes=traffic.recv,
                  comm_bytes_by_op=traffic.by_op, comm_path="point_to_point" if point_to_point else "collectives",
                  seq_rank=model.traffic_args().get("seq_rank"), largest_allocation_bytes=largest.largest,
                  wall_s=time.perf_counter() - start, routing=ROUTING if cfg.moe else None, **extra)


def trace_step(cfg: ModelConfig, layout: Layout, batch: int, seq_len: int, *, rank: int = 0, dtype: str = "float32",
               stands_for: str = "nccl", grad_clip: float = GRAD_CLIP, seed: int = 0,
               foreach: bool | None = None, zero: int = 0) -> Traced:
    """Rank ``rank``'s training step of ``layout`` (global batch [batch, seq_len], ``dtype`` weights; the layout's
    recompute option as given to it), traced; see the module docstring. ``foreach``: AdamW's multi-tensor step or
    not (``build_adamw``); None: as on ``stands_for``'s device (multi-tensor for "nccl"). ``zero``: 1 or 2, the
    distributed optimizer over dp (``train/zero.py``'s ``ZeroOptimizer``, as ``torchtsp train --zero``; nothing
    where dp is 1); 3 (FSDP2) is not traced. Raises ``TraceError``
    when the real code fails, ValueError when the layout refuses the batch. Needs a process without a process group."""
    _check_request(layout, rank, dtype)
    if zero not in (0, 1, 2):
        raise ValueError(f"tracing --zero {zero} is not supported (0, 1 or 2)")
    layout.check_batch(batch, seq_len)
    start = time.perf_counter()
    comm.init_fake_process_group(rank, layout.world, stands_for)  # refuses a process with a group: before the try,
    try:  # whose cleanup destroys the group it made
        phase = "mesh"
        mesh = init_mesh(layout, device_type="cpu")  # the table of ranks is host data, real
        # The host batch is real, as the trainer's is before it moves to the device: its checks read it.
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
        torch.manual_seed(seed)
        whole = Transformer(cfg, device="meta")  # shapes only, as every rank builds it before taking its shards
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True), tracing():
            phase = "parallelize"
            model = parallelize_layout(whole, mesh, layout)
            # AdamW's step as on the backend's device: a CUDA rank's multi-tensor step (sqrt(v) of every parameter
            # at once), a CPU rank's per-tensor loop (torch's default for each; the fake tensors sit on the CPU).
            foreach = stands_for == "nccl" if foreach is None else foreach
            adamw = dict(master_weights=dtype == "bfloat16", foreach=foreach)
            if zero and layout.sizes["dp"] > 1:
                optimizer = ZeroOptimizer(model, zero, LR, WEIGHT_DECAY, **adamw)
            else:
                optimizer = ReplicatedAdamW(model, LR, WEIGHT_DECAY, **adamw)
            model.sum_gradients_with(optimizer.grad_sum)

            def step() -> None:  # the trainer's train_step, its host reads of the loss and the norm left out
                optimizer.wait_for_weights()
                forward_backward(model, tokens, labels, 1)
                optimizer.reduce()
                optimizer.clip_on_device(grad_clip)
                optimizer.step(LR)

            phase = "first step"
            step()  # AdamW's moments exist after it: the measured step is a steady one
            gc.collect()
            phase = "measured step"
            largest = _LargestAllocation()
            with Traffic(model.comms()) as traffic, largest:
                _, peak, parts = measure_peak_by_kind(step, model, *optimizer.tracked)
            return _traced(cfg, model, rank, peak, parts, traffic, largest, start)
    except ValueError:
        raise
    except Exception as e:
        raise TraceError(layout.label, rank, phase, e) from e
    finally:
        comm.destroy_process_group()


def trace_generate(cfg: ModelConfig, layout: Layout, batch: int, prompt_len: int, *, new_tokens: int = 2,
                   rank: int = 0, dtype: str = "float32", stands_for: str = "nccl", kv_layout: str = "auto",
                   seed: int = 0) -> Traced:
    """Rank ``rank``'s ``generate`` of ``layout`` traced, as ``torchtsp bench --mode infer`` measures it: ``batch``
    prompts of ``prompt_len`` tokens, a prefill that fills the KV cache, then ``new_tokens`` - 1 decode steps (2: one)
    on ``kv_layout``, greedy; ``dtype`` weights (as ``torchtsp generate --dtype`` casts them). The live-tensor peak
    over the call with the model's weights present, and the bytes received. Raises as ``trace_step``."""
    from .infer import generate

    _check_request(layout, rank, dtype)
    cfg = replace(cfg, max_seq_len=max(cfg.max_seq_len, prompt_len + new_tokens))  # as bench --mode infer sizes it
    start = time.perf_counter()
    comm.init_fake_process_group(rank, layout.world, stands_for)
    try:
        phase = "mesh"
        mesh = init_mesh(layout, device_type="cpu")
        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(cfg.vocab_size, (batch, prompt_len), generator=g).tolist()  # host lists
        torch.manual_seed(seed)
        whole = Transformer(cfg, device="meta")
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True), tracing():
            phase = "parallelize"
            model = parallelize_layout(whole, mesh, layout).eval()
            _cast_floating(model, getattr(torch, dtype))
            phase = "generate"
            largest = _LargestAllocation()
            with Traffic(model.comms()) as traffic, largest:
                result, peak, parts = measure_peak_by_kind(
                    lambda: generate(model, prompts, new_tokens, kv_layout=kv_layout), model)
            return _traced(cfg, model, rank, peak, parts, traffic, largest, start,
                           kv_cache_bytes=result.kv_cache_bytes)
    except ValueError:
        raise
    except Exception as e:
        raise TraceError(layout.label, rank, phase, e) from e
    finally:
        comm.destroy_process_group()


def trace_layout(cfg: ModelConfig, layout: Layout, batch: int, seq_len: int, mode: str = "train", **options) -> dict:
    """``trace_step`` (``mode="infer"``: ``trace_generate``) of every rank whose step may differ (``zigzag_ranks``);
    the one with the larger peak is the layout's figure. Returns {"rank": the larger's rank, its
    ``Traced.to_dict()``, "ranks": every traced rank's peak and bytes}."""
    trace = trace_generate if mode == "infer" else trace_step
    traced = [trace(cfg, layout, batch, seq_len, rank=r, **options) for r in zigzag_ranks(layout)]
    worst = max(traced, key=lambda t: (t.peak_bytes, t.comm_bytes))
    return {**worst.to_dict(), "ranks": [{"rank": t.rank, "peak_bytes": t.peak_bytes, "comm_bytes": t.comm_bytes}
                                         for t in traced]}
