"""torchtsp: folded Tensor and Sequence Parallelism (TSP) for PyTorch."""

from .config import ModelConfig
from .layout import Layout
from .lazy import submodule_getattr
from .presets import PRESETS, get_preset

__all__ = ["PRESETS", "Layout", "ModelConfig", "Transformer", "WorkerPool", "get_preset", "init_mesh", "parallelize",
           "pipeline_parallelize", "spawn"]
__version__ = "0.1.0"

# The torch-backed names, and every submodule (``torchtsp.hf``, ``torchtsp.train.zero``: lazy.py), load on first
# use, so that ``import torchtsp`` and the command line start fast (``torchtsp plan`` never imports torch).
_LAZY = {"Transformer": "model", "WorkerPool": "distributed", "init_mesh": "distributed",
         "parallelize": "parallel", "pipeline_parallelize": "parallel", "spawn": "distributed"}
_submodule = submodule_getattr(__name__)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    return _submodule(name)
