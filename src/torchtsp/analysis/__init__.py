from .comm_model import layer_weight_elements, tsp_layer_forward_recv_elements

__all__ = ["layer_weight_elements", "tsp_layer_forward_recv_elements"]
