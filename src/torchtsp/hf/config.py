"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the families torchtsp reproduces (Llama, Mistral with or
without its sliding window, Qwen2/2.5 and Qwen3 with their per-layer windows, Phi-3, Qwen2-MoE, Mixtral, Gemma 3
text, GPT-OSS), with the RoPE scaling types of ``rope.ROPE_TYPES`` (llama3, linear, yarn, longrope, dynamic); every
other feature is refused with its config field named."""

from __future__ import annotations

from ..config import ModelConfig
from ..rope import check_params
from ..rope import rope_type as rope_type_named

# Hugging Face model_type -> the CausalLM class config_to_hf names, so AutoModelForCausalLM picks it.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# Keys of an HF rope dict that are not a scaling type's parameters.
_ROPE_META_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _rope_fields(hf: dict, max_position_embeddings: int) -> dict:
    """ModelConfig's RoPE fields from an HF config: plain RoPE or a type of ``rope.ROPE_TYPES``, anything else
    refused.

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
        if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
            rope_type = "longrope"  # as transformers' Phi3Config reads Phi-3's early names of LongRoPE
        if rope_type not in (None, "default"):
            try:
                fields = _rope_scaling_fields(rope_type, params, hf, max_position_embeddings)
            except ValueError as e:
                raise ValueError(f"unsupported {field} rope_type={rope_type!r} ({field}={params!r}): {e}") from None
        theta = params.get("rope_theta", theta)
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    else:
        partial = hf.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ValueError(f"unsupported partial_rotary_factor={partial!r}: torchtsp rotates the full head_dim")
    return {"rope_theta": 10000.0 if theta is None else float(theta), **fields}


def _rope_scaling_fields(rope_type: str, params: dict, hf: dict, max_position_embeddings: int) -> dict:
    """``rope_scaling`` and ``rope_params`` of a scaling type (``rope.ROPE_TYPES``; one line naming a type
    torchtsp does not implement). As transformers 5: a top-level original_max_position_embeddings wins over the
    rope dict's, which wins over max_position_embeddings, for the types that take one (Phi3Config has a top-level
    one of 4096 when the file has none); a type's ``max_position_embeddings`` (dynamic NTK's trained context) is
    the config's own."""
    kind = rope_type_named(rope_type)
    given = {k: v for k, v in params.items() if k not in _ROPE_META_KEYS}
    takes = (*kind.required, *kind.defaults)
    if "original_max_position_embeddings" in takes:
        given.setdefault("original_max_position_embeddings", max_position_embeddings)
        top = hf.get("original_max_position_embeddings", 4096 if hf.get("model_type") == "phi3" else None)
        if top is not None:
            given["original_max_position_embeddings"] = top
    if "max_position_embeddings" in takes:
        given["max_position_embeddings"] = max_position_embeddings
    return {"rope_scaling": rope_type, "rope_params": check_params(rope_type, tuple(given.items()),
                                                                   max_position_embeddings)}


def _rope_to_hf(cfg: ModelConfig) -> dict:
    """The scaling of the global layers as transformers 5's rope dict (with rope_type and rope_theta); a type's
    max_position_embeddings is the config's own field (``_max_positions``), not the dict's."""
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.rope_params if k != "max_position_embeddings"}
    return {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta, **params}


def _max_positions(cfg: ModelConfig) -> int:
    """The config's max_position_embeddings: the trained context a RoPE type reads from it (dynamic NTK's), else
    max_seq_len."""
    return dict(cfg.rope_params).get("max_position_embeddings", cfg.max_seq_len)


def _window_fields(hf: dict, model_type: str, max_position_embeddings: int) -> dict:
    """ModelConfig's ``layer_types`` and ``sliding_window`` as transformers derives them for this model_type.

    Mistral / Mixtral / Phi-3 slide in every layer when ``sliding_window`` is set; Qwen2 / Qwen3 / Qwen2-MoE only with
    ``use_sliding_window``, in the layers ``layer_types`` marks "sliding_attention" (by default those from
    ``max_window_layers`` on); Gemma 3 in ``layer_types`` (by default every layer but each
    ``sliding_window_pattern``-th). A window of at least max_position_embeddings masks nothing: no window.
    """
    window = hf.get("sliding_window")
    n_layers = int(hf["num_hidden_layers"])
    if model_type in ("mistral", "mixtral", "phi3"):
        types = ["sliding_attention"] * n_layers if window is not None else None
        if hf.get("layer_types"):
            raise ValueError(f"unsupported layer_types={hf['layer_types']!r} in a {model_type} config: transformers' "
                             f"{model_type} slides in every layer; convert it as the family that alternates")
    elif model_type in ("qwen2", "qwen3", "qwen2_moe"):
        if not hf.get("use_sliding_window"):
            return {}  # transformers sets sliding_window to None: every layer full
        first = int(hf.get("max_window_layers", 28))
        types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(n_layers)]
    elif model_type == "gpt_oss":  # transformers' default: even layers slide, odd ones are full
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(n_layers)]
        window = 128 if "sliding_window" not in hf else window
    elif model_type == "gemma3_text":
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n_layers)]
        window = 4096 if "sliding_window" not in hf else window
    else:
        return {}
    if types is None or "sliding_attention" not in types:
        return {}
    if window is None:
        raise ValueError("unsupported layer_types with sliding layers but sliding_window=null: transformers needs a "
                         "window for them; set sliding_window")
    if int(window) >= max_position_embeddings:
        return {}  # never masks anything (Qwen2.5 ships sliding_window == max_position_embeddings)
    return {"layer_types": tuple(types), "sliding_window": int(window)}


def _gemma3_fields(hf: dict) -> dict:
    """ModelConfig's Gemma 3 fields: (1 + w) and sandwich norms, GeGLU, scaled embeddings, q/k norm, the
    attention scale, and RoPE per layer type (global: rope_theta with optional linear scaling; local: plain RoPE
    of base rope_local_base_freq). Soft-capping and bidirectional attention are refused."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise ValueError(f"unsupported {name}={hf[name]!r}: torchtsp has no logit soft-capping (Gemma 3 ships "
                             "null); set it to null")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=true: torchtsp's attention is causal")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation={act!r}: torchtsp's Gemma MLP is GeGLU with "
                         "gelu_pytorch_tanh")
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if hf.get("rope_scaling"):  # transformers < 5: the scaling of global layers
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported sliding_attention rope_type={local['rope_type']!r}: torchtsp's local layers "
                         "use plain RoPE")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"unsupported full_attention rope_type={kind!r}: torchtsp's Gemma global layers use "
                         "'default' or 'linear' RoPE")
    scaling = {"rope_scaling": "linear", "rope_params": {"factor": full["factor"]}} if kind == "linear" else {}
    return dict(norm_offset=1.0, sandwich_norm=True, mlp_activation="gelu_tanh", embed_scale=True, qk_norm=True,
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                rope_theta=float(full["rope_theta"]), rope_local_theta=float(local["rope_theta"]), **scaling)


def _moe_fields(hf: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields of a Qwen2-MoE, Mixtral or GPT-OSS config ({} for dense families)."""
    if model_type == "gpt_oss":
        _check_quantization(hf)
        width = int(hf["intermediate_size"])
        return dict(n_experts=int(hf.get("num_local_experts", 128)), moe_top_k=int(hf.get("num_experts_per_tok", 4)),
                    moe_ffn_dim=width, moe_norm_topk=True, router_bias=True, expert_bias=True,
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
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


def _check_quantization(hf: dict) -> None:
    """GPT-OSS's published MXFP4 experts are dequantized on load (hf/names.py); any other quantization is refused."""
    quant = hf.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise ValueError(f"unsupported quantization_config quant_method={quant.get('quant_method')!r}: torchtsp "
                         "reads bf16/fp32 weights and GPT-OSS's mxfp4 experts (dequantized to bf16 on load)")


def _gpt_oss_fields(hf: dict, max_position_embeddings: int) -> dict:
    """GPT-OSS's attention: q/k/v/o biases (``attention_bias``, true in every checkpoint) and sinks; RoPE from its
    rope dict (YaRN in the published models)."""
    if not hf.get("attention_bias", True):
        raise ValueError("unsupported attention_bias=false in a gpt_oss config: torchtsp's GPT-OSS has q/k/v/o biases")
    return {**_rope_fields(hf, max_position_embeddings), "o_bias": True, "attention_sinks": True}


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
    if model_type in ("llama", "qwen3", "gemma3_text") and hf.get("attention_bias"):
        raise ValueError(
            f"unsupported attention_bias={hf['attention_bias']!r}: in {model_type} it also biases o_proj; "
            "torchtsp has biases on q/k/v only (Qwen2's)"
        )
    if model_type == "llama" and hf.get("mlp_bias"):
        raise ValueError(f"unsupported mlp_bias={hf['mlp_bias']!r}: torchtsp's MLP has no bias")
    for name in ("resid_pdrop", "embd_pdrop") if model_type == "phi3" else ():
        if hf.get(name):
            raise ValueError(f"unsupported {name}={hf[name]!r}: torchtsp trains without dropout (Phi-3 ships 0.0); "
                             "set it to 0")
    act = hf.get("hidden_act", "silu")
    if model_type != "gemma3_text" and act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act={act!r}: torchtsp's MLP is SwiGLU (hidden_act 'silu')")

    dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv_heads = hf.get("num_key_value_heads")
    n_kv_heads = n_heads if n_kv_heads is None else int(n_kv_heads)
    head_dim = hf.get("head_dim", 256 if model_type == "gemma3_text" else None)  # transformers' defaults
    if head_dim is None and (n_heads <= 0 or dim % n_heads):
        raise ValueError(f"unsupported hidden_size={dim} with num_attention_heads={n_heads} and no head_dim: "
                         "must divide evenly")
    default_context = {"gemma3_text": 131072, "phi3": 4096}.get(model_type, 2048)  # transformers' defaults
    max_seq_len = int(hf.get("max_position_embeddings") or default_context)
    if model_type == "gemma3_text":
        features = _gemma3_fields(hf)
    elif model_type == "gpt_oss":
        features = _gpt_oss_fields(hf, max_seq_len)
    else:
        features = {**_rope_fields(hf, max_seq_len), "qk_norm": model_type == "qwen3"}
    windows = _window_fields(hf, model_type, max_seq_len)
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
            tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gemma3_text")),
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
            or model_type == "gpt_oss",
            family=model_type,
            head_dim=None if head_dim is None else int(head_dim),
            **features,
            **windows,
            **moe,
        )
    except ValueError as e:
        raise ValueError(f"unsupported HF config: {e}") from e


def _check_expressible(cfg: ModelConfig, model_type: str) -> None:
    """Refuse a config whose family cannot say everything the model does (an export must not drop a feature)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise ValueError("qkv_bias and qk_norm together have no Hugging Face family (Qwen3's bias also covers o_proj)")
    if model_type != "gemma3_text" and (cfg.rope_local_theta is not None or cfg.query_pre_attn_scalar is not None):
        raise ValueError(f"rope_local_theta and query_pre_attn_scalar have no {model_type} field: only gemma3_text "
                         "exports them")
    if model_type == "gemma3_text" and cfg.rope_scaling not in (None, "linear"):
        raise ValueError(f"gemma3_text has no {cfg.rope_scaling} RoPE scaling: use rope_scaling 'linear' or None")
    if model_type == "phi3" and cfg.rope_scaling not in (None, "longrope"):
        raise ValueError(f"phi3 has no {cfg.rope_scaling} RoPE scaling (transformers' Phi3Config takes 'longrope' "
                         "only): use rope_scaling 'longrope' or None, or export as another family")
    if not cfg.sliding:
        return
    if model_type == "llama":
        raise ValueError("llama checkpoints have no sliding window; export a windowed model as mistral (every layer "
                         "sliding), qwen2 / qwen3 or gemma3_text (any layer_types): set family")
    if model_type in ("mistral", "mixtral", "phi3") and "full_attention" in cfg.layer_types:
        raise ValueError(f"{model_type} slides in every layer; a model with full layers too exports as qwen2 / qwen3 "
                         "(set family) or gemma3_text")


def _window_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    """The window fields of ``model_type`` that transformers reads back as ``cfg``'s layer types and window."""
    types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
    if model_type in ("mistral", "mixtral", "phi3"):
        return {"sliding_window": cfg.sliding_window}
    if model_type == "gemma3_text":
        return {"sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": types}
    if model_type in ("qwen2", "qwen3", "qwen2_moe") and cfg.sliding:
        # transformers < 5 reads max_window_layers (sliding from there on); >= 5 reads layer_types.
        full = types.index("sliding_attention")
        return {"use_sliding_window": True, "sliding_window": cfg.sliding_window, "layer_types": types,
                "max_window_layers": full}
    if model_type in ("qwen2", "qwen3", "qwen2_moe"):
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    if model_type == "gpt_oss":  # layer_types as they are (every layer full: no window)
        return {"sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": types}
    return {}


def _gemma3_to_hf(cfg: ModelConfig) -> dict:
    """Gemma 3's own fields, RoPE per layer type in both transformers 4's and 5's spellings."""
    full = _rope_to_hf(cfg)
    local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    scalar = int(scalar) if float(scalar).is_integer() else scalar  # transformers 5 checks it is an int
    return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "attention_bias": False, "use_bidirectional_attention": False,
            "rope_theta": cfg.rope_theta, "rope_local_base_freq": local,
            "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"} if cfg.rope_scaling else None,
            "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": local}}}


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x both load as the config's family
    (``cfg.hf_model_type``: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe or gemma3_text)."""
    model_type = cfg.hf_model_type
    _check_expressible(cfg, model_type)
    rope_parameters = _rope_to_hf(cfg)
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
        "max_position_embeddings": _max_positions(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        # transformers < 5 reads rope_theta/rope_scaling; >= 5 reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else {k: v for k, v in rope_parameters.items()
                                                               if k != "rope_theta"},
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
        hf.update(qkv_bias=cfg.qkv_bias, num_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                  moe_intermediate_size=cfg.moe_ffn_dim, shared_expert_intermediate_size=cfg.shared_expert_ffn_dim,
                  norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=cfg.moe_layer_step,
                  mlp_only_layers=list(cfg.dense_layers), router_aux_loss_coef=cfg.router_aux_loss_coef,
                  output_router_logits=False)
    elif model_type == "gpt_oss":
        hf.update(attention_bias=True, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                  swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                  router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    elif model_type == "gemma3_text":
        hf.update(_gemma3_to_hf(cfg))
    elif model_type == "qwen3":
        hf.update(attention_bias=False)
    elif model_type == "phi3":
        # Phi3Config's top-level original_max_position_embeddings (default 4096) overrides the rope dict's: the
        # same value. No pad_token_id: its default (32000) lies outside a smaller vocabulary.
        original = dict(cfg.rope_params).get("original_max_position_embeddings", cfg.max_seq_len)
        hf.update(original_max_position_embeddings=original, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=None,
                  sliding_window=None)
    hf.update(_window_to_hf(cfg, model_type))
    return hf
