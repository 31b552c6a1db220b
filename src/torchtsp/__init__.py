"""torchtsp: folded Tensor and Sequence Parallelism (TSP) for PyTorch."""

from .config import PRESETS, ModelConfig, get_preset
from .distributed import WorkerPool, init_mesh, spawn
from .model import Transformer
from .parallel import parallelize

__all__ = ["PRESETS", "ModelConfig", "Transformer", "WorkerPool", "get_preset", "init_mesh", "parallelize", "spawn"]
__version__ = "0.1.0"
