"""A decoder layer's parameters by short name: their reference names and the dimension TP splits them along.

TP's layers hold them under these names, and every inference engine reads a layer's weights (sliced or whole)
under them.
"""

from __future__ import annotations

# Per-layer parameters: attribute -> (reference name under ``layers.i.``, dimension sharded over tp or None).
LAYER_PARAMS = {
    "attention_norm": ("attention_norm.weight", None),
    "wq": ("attention.wq.weight", 0),
    "wk": ("attention.wk.weight", 0),
    "wv": ("attention.wv.weight", 0),
    "wo": ("attention.wo.weight", 1),
    "ffn_norm": ("ffn_norm.weight", None),
    "w_gate": ("feed_forward.w_gate.weight", 0),
    "w_up": ("feed_forward.w_up.weight", 0),
    "w_down": ("feed_forward.w_down.weight", 1),
}
# Model features' parameters: q/k/v biases shard with their heads' rows; q/k norms act per head, replicated.
BIAS_PARAMS = {"bq": ("attention.wq.bias", 0), "bk": ("attention.wk.bias", 0), "bv": ("attention.wv.bias", 0)}
HEAD_NORM_PARAMS = {"q_norm": ("attention.q_norm.weight", None), "k_norm": ("attention.k_norm.weight", None)}
# GPT-OSS's output-projection bias (replicated: added once, after the row-parallel sum) and sinks (one per query
# head: sharded with the heads).
O_BIAS_PARAMS = {"bo": ("attention.wo.bias", None)}
SINK_PARAMS = {"sinks": ("attention.sinks", 0)}
# Sandwich norms (Gemma): each sublayer's output normed, replicated like the other norms.
SANDWICH_PARAMS = {"attention_out_norm": ("attention_out_norm.weight", None),
                   "ffn_out_norm": ("ffn_out_norm.weight", None)}


# A sparse layer's feed-forward (parallel/moe.py, ``tp_moe``): every expert and the shared expert cut along their
# FFN width; the router and the shared gate replicated.
MOE_PARAMS = {
    "router": ("feed_forward.router.weight", None),
    "w_gate": ("feed_forward.experts.w_gate", 1),
    "w_up": ("feed_forward.experts.w_up", 1),
    "w_down": ("feed_forward.experts.w_down", 2),
}
# GPT-OSS's router and expert biases: the gate/up biases cut with the experts' FFN width; the down bias whole.
MOE_BIAS_PARAMS = {
    "router_bias": ("feed_forward.router.bias", None),
    "gate_bias": ("feed_forward.experts.gate_bias", 1),
    "up_bias": ("feed_forward.experts.up_bias", 1),
    "down_bias": ("feed_forward.experts.down_bias", None),
}
SHARED_EXPERT_PARAMS = {
    "shared_w_gate": ("feed_forward.shared.w_gate.weight", 0),
    "shared_w_up": ("feed_forward.shared.w_up.weight", 0),
    "shared_w_down": ("feed_forward.shared.w_down.weight", 1),
    "shared_gate": ("feed_forward.shared_gate.weight", None),
}


def layer_params(cfg, index: int | None = None) -> dict[str, tuple[str, int | None]]:
    """The per-layer parameters of ``cfg``'s model: attribute -> (reference name under ``layers.i.``, tp dim);
    of layer ``index`` if given (a mixture of experts' sparse layers have other feed-forward weights)."""
    params = {**LAYER_PARAMS, **(BIAS_PARAMS if cfg.qkv_bias else {}), **(HEAD_NORM_PARAMS if cfg.qk_norm else {}),
              **(SANDWICH_PARAMS if cfg.sandwich_norm else {}), **(O_BIAS_PARAMS if cfg.o_bias else {}),
              **(SINK_PARAMS if cfg.attention_sinks else {})}
    if index is not None and cfg.is_moe_layer(index):
        params = {k: v for k, v in params.items() if not v[0].startswith("feed_forward.")}
        params.update(MOE_PARAMS, **(SHARED_EXPERT_PARAMS if cfg.shared_expert_ffn_dim else {}))
        if cfg.router_bias:
            params["router_bias"] = MOE_BIAS_PARAMS["router_bias"]
        if cfg.expert_bias:
            params.update({k: v for k, v in MOE_BIAS_PARAMS.items() if k != "router_bias"})
    return params
