"""The single-device reference ``Transformer`` through the Megatron engine with one rank: a plain cache."""

from __future__ import annotations

from ..distributed.comm import AxisComm
from ..parallel.tp import layer_params
from .tp import MegatronEngine


def reference_layers(model) -> list[dict]:
    """Per layer, the full weights under the Megatron engine's names (the TP layer's attribute names)."""
    return [{attr: layer.get_parameter(ref) for attr, (ref, _) in layer_params(model.cfg, i).items()}
            for i, layer in enumerate(model.layers)]


class ReferenceEngine(MegatronEngine):
    scheme = "reference"

    def __init__(self, model):
        layers = [{k: t.detach() for k, t in layer.items()} for layer in reference_layers(model)]
        super().__init__(model.cfg, AxisComm(None, "reference"), layers, model.tok_embeddings.weight.detach(),
                         model.output_weight.detach(), model.norm.weight.detach())
