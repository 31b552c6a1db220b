"""Analytic memory and communication models of every parallel scheme, and the planner behind ``torchtsp plan``.

Pure Python (no torch import), so planning is instant and offline. See docs/analysis.md for the formulas.
"""

# Defined below analysis/ (the inference engine reads the crossover too), part of this package's API all the same.
from ..sizes import layer_weight_elements, tsp_tp_crossover_tokens
from .comm_model import (
    CommBreakdown,
    layer_forward_recv_elements,
    predict_comm,
    sp_layer_forward_recv_elements,
    tp_layer_forward_recv_elements,
    tp_sp_layer_forward_recv_elements,
    tsp_layer_forward_recv_elements,
)
from .memory_model import MemoryBreakdown, param_elements, predict_memory

__all__ = [
    "CommBreakdown",
    "MemoryBreakdown",
    "layer_forward_recv_elements",
    "layer_weight_elements",
    "param_elements",
    "predict_comm",
    "predict_memory",
    "sp_layer_forward_recv_elements",
    "tp_layer_forward_recv_elements",
    "tp_sp_layer_forward_recv_elements",
    "tsp_layer_forward_recv_elements",
    "tsp_tp_crossover_tokens",
]

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
