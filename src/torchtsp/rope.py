"""A layer kind's rotary position embedding: which table (``RopeSpec``) and how it is computed (``ROPE_TYPES``).

A RoPE table is a function of the positions and, for the types that adapt to the context (dynamic NTK, LongRoPE),
of the sequence's length: ``rope_tables(positions, spec, seq_len)`` gives cos/sin [..., head_dim], already
multiplied by the type's attention factor (YaRN's and LongRoPE's scale on cos and sin, 1 otherwise), as
transformers' rotary embeddings return them. Each type is one entry of ``ROPE_TYPES``: the parameters it takes
(transformers' names in ``rope_parameters`` / ``rope_scaling``) and its inverse frequencies, written op for op as
transformers' ``modeling_rope_utils`` computes them, so that the tables are bitwise the reference's. A new type
is one function and one entry here; nothing else reads a type's parameters.

torch is imported where a table is computed, not with the module: the config (and so ``torchtsp plan``, which
imports no torch) checks a type's parameters here.

``seq_len`` is the length the context-dependent types read: the whole sequence (every rank of a sequence axis
passes the global length, never its chunk), or the longest document of packed rows (positions restart there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ParamValue = float | int | bool | tuple


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: base ``theta``, ``head_dim``, scaling type (None: plain RoPE) and that type's parameters
    (transformers' names, sorted pairs: hashable, so layers with equal specs share one table)."""

    theta: float
    head_dim: int
    scaling: str | None = None
    params: tuple[tuple[str, ParamValue], ...] = ()

    def param(self, name: str):
        """The value of parameter ``name`` (its type's default where the config left it out)."""
        given = dict(self.params)
        if name in given:
            return given[name]
        return ROPE_TYPES[self.scaling].defaults[name]

    def inv_freq_and_factor(self, seq_len: int | None, device=None) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim / 2] float32, attention factor) for a sequence of ``seq_len`` tokens."""
        if self.scaling is None:
            return default_inv_freq(self.theta, self.head_dim, device), 1.0
        return ROPE_TYPES[self.scaling].compute(self, seq_len, device)


def default_inv_freq(theta: float, head_dim: int, device=None) -> torch.Tensor:
    """Plain RoPE's inverse frequencies, as transformers' ``_compute_default_rope_parameters``."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_tables(positions: torch.Tensor, spec: RopeSpec, seq_len: int | None = None):
    """cos/sin tables [..., head_dim] of (global) ``positions`` of any shape ([S] -> [S, d]; [B, T] -> [B, T, d]:
    a KV cache, each row at its own positions), times the type's attention factor."""
    import torch

    inv_freq, factor = spec.inv_freq_and_factor(seq_len, positions.device)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


# ---------------------------------------------------------------- the types


@dataclass(frozen=True)
class RopeType:
    """A scaling type: the parameters it needs, those it may take (with defaults), how its table is computed and
    which families ship it (for messages)."""

    required: tuple[str, ...]
    defaults: dict
    compute: Callable[[RopeSpec, int | None, object], tuple[torch.Tensor, float]]
    families: str


def _linear(spec: RopeSpec, seq_len, device):
    """transformers' 'linear': positions divided by ``factor`` (its inverse frequencies divided instead)."""
    return default_inv_freq(spec.theta, spec.head_dim, device) / spec.param("factor"), 1.0


def _llama3(spec: RopeSpec, seq_len, device):
    """Llama 3.1's rescaling, as ``_compute_llama3_parameters``: wavelengths shorter than
    original_max / high_freq_factor kept, longer than original_max / low_freq_factor stretched by ``factor``,
    the band between interpolated smoothly."""
    import torch

    inv_freq = default_inv_freq(spec.theta, spec.head_dim, device)
    factor, low, high = spec.param("factor"), spec.param("low_freq_factor"), spec.param("high_freq_factor")
    old_context_len = spec.param("original_max_position_embeddings")
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


ROPE_TYPES: dict[str, RopeType] = {
    "linear": RopeType(("factor",), {}, _linear, "Gemma 3 (4B and larger)"),
    "llama3": RopeType(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {},
                       _llama3, "Llama 3.1, 3.2, 3.3"),
}

# What transformers also knows, and who ships it: named in the refusal of a type torchtsp does not implement.
KNOWN_ELSEWHERE = {
    "dynamic": "older Llama / Qwen checkpoints (dynamic NTK)",
    "yarn": "Qwen3 past 32K, DeepSeek-V3 / R1, Kimi K2, GPT-OSS",
    "longrope": "Phi-3, Phi-3.5, Phi-4-mini",
}


def rope_type(name: str) -> RopeType:
    """The implemented type ``name``; one line naming it and its families otherwise."""
    if name in ROPE_TYPES:
        return ROPE_TYPES[name]
    who = f" (used by {KNOWN_ELSEWHERE[name]})" if name in KNOWN_ELSEWHERE else ""
    raise ValueError(f"rope_type {name!r}{who} is not implemented by torchtsp; it implements plain RoPE and "
                     f"{', '.join(repr(n) for n in ROPE_TYPES)}")


def check_params(name: str | None, params: tuple) -> tuple[tuple[str, ParamValue], ...]:
    """The scaling parameters of type ``name`` in their one spelling (sorted pairs, numbers as floats except the
    integer context lengths), or one line on what is wrong."""
    pairs = dict(params)
    if name is None:
        if pairs:
            raise ValueError(f"RoPE parameters {sorted(pairs)} need a scaling type (rope_scaling); set it or drop them")
        return ()
    kind = rope_type(name)
    missing = [p for p in kind.required if pairs.get(p) is None]
    if missing:
        raise ValueError(f"rope_type {name!r} needs {', '.join(missing)}")
    unknown = sorted(set(pairs) - set(kind.required) - set(kind.defaults))
    if unknown:
        raise ValueError(f"rope_type {name!r} takes {', '.join((*kind.required, *kind.defaults))}; not {unknown[0]!r}")
    out = {}
    for key, value in pairs.items():
        if value is None:
            continue
        if isinstance(value, list | tuple):
            out[key] = tuple(float(v) for v in value)
        elif isinstance(value, bool):
            out[key] = value
        elif key.endswith("max_position_embeddings"):
            out[key] = int(value)
        else:
            out[key] = float(value)
    for key in ("factor", "original_max_position_embeddings"):
        if key in out and not out[key] > 0:
            raise ValueError(f"rope_type {name!r}: {key} must be positive, got {out[key]}")
    if name == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"RoPE type 'llama3': high_freq_factor={out['high_freq_factor']} must exceed "
                         f"low_freq_factor={out['low_freq_factor']} (llama3 RoPE interpolates between them)")
    return tuple(sorted(out.items()))
