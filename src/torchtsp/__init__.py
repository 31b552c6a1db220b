"""torchtsp: folded Tensor and Sequence Parallelism (TSP) for PyTorch."""

from .config import PRESETS, ModelConfig, get_preset
from .layout import Layout

__all__ = ["PRESETS", "Layout", "ModelConfig", "Transformer", "WorkerPool", "get_preset", "init_mesh", "parallelize",
           "pipeline_parallelize", "spawn"]
__version__ = "0.1.0"

# The torch-backed names load on first use, so that the command line starts fast (`torchtsp plan`).
_LAZY = {"Transformer": "model", "WorkerPool": "distributed", "init_mesh": "distributed",
         "parallelize": "parallel", "pipeline_parallelize": "parallel", "spawn": "distributed"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'torchtsp' has no attribute {name!r}")
