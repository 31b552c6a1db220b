"""Hugging Face interop: configs, state-dict names, and safetensors IO (conversion lives in convert.py).

The families handled are Llama (with Llama 3's ``llama3`` RoPE scaling), Mistral (without a sliding
window that masks anything), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and the mixtures of
experts Qwen2-MoE and Mixtral; every other feature is refused with its config field named. Two on-disk
formats are handled:

* **Hugging Face** (``config.json`` + ``model.safetensors``, or ``model.safetensors.index.json`` + shards),
  loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.
* **torchtsp native** (``torchtsp.json`` + ``model.safetensors`` in torchtsp parameter names).

No weight permutation is needed between the two: ``torchtsp.model.apply_rope`` uses the same half-split
("rotate_half") RoPE convention as these HF models, so q/k projections map one to one, and the dense
families use the same HF parameter names. Expert weights are stacked [E, ...] tensors in torchtsp; HF
holds them fused in a live model (``gate_up_proj``) and one tensor per expert in checkpoint files
(``_hf_location``, ``_file_location``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .config import ModelConfig
from .model import reference_shapes
from .paths import contained, hub_blobs

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "from_hf_state_dict",
    "load_hf_checkpoint",
    "load_torchtsp_checkpoint",
    "save_hf_checkpoint",
    "save_torchtsp_checkpoint",
    "to_hf_state_dict",
]

HF_CONFIG_NAME = "config.json"
TORCHTSP_CONFIG_NAME = "torchtsp.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCHTSP_FORMAT_VERSION = 1
_SHOW = 5  # how many offending names an error message lists

# torchtsp name inside a block -> HF name inside ``model.layers.{i}``.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight",
    "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",  # qkv_bias (Qwen2)
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # qk_norm (Qwen3)
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # Mixture of experts (Qwen2-MoE, Mixtral): the router, the experts' stacked weights, the shared expert.
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.experts.w_down": "mlp.experts.down_proj",
    "feed_forward.shared.w_gate.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared.w_up.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared.w_down.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
# Halves of one fused HF tensor: torchtsp name inside a block -> (HF name, dim, which half). transformers stores
# each expert's gate and up projections as one [E, 2·F, h] tensor (gate rows first); torchtsp keeps them apart,
# so that tensor parallelism can cut both along F.
_FUSED_NAMES = {
    "feed_forward.experts.w_gate": ("mlp.experts.gate_up_proj", 1, 0),
    "feed_forward.experts.w_up": ("mlp.experts.gate_up_proj", 1, 1),
}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_EMBED, _HF_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Non-persistent RoPE buffers that old checkpoints sometimes carry; they are recomputed, never loaded.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


# --------------------------------------------------------------------------- configs

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


# --------------------------------------------------------------------------- state dicts


def _hf_location(name: str) -> str | tuple:
    """Where torchtsp parameter ``name`` lies in a transformers model's own state dict: an HF tensor name, or
    ("fused", HF name, dim, half) for one half of a fused HF tensor (the experts' gate_up_proj)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    prefix, _, rest = name.partition(".")
    idx, _, local = rest.partition(".")
    if prefix == "layers" and idx.isdigit() and local in _LAYER_NAMES:
        return f"model.layers.{idx}.{_LAYER_NAMES[local]}"
    if prefix == "layers" and idx.isdigit() and local in _FUSED_NAMES:
        hf_name, dim, half = _FUSED_NAMES[local]
        return "fused", f"model.layers.{idx}.{hf_name}", dim, half
    raise KeyError(name)


# The experts' matrices one by one, as checkpoint files hold them (what save_pretrained writes and the Hub
# serves; transformers fuses them on load): torchtsp name -> HF name of expert e's matrix, per family.
_EXPERT_FILE_NAMES = {
    "qwen2_moe": ("mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}),
}


def _file_location(cfg: ModelConfig):
    """``_hf_location`` for checkpoint files: stacked expert weights are ("experts", [HF name of each expert's
    matrix]), and Mixtral's MoE block is ``block_sparse_moe``."""
    block, names = _EXPERT_FILE_NAMES.get(cfg.hf_model_type, ("mlp", {}))

    def location(name: str):
        prefix, _, rest = name.partition(".")
        idx, _, local = rest.partition(".")
        if prefix == "layers" and local.startswith("feed_forward.experts."):
            kind = names[local.rpartition(".")[2]]
            return "experts", [f"model.layers.{idx}.{block}.experts.{e}.{kind}.weight" for e in range(cfg.n_experts)]
        where = _hf_location(name)
        return where.replace(".mlp.gate.", f".{block}.gate.") if isinstance(where, str) else where

    return location


def _is_fused(names) -> bool:
    return any(n.endswith(".experts.gate_up_proj") for n in names)


def _to_hf_name(name: str) -> str:
    """The HF tensor (in a transformers model's state dict) that holds torchtsp parameter ``name`` or half of it."""
    where = _hf_location(name)
    return where if isinstance(where, str) else where[1]


def _hf_shapes(expected: dict[str, tuple[int, ...]], location) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, from torchtsp names -> shapes (fused halves add up along their dim)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in expected.items():
        where = location(name)
        if isinstance(where, str):
            out[where] = tuple(shape)
        elif where[0] == "fused":
            out[where[1]] = tuple(n * 2 if d == where[2] else n for d, n in enumerate(shape))
        else:
            out.update(dict.fromkeys(where[1], tuple(shape[1:])))
    return out


def _from_hf_tensor(hf_sd: dict, where) -> torch.Tensor:
    if isinstance(where, str):
        return hf_sd[where]
    if where[0] == "fused":
        return hf_sd[where[1]].chunk(2, dim=where[2])[where[3]]
    return torch.stack([hf_sd[n] for n in where[1]])


def _to_hf_tensors(sd: dict, names, location) -> dict[str, torch.Tensor]:
    """HF-named tensors from torchtsp ``names`` of ``sd`` (fused halves concatenated, experts split)."""
    out, halves = {}, {}
    for name in names:
        where = location(name)
        if isinstance(where, str):
            out[where] = sd[name]
        elif where[0] == "fused":
            halves.setdefault(where[1], {})[where[3]] = (where[2], sd[name])
        else:
            out.update(zip(where[1], sd[name].unbind(0)))
    for hf_name, parts in halves.items():
        if set(parts) != {0, 1}:
            raise ValueError(f"{hf_name} needs both of its halves, got {sorted(parts)}")
        out[hf_name] = torch.cat([parts[0][1], parts[1][1]], dim=parts[0][0])
    return out


def _fmt_names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > _SHOW else shown


def _check_state_dict(sd: dict, expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Raise one ValueError describing missing/unexpected keys and shape mismatches."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    bad_shape = [k for k in expected if k in sd and tuple(sd[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing keys: {_fmt_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_fmt_names(unexpected)}")
    if bad_shape:
        details = [f"{k}: expected {expected[k]}, found {tuple(sd[k].shape)}" for k in bad_shape[:_SHOW]]
        more = f" ... ({len(bad_shape)} in all)" if len(bad_shape) > _SHOW else ""
        problems.append("shape mismatches: " + "; ".join(details) + more)
    if problems:
        raise ValueError(f"{what} does not match the model config: " + " | ".join(problems))


def from_hf_state_dict(hf_sd: dict, cfg: ModelConfig) -> dict:
    """HF ``*ForCausalLM`` state dict -> torchtsp ``Transformer`` state dict (same tensors, renamed).

    With tied embeddings ``lm_head.weight`` is optional; when present it must equal the embedding.
    ``rotary_emb.inv_freq`` buffers are ignored.
    """
    expected = reference_shapes(cfg)
    # Expert weights fused (a transformers model's state dict) or one tensor per expert (checkpoint files).
    location = _hf_location if _is_fused(hf_sd) else _file_location(cfg)
    hf_expected = _hf_shapes(expected, location)
    sd = {k: v for k, v in hf_sd.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    if cfg.tie_embeddings and _HF_LM_HEAD in sd:
        lm_head = sd.pop(_HF_LM_HEAD)
        embed = sd.get(_HF_EMBED)
        if embed is not None and tuple(lm_head.shape) == tuple(embed.shape) and not torch.equal(lm_head, embed):
            raise ValueError(
                f"tie_word_embeddings is true but {_HF_LM_HEAD} differs from {_HF_EMBED}; "
                "set tie_word_embeddings to false in config.json to keep a separate output head"
            )
        if embed is not None and tuple(lm_head.shape) != tuple(embed.shape):
            raise ValueError(
                f"tie_word_embeddings is true but {_HF_LM_HEAD} has shape {tuple(lm_head.shape)}, "
                f"expected {tuple(embed.shape)} like {_HF_EMBED}"
            )
    _check_state_dict(sd, hf_expected, "Hugging Face state dict")
    return {k: _from_hf_tensor(sd, location(k)) for k in expected}


def to_hf_state_dict(sd: dict, cfg: ModelConfig, files: bool = False) -> dict:
    """torchtsp ``Transformer`` state dict -> HF ``*ForCausalLM`` names (no ``lm_head`` when tied): those of a
    transformers model's state dict (experts fused), or with ``files`` those of checkpoint files (one tensor per
    expert, as ``save_pretrained`` writes)."""
    expected = reference_shapes(cfg)
    _check_state_dict(sd, expected, "torchtsp state dict")
    return _to_hf_tensors(sd, expected, _file_location(cfg) if files else _hf_location)


# --------------------------------------------------------------------------- file helpers


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {what}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or regenerate the file") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (not UTF-8 text: {e}); fix or regenerate the file") from e
    if not isinstance(data, dict):
        # Bad file contents, like invalid JSON: a ValueError naming the file, not a TypeError.
        raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")  # noqa: TRY004
    return data


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} not found")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {e}; re-download or re-save it"
        ) from e


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its files 0600; exports are ordinary files
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it
    os.umask(mask)
    return mask


def _prepare_for_saving(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, none sharing storage (safetensors refuses aliased tensors)."""
    out, seen = {}, set()
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, not a tensor")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device and has no data to save")
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = t
    return out


def _require_dir(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {path} is not a directory; pass the checkpoint's directory")


def _dtype_name(sd: dict[str, torch.Tensor]) -> str:
    for t in sd.values():
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


# --------------------------------------------------------------------------- HF checkpoints


def _index_weight_map(path: Path, index: Path) -> dict[str, Path]:
    """Tensor name -> shard file of a sharded checkpoint's index, every shard present and inside ``path``
    (a Hugging Face hub snapshot's shards may be symlinks into its ``blobs`` folder)."""
    weight_map = _read_json(index, "").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map' object; regenerate the index or the checkpoint")
    blobs = hub_blobs(path)
    files = {shard: contained(path, shard, index, also_inside=blobs) for shard in set(weight_map.values())}
    missing = sorted(shard for shard, file in files.items() if not file.is_file())
    if missing:
        raise FileNotFoundError(f"shard(s) named in {index} are missing from {path}: {_fmt_names(missing)}; "
                                "re-download the complete checkpoint")
    return {name: files[shard] for name, shard in weight_map.items()}


def _load_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    single, index = path / SAFE_WEIGHTS_NAME, path / SAFE_WEIGHTS_INDEX_NAME
    # Same preference order as transformers: model.safetensors, then the sharded index.
    if single.is_file():
        return _load_safetensors(single)
    if index.is_file():
        weight_map = _index_weight_map(path, index)
        shards = sorted(set(weight_map.values()))
        sd: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors = _load_safetensors(shard)
            wanted = [k for k, s in weight_map.items() if s == shard]
            absent = [k for k in wanted if k not in tensors]
            if absent:
                raise ValueError(f"{shard} lacks tensor(s) that {index} places there: {_fmt_names(absent)}")
            sd.update((k, tensors[k]) for k in wanted)
        return sd
    candidates = sorted(path.glob("*.safetensors"))
    if len(candidates) == 1:
        return _load_safetensors(candidates[0])
    if candidates:
        raise ValueError(
            f"{path} holds several .safetensors files ({_fmt_names([c.name for c in candidates])}) but no "
            f"{SAFE_WEIGHTS_INDEX_NAME}; add the index that maps tensors to shards"
        )
    hint = ""
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        hint = " (found PyTorch pickle weights; re-save them with save_pretrained(safe_serialization=True))"
    raise FileNotFoundError(
        f"no safetensors weights in {path}: expected {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} "
        f"with its shards{hint}"
    )


def _hf_dir_config(path: Path) -> tuple[ModelConfig, Path]:
    """The ModelConfig of an HF checkpoint directory, and its config.json (errors name the file)."""
    _require_dir(path)
    cfg_path = path / HF_CONFIG_NAME
    hf_config = _read_json(
        cfg_path, "a Hugging Face checkpoint directory needs config.json (as written by save_pretrained)"
    )
    try:
        return config_from_hf(hf_config), cfg_path
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from e


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF checkpoint directory of a supported family; returns ``(cfg, state dict in torchtsp names)``."""
    path = Path(path)
    cfg, cfg_path = _hf_dir_config(path)
    hf_sd = _load_hf_weights(path)
    try:
        return cfg, from_hf_state_dict(hf_sd, cfg)
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match {cfg_path}: {e}") from e


def save_hf_checkpoint(
    path: str | os.PathLike, sd: dict[str, torch.Tensor], cfg: ModelConfig, max_shard_bytes: int | None = None
) -> None:
    """Write ``sd`` (torchtsp names) as an HF checkpoint ``AutoModelForCausalLM.from_pretrained`` loads.

    One ``model.safetensors``, or, when the tensors exceed ``max_shard_bytes``, shards
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Weight files of an
    earlier save in the same directory are removed so no stale file shadows the new ones.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    tensors = _prepare_for_saving(to_hf_state_dict(sd, cfg, files=True))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_weight_files(path)

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    metadata = {"format": "pt"}
    if max_shard_bytes is None or total <= max_shard_bytes:
        _save_safetensors(path / SAFE_WEIGHTS_NAME, tensors, metadata)
    else:
        shards: list[list[str]] = [[]]
        used = 0
        for k in tensors:
            if shards[-1] and used + sizes[k] > max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(k)
            used += sizes[k]
        n = len(shards)
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            _save_safetensors(path / fname, {k: tensors[k] for k in names}, metadata)
            weight_map.update((k, fname) for k in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(path / SAFE_WEIGHTS_INDEX_NAME, index)
    _write_json(path / HF_CONFIG_NAME, config_to_hf(cfg, dtype=_dtype_name(tensors)))


def _remove_weight_files(path: Path) -> None:
    stale = [path / SAFE_WEIGHTS_NAME, path / SAFE_WEIGHTS_INDEX_NAME, *path.glob("model-*-of-*.safetensors")]
    for f in stale:
        if f.is_file():
            f.unlink()


# --------------------------------------------------------------------------- torchtsp checkpoints


def save_torchtsp_checkpoint(path: str | os.PathLike, sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Write ``torchtsp.json`` + ``model.safetensors`` (torchtsp names; a tied embedding is stored once)."""
    _check_state_dict(sd, reference_shapes(cfg), "torchtsp state dict")
    tensors = _prepare_for_saving(sd)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_weight_files(path)
    _save_safetensors(path / SAFE_WEIGHTS_NAME, tensors, {"format": "pt", "torchtsp": str(TORCHTSP_FORMAT_VERSION)})
    meta = {"format": "torchtsp", "version": TORCHTSP_FORMAT_VERSION, "model": cfg.to_dict()}
    _write_json(path / TORCHTSP_CONFIG_NAME, meta)


def load_torchtsp_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a native torchtsp checkpoint directory; returns ``(cfg, state dict)``."""
    path = Path(path)
    _require_dir(path)
    meta_path = path / TORCHTSP_CONFIG_NAME
    hint = "a torchtsp checkpoint directory needs torchtsp.json (written by save_torchtsp_checkpoint)"
    if not meta_path.is_file() and (path / HF_CONFIG_NAME).is_file():
        hint += "; this looks like a Hugging Face checkpoint: use load_hf_checkpoint or `torchtsp convert`"
    meta = _read_json(meta_path, hint)
    if meta.get("format") != "torchtsp":
        raise ValueError(f"{meta_path}: format={meta.get('format')!r}, expected 'torchtsp'")
    if meta.get("version") != TORCHTSP_FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: unsupported version={meta.get('version')!r}; this torchtsp reads version "
            f"{TORCHTSP_FORMAT_VERSION}"
        )
    if not isinstance(meta.get("model"), dict):
        raise ValueError(f"{meta_path}: 'model' must be an object of ModelConfig fields")  # noqa: TRY004
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: invalid model config: {e}") from e
    weights = path / SAFE_WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"weights file {weights} not found; re-save the checkpoint")
    sd = _load_safetensors(weights)
    try:
        _check_state_dict(sd, reference_shapes(cfg), f"{weights}")
    except ValueError as e:
        raise ValueError(f"{e} (config from {meta_path})") from e
    return cfg, sd


# --------------------------------------------------------------------------- reading slice by slice


def _hf_weight_files(path: Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file that holds it (one file, or the shards of an index)."""
    from safetensors import SafetensorError, safe_open

    single, index = path / SAFE_WEIGHTS_NAME, path / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file() and not single.is_file():
        return _index_weight_map(path, index)
    candidates = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if len(candidates) != 1:
        _load_hf_weights(path)  # raises the same clear error as a whole-checkpoint load
    try:
        with safe_open(str(candidates[0]), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), candidates[0])
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{candidates[0]} is not a readable safetensors file (truncated or corrupt?): {e}; "
                         "re-download or re-save it") from e


def open_hf_weights(path: str | os.PathLike):
    """``(cfg, weights)`` of an HF checkpoint directory without reading its tensors: ``weights`` is a
    ``torchtsp.weights.SafetensorsWeights`` that ``parallelize(..., weights=weights)`` reads slice by slice,
    so each rank reads only the bytes of its own shards."""
    from .weights import SafetensorsWeights

    path = Path(path)
    cfg, cfg_path = _hf_dir_config(path)
    files = _hf_weight_files(path)
    try:
        return cfg, SafetensorsWeights(cfg, files, _hf_location if _is_fused(files) else _file_location(cfg))
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match {cfg_path}: {e}") from e


def open_torchtsp_weights(path: str | os.PathLike):
    """``(cfg, weights)`` of a native torchtsp checkpoint directory, read slice by slice like ``open_hf_weights``."""
    from .weights import SafetensorsWeights

    path = Path(path)
    _require_dir(path)
    meta_path = path / TORCHTSP_CONFIG_NAME
    meta = _read_json(meta_path, "a torchtsp checkpoint directory needs torchtsp.json")
    if meta.get("format") != "torchtsp" or meta.get("version") != TORCHTSP_FORMAT_VERSION:
        raise ValueError(f"{meta_path}: not a torchtsp checkpoint of version {TORCHTSP_FORMAT_VERSION}")
    try:
        cfg = ModelConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: invalid model config: {e}") from e
    try:
        return cfg, SafetensorsWeights(cfg, _hf_weight_files(path), lambda name: name)
    except ValueError as e:
        raise ValueError(f"weights in {path} do not match {meta_path}: {e}") from e


DEFAULT_SHARD_BYTES = 2**30  # streamed exports hold at most one output file of this size


def write_weights(path: str | os.PathLike, weights, fmt: str = "hf", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  dtype: torch.dtype | None = None) -> None:
    """Write the model ``weights`` (a ``torchtsp.weights.WeightSource``) as a Hugging Face (``fmt="hf"``) or
    native torchtsp checkpoint, streaming: tensors are read one at a time in reference order and written as
    soon as an output file of ``max_shard_bytes`` is full, so at most one file's worth is ever held. A model
    under ``max_shard_bytes`` is one ``model.safetensors``; a larger one, shards plus an index."""
    if fmt not in ("hf", "torchtsp"):
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose 'hf' or 'torchtsp'")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = weights.cfg
    stored = _to_hf_name if fmt == "hf" else (lambda name: name)
    dtype = dtype or weights.dtype
    nbytes = {name: math.prod(shape) * dtype.itemsize for name, shape in weights.shapes.items()}
    units: dict[str, list[str]] = {}  # stored tensor -> the reference names it is made of (two for fused halves)
    for name in weights.shapes:  # reference order
        units.setdefault(stored(name), []).append(name)
    groups: list[list[str]] = [[]]
    for unit in units.values():
        size = sum(nbytes[n] for n in unit)
        if groups[-1] and sum(nbytes[n] for n in groups[-1]) + size > max_shard_bytes:
            groups.append([])
        groups[-1].extend(unit)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_weight_files(path)
    metadata = {"format": "pt"} if fmt == "hf" else {"format": "pt", "torchtsp": str(TORCHTSP_FORMAT_VERSION)}
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        fname = SAFE_WEIGHTS_NAME if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        if fmt == "hf":  # as save_pretrained writes: one tensor per expert
            tensors = {k: t.to(dtype).contiguous() for k, t in
                       _to_hf_tensors({n: weights.get(n) for n in names}, names, _file_location(cfg)).items()}
        else:
            tensors = {n: weights.get(n).to(dtype).contiguous() for n in names}
        _save_safetensors(path / fname, tensors, metadata)
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    if len(groups) > 1:
        _write_json(path / SAFE_WEIGHTS_INDEX_NAME,
                    {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map})
    if fmt == "hf":
        _write_json(path / HF_CONFIG_NAME, config_to_hf(cfg, dtype=str(dtype).removeprefix("torch.")))
    else:
        _write_json(path / TORCHTSP_CONFIG_NAME,
                    {"format": "torchtsp", "version": TORCHTSP_FORMAT_VERSION, "model": cfg.to_dict()})
