"""Per-block ``torch.compile`` (``--compile``): the decoder's pure math compiled, every collective eager.

Collectives stay outside the compiled regions (docs/design.md, "Compiled blocks"): they all go through
``distributed/comm``'s ``AxisComm`` (counted bytes, async handles, labels), and TSP's attention and MLP are
autograd Functions with hand-written backward and broadcast / ring schedules that Dynamo cannot trace. What is
compiled is the math between them, written once in the layer core and marked ``@compilable``: norms, the
q/k/v head reshape with q/k norm and RoPE, the gated MLP's elementwise part and its transpose, TSP's per-shard
projections. A block with no collective inside (the ``dp`` scheme's reference block) is compiled whole, as
torchtitan's ``apply_compile`` compiles each TransformerBlock.

The switch is per process (``enable``), like ``torch.backends`` flags: every rank of a run sets it before it
builds its model. Graphs are compiled with ``fullgraph=True`` (a graph break is an error, not a silent eager
fallback) and ``dynamic=False``: a step has the same shapes as the one before, so nothing recompiles after the
first step (tests/test_compile.py counts).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

_ENABLED = False


def enabled() -> bool:
    """Whether this process runs the compiled pieces."""
    return _ENABLED


def enable(on: bool = True, device_type: str = "cpu") -> None:
    """Run the ``@compilable`` pieces compiled (``on``) or eager in this process; refuses a device whose compiler
    backend cannot work (``check_backend``)."""
    global _ENABLED
    if on:
        check_backend(device_type)
        import torch._functorch.config

        # AOTAutograd's on-disk cache: a cache hit on graphs of DTensor inputs (torch_tp's pieces) killed the rank
        # with SIGSEGV under torch 2.13 (a first, cold run passed); Inductor's own graph cache stays on.
        torch._functorch.config.enable_autograd_cache = False
    _ENABLED = bool(on)


def check_backend(device_type: str = "cpu") -> None:
    """Refuse, with what to do, a machine where TorchInductor cannot compile for ``device_type``: on the CPU it
    needs a C++ compiler (``$CXX``, else g++ / clang++ / c++), on CUDA the Triton package."""
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise OSError("--compile on CUDA needs Triton for TorchInductor: pip install triton (it comes with the "
                          "CUDA wheels of torch), or run without --compile")
        return
    if device_type != "cpu":
        raise OSError(f"--compile supports the cpu and cuda devices, not {device_type!r}; run without --compile")
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    if not any(shutil.which(name) for name in names):
        raise OSError(f"--compile on the CPU needs a C++ compiler for TorchInductor ({' or '.join(names)} not "
                      f"found on PATH): install one (apt-get install g++), point $CXX at one, or run without "
                      f"--compile")


def compile_options() -> dict:
    """The ``torch.compile`` options of every compiled region: one graph each, shapes static."""
    return {"fullgraph": True, "dynamic": False}


def _eager_here() -> bool:
    """Whether a compiled piece must run eager here: inside a region being compiled (traced inline), or under a
    dispatch mode (the live-tensor peak's ``measure_peak``; torch.compile does not run under one)."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def compilable(fn):
    """``fn`` (pure tensor math, no collective) compiled with ``compile_options`` when ``enabled``, else as is.

    Inside a region already being compiled (a whole block) it is traced inline like any function; under a dispatch
    mode (a measured peak) it runs eager."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if not _ENABLED or _eager_here():
            return fn(*args, **kwargs)
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **compile_options())
        return compiled(*args, **kwargs)

    call.eager = fn
    return call


def compile_blocks(blocks) -> None:
    """Compile each module of ``blocks`` whole (its ``forward``, ``compilable``), as torchtitan compiles each
    TransformerBlock: for blocks with no collective inside. Nothing when not ``enabled``."""
    if _ENABLED:
        for block in blocks:
            block.forward = compilable(block.forward)
