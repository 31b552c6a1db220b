"""Hugging Face interop: configs (``config``), tensor names and state dicts (``names``), and the checkpoint
folders on disk, read and written by one reader and one writer (``files``). Conversion lives in convert.py.

The families handled are Llama, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Phi-3 (fused
q/k/v and gate/up projections), Gemma 3's text model (sandwich norms) and the mixtures of experts Qwen2-MoE and
Mixtral, with the RoPE scaling types of ``rope.ROPE_TYPES`` (llama3, linear, yarn, longrope, dynamic); every
other feature is refused with its config field named.
"""

from .config import config_from_hf, config_to_hf
from .files import (
    DEFAULT_SHARD_BYTES,
    HF_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    TORCHTSP_CONFIG_NAME,
    TORCHTSP_FORMAT_VERSION,
    load_hf_checkpoint,
    load_torchtsp_checkpoint,
    open_hf_weights,
    open_torchtsp_weights,
    read_json,
    require_dir,
    save_hf_checkpoint,
    save_torchtsp_checkpoint,
    write_weights,
)
from .names import from_hf_state_dict, to_hf_state_dict

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "HF_CONFIG_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "TORCHTSP_CONFIG_NAME",
    "TORCHTSP_FORMAT_VERSION",
    "config_from_hf",
    "config_to_hf",
    "from_hf_state_dict",
    "load_hf_checkpoint",
    "load_torchtsp_checkpoint",
    "open_hf_weights",
    "open_torchtsp_weights",
    "read_json",
    "require_dir",
    "save_hf_checkpoint",
    "save_torchtsp_checkpoint",
    "to_hf_state_dict",
    "write_weights",
]

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
