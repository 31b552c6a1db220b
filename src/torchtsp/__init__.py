"""torchtsp: folded Tensor and Sequence Parallelism (TSP) for PyTorch."""

from .config import PRESETS, ModelConfig, get_preset
from .model import Transformer

__all__ = ["ModelConfig", "PRESETS", "get_preset", "Transformer"]
__version__ = "0.1.0"
