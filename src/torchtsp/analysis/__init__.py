from .comm_model import (
    layer_forward_recv_elements,
    layer_weight_elements,
    sp_layer_forward_recv_elements,
    tp_layer_forward_recv_elements,
    tp_sp_layer_forward_recv_elements,
    tsp_layer_forward_recv_elements,
)

__all__ = [
    "layer_forward_recv_elements",
    "layer_weight_elements",
    "sp_layer_forward_recv_elements",
    "tp_layer_forward_recv_elements",
    "tp_sp_layer_forward_recv_elements",
    "tsp_layer_forward_recv_elements",
]
