"""Hugging Face tensor names and state dicts: where each torchtsp parameter lies in an HF model or file.

No weight permutation is needed: ``torchtsp.model.apply_rope`` uses the same half-split ("rotate_half") RoPE
convention as these HF models, so q/k projections map one to one, and the dense families use the same HF
parameter names. Expert weights are stacked [E, ...] tensors in torchtsp; HF holds them fused in a live model
(``gate_up_proj``, ``hf_location``) and one tensor per expert in checkpoint files (``file_location``). Phi-3
fuses q, k and v into ``qkv_proj`` and gate and up into ``gate_up_proj``, in its files too: torchtsp keeps them
apart (tensor parallelism cuts each along its own heads or width), split on load and joined on export.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model import reference_shapes

SHOW = 5  # how many offending names an error message lists

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
# Parts of one fused HF tensor: torchtsp name inside a block -> (HF name, dim, which part, the parts' widths).
# transformers stores each expert's gate and up projections as one [E, 2·F, h] tensor (gate rows first); torchtsp
# keeps them apart, so that tensor parallelism can cut both along F.
_FUSED_NAMES = {
    "feed_forward.experts.w_gate": ("mlp.experts.gate_up_proj", 1, 0, lambda cfg: (cfg.moe_ffn_dim,) * 2),
    "feed_forward.experts.w_up": ("mlp.experts.gate_up_proj", 1, 1, lambda cfg: (cfg.moe_ffn_dim,) * 2),
}


def _qkv_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim


# Phi-3's fused projections (rows of q, then k, then v; of gate, then up).
_PHI3_FUSED_NAMES = {
    "attention.wq.weight": ("self_attn.qkv_proj.weight", 0, 0, _qkv_widths),
    "attention.wk.weight": ("self_attn.qkv_proj.weight", 0, 1, _qkv_widths),
    "attention.wv.weight": ("self_attn.qkv_proj.weight", 0, 2, _qkv_widths),
    "feed_forward.w_gate.weight": ("mlp.gate_up_proj.weight", 0, 0, lambda cfg: (cfg.ffn_dim,) * 2),
    "feed_forward.w_up.weight": ("mlp.gate_up_proj.weight", 0, 1, lambda cfg: (cfg.ffn_dim,) * 2),
}
# Gemma's sandwich norms: its post_attention_layernorm norms the attention's output (Llama's names the MLP's input),
# pre_feedforward_layernorm the MLP's input.
_SANDWICH_NAMES = {
    "attention_out_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_out_norm.weight": "post_feedforward_layernorm.weight",
}
# GPT-OSS (``gpt_oss``): its own router and attention extras; its experts are stored in their own layout
# (``ExpertPart``).
_GPT_OSS_NAMES = {
    "attention.sinks": "self_attn.sinks",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.down_bias": "mlp.experts.down_proj_bias",
}


@dataclass(frozen=True)
class ExpertPart:
    """A stacked expert parameter [E, ...] stored as (a part of) an expert tensor of another layout, read and written
    one expert at a time. GPT-OSS: ``mlp.experts.gate_up_proj`` [E, h, 2F] holds gate (even columns) and up (odd)
    interleaved, transposed against torchtsp's [F, h]; ``down_proj`` [E, F, h] is transposed; ``gate_up_proj_bias``
    [E, 2F] interleaves the two biases. ``mxfp4``: the published checkpoints' ``{stored}_blocks`` and
    ``{stored}_scales`` (OpenAI's MXFP4: 32 four-bit values per block, one power-of-two scale) of the matrix in
    [E, out, in] order, dequantized on read (``dequantize_mxfp4``)."""

    stored: str
    parts: int = 1
    index: int = 0
    transposed: bool = False
    mxfp4: bool = False

    @property
    def stored_names(self) -> list[str]:
        return [f"{self.stored}_blocks", f"{self.stored}_scales"] if self.mxfp4 else [self.stored]

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each stored tensor's shape for a parameter of ``shape`` ([E, out, in] or [E, n])."""
        E, *rest = shape
        if self.mxfp4:
            out, inner = rest
            rows = (out * self.parts, inner // 32)
            return {self.stored_names[0]: (E, *rows, 16), self.stored_names[1]: (E, *rows)}
        if len(rest) == 1:
            return {self.stored: (E, rest[0] * self.parts)}
        out, inner = rest
        return {self.stored: (E, inner, out * self.parts) if self.transposed else (E, out * self.parts, inner)}

    def expert(self, stored: list[torch.Tensor]) -> torch.Tensor:
        """This parameter's matrix (or vector) of one expert from that expert's stored tensors."""
        if self.mxfp4:
            return dequantize_mxfp4(*stored)[self.index::self.parts]
        t = stored[0][..., self.index::self.parts]
        return t.transpose(-1, -2) if self.transposed and t.dim() == 2 else t

    def joined(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The stored tensor [E, ...] from every part's stacked parameter, in order (export)."""
        if self.transposed:
            parts = [p.transpose(-1, -2) for p in parts]
        return torch.stack(parts, dim=-1).flatten(-2) if len(parts) > 1 else parts[0]


# OpenAI's MXFP4 values of the 16 four-bit codes (e2m1), as the format defines them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """One expert's MXFP4 matrix: ``blocks`` [out, G, 16] uint8 (two codes per byte, the low nibble first) and
    ``scales`` [out, G] uint8 (a biased power of two, 127 = 2^0) -> [out, G·32] in ``dtype``."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [out, G, 16, 2]
    values = table[codes].flatten(-2)  # [out, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


_GPT_OSS_EXPERTS = {"w_gate": ("gate_up_proj", 2, 0), "w_up": ("gate_up_proj", 2, 1), "w_down": ("down_proj", 1, 0),
                    "gate_bias": ("gate_up_proj_bias", 2, 0), "up_bias": ("gate_up_proj_bias", 2, 1)}


def _gpt_oss_location(idx: str, local: str, mxfp4: bool):
    if local in _GPT_OSS_NAMES:
        return f"model.layers.{idx}.{_GPT_OSS_NAMES[local]}"
    kind = local.removeprefix("feed_forward.experts.")
    if kind in _GPT_OSS_EXPERTS:
        stored, parts, index = _GPT_OSS_EXPERTS[kind]
        matrix = not kind.endswith("_bias")
        return ExpertPart(f"model.layers.{idx}.mlp.experts.{stored}", parts, index, transposed=matrix,
                          mxfp4=mxfp4 and matrix)
    return None


_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_EMBED, _HF_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Non-persistent RoPE buffers that old checkpoints sometimes carry; they are recomputed, never loaded.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")

def hf_location(name: str, cfg: ModelConfig, mxfp4: bool = False) -> str | tuple | ExpertPart:
    """Where torchtsp parameter ``name`` lies in a transformers model's own state dict: an HF tensor name,
    ("fused", HF name, dim, part, widths) for part ``part`` along ``dim`` of a fused HF tensor whose parts have
    ``widths`` (the experts' gate_up_proj; Phi-3's qkv_proj and gate_up_proj), or an ``ExpertPart`` (GPT-OSS's
    experts; ``mxfp4``: as its published files store them). ``cfg`` is required: a family may name a block's norms
    otherwise (Gemma's sandwich norms) or fuse them (Phi-3)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    prefix, _, rest = name.partition(".")
    idx, _, local = rest.partition(".")
    if prefix == "layers" and idx.isdigit() and cfg.hf_model_type == "gpt_oss":
        where = _gpt_oss_location(idx, local, mxfp4)
        if where is not None:
            return where
    fused = {**_FUSED_NAMES, **_PHI3_FUSED_NAMES} if cfg.hf_model_type == "phi3" else _FUSED_NAMES
    names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if cfg.sandwich_norm else _LAYER_NAMES
    if prefix == "layers" and idx.isdigit() and local in fused:
        hf_name, dim, part, widths = fused[local]
        return "fused", f"model.layers.{idx}.{hf_name}", dim, part, widths(cfg)
    if prefix == "layers" and idx.isdigit() and local in names:
        return f"model.layers.{idx}.{names[local]}"
    raise KeyError(name)


def model_location(cfg: ModelConfig):
    """``hf_location`` of ``cfg``'s model as a function of the name alone (what ``file_location`` is for files)."""
    return lambda name: hf_location(name, cfg)


# The experts' matrices one by one, as checkpoint files hold them (what save_pretrained writes and the Hub
# serves; transformers fuses them on load): torchtsp name -> HF name of expert e's matrix, per family.
_EXPERT_FILE_NAMES = {
    "qwen2_moe": ("mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}),
}


def file_location(cfg: ModelConfig):
    """``hf_location`` for checkpoint files: stacked expert weights are ("experts", [HF name of each expert's
    matrix]), and Mixtral's MoE block is ``block_sparse_moe``. GPT-OSS's files keep the model's own layout."""
    if cfg.hf_model_type == "gpt_oss":
        return model_location(cfg)
    block, names = _EXPERT_FILE_NAMES.get(cfg.hf_model_type, ("mlp", {}))

    def location(name: str):
        prefix, _, rest = name.partition(".")
        idx, _, local = rest.partition(".")
        if prefix == "layers" and local.startswith("feed_forward.experts."):
            kind = names[local.rpartition(".")[2]]
            return "experts", [f"model.layers.{idx}.{block}.experts.{e}.{kind}.weight" for e in range(cfg.n_experts)]
        where = hf_location(name, cfg)
        return where.replace(".mlp.gate.", f".{block}.gate.") if isinstance(where, str) else where

    return location


def is_fused(names) -> bool:
    return any(n.endswith(".experts.gate_up_proj") for n in names)


def stored_location(cfg: ModelConfig, names):
    """The ``hf_location`` function of stored tensors ``names`` (a state dict's or a folder's): experts fused
    (a transformers model's own state dict, and GPT-OSS's bf16 files), one tensor per expert (other families'
    files), or MXFP4 blocks and scales (GPT-OSS's published files)."""
    if cfg.hf_model_type == "gpt_oss" and any(n.endswith("_blocks") for n in names):
        return lambda name: hf_location(name, cfg, mxfp4=True)
    return model_location(cfg) if is_fused(names) else file_location(cfg)


def to_hf_name(name: str, cfg: ModelConfig) -> str:
    """The HF tensor (in a transformers model's state dict) that holds torchtsp parameter ``name`` or a part of it."""
    where = hf_location(name, cfg)
    return where if isinstance(where, str) else where.stored if isinstance(where, ExpertPart) else where[1]


def fused_shape(shape: tuple[int, ...], where: tuple) -> tuple[int, ...]:
    """The shape of the fused HF tensor of which ``where`` ("fused", name, dim, part, widths) locates a part of
    ``shape``."""
    _, _, dim, _, widths = where
    return tuple(sum(widths) if d == dim else n for d, n in enumerate(shape))


def _hf_shapes(expected: dict[str, tuple[int, ...]], location) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, from torchtsp names -> shapes (fused parts add up along their dim)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in expected.items():
        where = location(name)
        if isinstance(where, ExpertPart):
            out.update(where.stored_shapes(tuple(shape)))
        elif isinstance(where, str):
            out[where] = tuple(shape)
        elif where[0] == "fused":
            out[where[1]] = fused_shape(shape, where)
        else:
            out.update(dict.fromkeys(where[1], tuple(shape[1:])))
    return out


def _from_hf_tensor(hf_sd: dict, where) -> torch.Tensor:
    if isinstance(where, ExpertPart):
        stored = [hf_sd[n] for n in where.stored_names]
        return torch.stack([where.expert([t[e] for t in stored]) for e in range(stored[0].shape[0])])
    if isinstance(where, str):
        return hf_sd[where]
    if where[0] == "fused":
        _, hf_name, dim, part, widths = where
        return hf_sd[hf_name].split(widths, dim=dim)[part]
    return torch.stack([hf_sd[n] for n in where[1]])


def to_hf_tensors(sd: dict, names, location) -> dict[str, torch.Tensor]:
    """HF-named tensors from torchtsp ``names`` of ``sd`` (fused parts concatenated, experts split)."""
    out, fused, expert_parts = {}, {}, {}
    for name in names:
        where = location(name)
        if isinstance(where, ExpertPart):
            expert_parts.setdefault(where.stored, {})[where.index] = (where, sd[name])
        elif isinstance(where, str):
            out[where] = sd[name]
        elif where[0] == "fused":
            _, hf_name, dim, part, widths = where
            fused.setdefault(hf_name, (dim, len(widths), {}))[2][part] = sd[name]
        else:
            out.update(zip(where[1], sd[name].unbind(0)))
    for hf_name, (dim, n_parts, parts) in fused.items():
        if set(parts) != set(range(n_parts)):
            raise ValueError(f"{hf_name} needs all {n_parts} of its parts, got {sorted(parts)}")
        out[hf_name] = torch.cat([parts[i] for i in range(n_parts)], dim=dim)
    for stored, by_index in expert_parts.items():
        part = by_index[0][0]
        if set(by_index) != set(range(part.parts)):
            raise ValueError(f"{stored} needs all of its {part.parts} parts, got {sorted(by_index)}")
        out[stored] = part.joined([by_index[i][1] for i in range(part.parts)])
    return out


def format_names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOW])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > SHOW else shown


def check_state_dict(sd: dict, expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Raise one ValueError describing missing/unexpected keys and shape mismatches."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    bad_shape = [k for k in expected if k in sd and tuple(sd[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing keys: {format_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {format_names(unexpected)}")
    if bad_shape:
        details = [f"{k}: expected {expected[k]}, found {tuple(sd[k].shape)}" for k in bad_shape[:SHOW]]
        more = f" ... ({len(bad_shape)} in all)" if len(bad_shape) > SHOW else ""
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
    location = stored_location(cfg, hf_sd)
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
    check_state_dict(sd, hf_expected, "Hugging Face state dict")
    return {k: _from_hf_tensor(sd, location(k)) for k in expected}


def to_hf_state_dict(sd: dict, cfg: ModelConfig, files: bool = False) -> dict:
    """torchtsp ``Transformer`` state dict -> HF ``*ForCausalLM`` names (no ``lm_head`` when tied): those of a
    transformers model's state dict (experts fused), or with ``files`` those of checkpoint files (one tensor per
    expert, as ``save_pretrained`` writes)."""
    expected = reference_shapes(cfg)
    check_state_dict(sd, expected, "torchtsp state dict")
    return to_hf_tensors(sd, expected, file_location(cfg) if files else model_location(cfg))
