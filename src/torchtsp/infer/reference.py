"""The single-device reference ``Transformer`` through the Megatron engine with one rank: a plain cache."""

from __future__ import annotations

from ..distributed.comm import AxisComm
from .tp import MegatronEngine


def reference_layers(model) -> list[dict]:
    """Per layer, the full weights under the Megatron engine's names."""
    return [{"attention_norm": layer.attention_norm.weight, "wq": layer.attention.wq.weight,
             "wk": layer.attention.wk.weight, "wv": layer.attention.wv.weight, "wo": layer.attention.wo.weight,
             "ffn_norm": layer.ffn_norm.weight, "w_gate": layer.feed_forward.w_gate.weight,
             "w_up": layer.feed_forward.w_up.weight, "w_down": layer.feed_forward.w_down.weight}
            for layer in model.layers]


class ReferenceEngine(MegatronEngine):
    scheme = "reference"

    def __init__(self, model):
        layers = [{k: t.detach() for k, t in layer.items()} for layer in reference_layers(model)]
        super().__init__(model.cfg, AxisComm(None, "reference"), layers, model.tok_embeddings.weight.detach(),
                         model.output_weight.detach(), model.norm.weight.detach())
