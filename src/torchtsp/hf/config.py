"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the families torchtsp reproduces (Llama with Llama 3's
``llama3`` RoPE scaling, Mistral without a window that masks anything, Qwen2/2.5, Qwen3, Qwen2-MoE, Mixtral);
every other feature is refused with its config field named."""

from __future__ import annotations

from ..config import ModelConfig

# Hugging Face model_type -> the CausalLM class config_to_hf names, so AutoModelForCausalLM picks it.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
_LLAMA3_KEYS = {  # HF rope dict key -> ModelConfig field
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
}


def _rope_fields(hf: dict, max_position_embeddings: int) -> dict:
    """ModelConfig's RoPE fields from an HF config: plain RoPE or rope_type 'llama3', anything else refused.

    transformers < 5 writes ``rope_theta`` at top level and ``rope_scaling`` (null for plain RoPE);
    transformers >= 5 writes ``rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}``.
    Like transformers, a non-empty ``rope_scaling`` takes precedence over ``rope_parameters``.
    """
    field, params = None, None
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name):
            field, params = name, hf[name]
            break
    theta = hf.get("rope_theta")
    fields: dict = {}
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"unsupported {field}={params!r}: expected a dict or null")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "llama3":
            # As transformers 5: a top-level original_max_position_embeddings wins, then the rope dict's,
            # then max_position_embeddings.
            params = {"original_max_position_embeddings": max_position_embeddings, **params}
            if hf.get("original_max_position_embeddings") is not None:
                params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
            if missing:
                raise ValueError(f"unsupported {field}={params!r}: rope_type 'llama3' needs {', '.join(missing)}")
            fields = {"rope_scaling": "llama3", **{ours: params[k] for k, ours in _LLAMA3_KEYS.items()}}
            fields["rope_original_max_position_embeddings"] = int(fields["rope_original_max_position_embeddings"])
            for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
                fields[name] = float(fields[name])
        elif rope_type not in (None, "default"):
            raise ValueError(
                f"unsupported {field} rope_type={rope_type!r} ({field}={params!r}): torchtsp implements plain "
                "RoPE (rope_type 'default') and Llama 3's 'llama3' scaling; linear, dynamic, yarn and longrope "
                "are not supported"
            )
        theta = params.get("rope_theta", theta)
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    else:
        partial = hf.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ValueError(f"unsupported partial_rotary_factor={partial!r}: torchtsp rotates the full head_dim")
    return {"rope_theta": 10000.0 if theta is None else float(theta), **fields}


def _check_sliding_window(hf: dict, model_type: str, max_position_embeddings: int) -> None:
    """Refuse a sliding window that can bite: torchtsp always attends to the whole causal context.

    A window of at least max_position_embeddings never masks anything, so it is accepted (Qwen2.5 ships
    ``sliding_window == max_position_embeddings`` with ``use_sliding_window: false``).
    """
    window = hf.get("sliding_window")
    if window is None or int(window) >= max_position_embeddings:
        return
    if model_type in ("mistral", "mixtral"):
        raise ValueError(
            f"unsupported sliding_window={window}: torchtsp attends to the full causal context; only null or "
            f">= max_position_embeddings={max_position_embeddings} is accepted"
        )
    if model_type in ("qwen2", "qwen3", "qwen2_moe") and hf.get("use_sliding_window"):
        # transformers: the layers marked "sliding_attention", by default those from max_window_layers on.
        n_layers, first = int(hf["num_hidden_layers"]), hf.get("max_window_layers", 28)
        layer_types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full" for i in range(n_layers)]
        if "sliding_attention" in layer_types:
            raise ValueError(
                f"unsupported sliding_window={window} with use_sliding_window=true: torchtsp attends to the full "
                f"causal context; set use_sliding_window to false, or sliding_window to null or "
                f">= max_position_embeddings={max_position_embeddings}"
            )


def _moe_fields(hf: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields of a Qwen2-MoE or Mixtral config ({} for dense families)."""
    if model_type == "mixtral":
        jitter = hf.get("router_jitter_noise") or 0.0
        if jitter:
            raise ValueError(f"unsupported router_jitter_noise={jitter!r}: torchtsp routes without jitter; set it to 0")
        width = int(hf["intermediate_size"])
        return dict(n_experts=int(hf.get("num_local_experts", 8)), moe_top_k=int(hf.get("num_experts_per_tok", 2)),
                    moe_ffn_dim=width, moe_norm_topk=True,
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    if model_type != "qwen2_moe":
        return {}
    shared = int(hf.get("shared_expert_intermediate_size", 5632))
    if shared <= 0:
        raise ValueError(f"unsupported shared_expert_intermediate_size={shared}: Qwen2-MoE always has a shared expert")
    n_experts = int(hf.get("num_experts", 60))
    if n_experts <= 0:
        raise ValueError(f"unsupported num_experts={n_experts}: a Qwen2-MoE model with no experts is dense; convert "
                         "it as qwen2")
    return dict(n_experts=n_experts, moe_top_k=int(hf.get("num_experts_per_tok", 4)),
                moe_ffn_dim=int(hf.get("moe_intermediate_size", 1408)), shared_expert_ffn_dim=shared,
                moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
                moe_layer_step=int(hf.get("decoder_sparse_step", 1)),
                dense_layers=tuple(int(i) for i in (hf.get("mlp_only_layers") or ())),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def config_from_hf(hf_config: dict) -> ModelConfig:
    """ModelConfig for an HF Llama, Mistral, Qwen2 or Qwen3 config dict (``config.json`` or ``to_dict()``).

    Raises ValueError, naming the field and its value, for anything torchtsp's model cannot reproduce.
    """
    if not isinstance(hf_config, dict):
        raise TypeError(f"HF config must be a dict, got {type(hf_config).__name__}")
    hf = hf_config
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type={model_type!r}: torchtsp converts {', '.join(map(repr, _ARCHITECTURES))} "
            "checkpoints"
        )
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise ValueError(f"HF config is missing required field(s): {', '.join(missing)}")
    # Flags that transformers reads for this model_type (Mistral and Qwen2 hard-code their biases).
    if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
        raise ValueError(
            f"unsupported attention_bias={hf['attention_bias']!r}: in {model_type} it also biases o_proj; "
            "torchtsp has biases on q/k/v only (Qwen2's)"
        )
    if model_type == "llama" and hf.get("mlp_bias"):
        raise ValueError(f"unsupported mlp_bias={hf['mlp_bias']!r}: torchtsp's MLP has no bias")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act={act!r}: torchtsp's MLP is SwiGLU (hidden_act 'silu')")

    dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv_heads = hf.get("num_key_value_heads")
    n_kv_heads = n_heads if n_kv_heads is None else int(n_kv_heads)
    if n_heads <= 0 or dim % n_heads:
        raise ValueError(f"unsupported hidden_size={dim} with num_attention_heads={n_heads}: must divide evenly")
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // n_heads:
        raise ValueError(
            f"unsupported head_dim={head_dim}: torchtsp requires head_dim == hidden_size / num_attention_heads "
            f"= {dim // n_heads}"
        )
    max_seq_len = int(hf.get("max_position_embeddings") or 2048)
    rope = _rope_fields(hf, max_seq_len)
    _check_sliding_window(hf, model_type, max_seq_len)
    moe = _moe_fields(hf, model_type)
    try:
        return ModelConfig(
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_dim=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            max_seq_len=max_seq_len,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
            qk_norm=model_type == "qwen3",
            family=model_type,
            **rope,
            **moe,
        )
    except ValueError as e:
        raise ValueError(f"unsupported HF config: {e}") from e


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x both load as the config's family
    (``cfg.hf_model_type``: llama, mistral, qwen2 or qwen3)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise ValueError("qkv_bias and qk_norm together have no Hugging Face family (Qwen3's bias also covers o_proj)")
    model_type = cfg.hf_model_type
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling_keys = ("rope_type", *_LLAMA3_KEYS)
    if cfg.rope_scaling == "llama3":
        rope_parameters = {"rope_type": "llama3", "rope_theta": cfg.rope_theta}
        rope_parameters.update((k, getattr(cfg, ours)) for k, ours in _LLAMA3_KEYS.items())
    hf = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        # transformers < 5 reads rope_theta/rope_scaling; >= 5 reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else {k: rope_parameters[k] for k in rope_scaling_keys},
        "rope_parameters": rope_parameters,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,  # transformers < 5
        "dtype": dtype,  # transformers >= 5
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif model_type in ("mistral", "mixtral"):
        hf.update(sliding_window=None)
        if model_type == "mixtral":
            hf.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k, router_jitter_noise=0.0,
                      router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    elif model_type == "qwen2_moe":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                  qkv_bias=cfg.qkv_bias, num_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                  moe_intermediate_size=cfg.moe_ffn_dim, shared_expert_intermediate_size=cfg.shared_expert_ffn_dim,
                  norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=cfg.moe_layer_step,
                  mlp_only_layers=list(cfg.dense_layers), router_aux_loss_coef=cfg.router_aux_loss_coef,
                  output_router_logits=False)
    else:  # qwen2, qwen3: full attention in every layer
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
        if model_type == "qwen3":
            hf.update(attention_bias=False)
    return hf
