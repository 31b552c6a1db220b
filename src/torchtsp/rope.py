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

``seq_len`` is the length the context-dependent types read, as transformers reads max(position_ids) + 1 of one
forward: the whole sequence's (an int; every rank of a sequence axis passes the global length, never its chunk),
or lengths broadcastable to the positions' shape: each token's document's in packed rows ([B, L], positions
restart there, ``masks.rope_length``), each sequence's of a KV cache step ([B, 1], docs/inference.md).

Parameters that transformers derives from the model's ``max_position_embeddings`` are fixed when the config is
made (``check_params``), so a table never depends on ``ModelConfig.max_seq_len``, which trainers and benches
raise to fit their sequences.
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

    def inv_freq_and_factor(self, seq_len=None, device=None) -> tuple[torch.Tensor, float]:
        """(inverse frequencies float32, attention factor) for a sequence of ``seq_len`` tokens: [head_dim / 2],
        or [*seq_len.shape, head_dim / 2] for a tensor of lengths and a type that reads them."""
        if self.scaling is None:
            return default_inv_freq(self.theta, self.head_dim, device), 1.0
        return ROPE_TYPES[self.scaling].compute(self, seq_len, device)

    @property
    def reads_length(self) -> bool:
        """Whether the table depends on the sequence's length (dynamic NTK, LongRoPE)."""
        return self.scaling is not None and ROPE_TYPES[self.scaling].reads_length

    @property
    def switch_length(self) -> int | None:
        """The length past which a sequence's table changes once, for good (LongRoPE: its long factors from
        original_max_position_embeddings + 1 tokens on); None for the other types. A KV cache written with the
        table before it is rebuilt when its sequence crosses it, as transformers' Phi-3 does."""
        return self.param("original_max_position_embeddings") if self.scaling == "longrope" else None

    def max_length(self, max_seq_len: int) -> int | None:
        """The longest sequence a model of context ``max_seq_len`` takes with this table (None: no bound).
        Dynamic NTK recomputes its base from the length: it is built to run past the trained context. YaRN is
        built for ``factor`` x original_max_position_embeddings (Qwen3's 4 x 32K = 128K over its config's 40,960).
        The other types: the model's own context."""
        if self.scaling == "dynamic":
            return None
        if self.scaling == "yarn":
            return max(max_seq_len, int(self.param("factor") * self.param("original_max_position_embeddings")))
        return max_seq_len


def default_inv_freq(theta: float, head_dim: int, device=None) -> torch.Tensor:
    """Plain RoPE's inverse frequencies, as transformers' ``_compute_default_rope_parameters``."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_tables(positions: torch.Tensor, spec: RopeSpec, seq_len=None):
    """cos/sin tables [..., head_dim] of (global) ``positions`` of any shape ([S] -> [S, d]; [B, T] -> [B, T, d]:
    a KV cache, each row at its own positions), times the type's attention factor. ``seq_len``: an int, or lengths
    broadcastable to ``positions``' shape (per token [B, T], per row [B, 1])."""
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
    """A scaling type: the parameters it needs, those it may take (with defaults; ``derive`` fills those that
    transformers takes from the model's max_position_embeddings), how its table is computed, whether that reads
    the sequence's length, and which families ship it (for messages)."""

    required: tuple[str, ...]
    defaults: dict
    compute: Callable[[RopeSpec, object, object], tuple[torch.Tensor, float]]
    families: str
    reads_length: bool = False
    derive: Callable[[dict, int], None] | None = None


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


def yarn_mscale(scale: float, mscale: float = 1) -> float:
    """YaRN's attention scale 0.1 · mscale · ln(scale) + 1 (1 for scale <= 1), as transformers' yarn_get_mscale."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, seq_len, device):
    """YaRN, as ``_compute_yarn_parameters``: dimensions that turn fewer than beta_slow times over the original
    context are interpolated by ``factor``, more than beta_fast times kept, a linear ramp between (its bounds
    rounded outwards unless ``truncate`` is False: GPT-OSS); attention factor 0.1 ln(factor) + 1, or the ratio of
    the mscale / mscale_all_dim scales when both are given, or ``attention_factor`` itself."""
    import torch

    base, dim = spec.theta, spec.head_dim
    factor, original = spec.param("factor"), spec.param("original_max_position_embeddings")
    attention_factor = spec.param("attention_factor")
    mscale, mscale_all_dim = spec.param("mscale"), spec.param("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = spec.param("beta_fast") or 32, spec.param("beta_slow") or 1

    def correction_dim(rotations):  # the dimension that turns ``rotations`` times over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.param("truncate"):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # On the table's device from the start: a host tensor moved there would wait for the device every step.
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # the share of each dimension's frequency kept as trained
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, attention_factor


def _length_tensor(seq_len, device):
    """``seq_len`` as an int64 tensor on ``device``: a 0-d one for an int (transformers' max(position_ids) + 1),
    or [..., 1] for a tensor of lengths (host lengths copied without waiting for the device)."""
    import torch

    if isinstance(seq_len, int):
        return torch.full((), seq_len, dtype=torch.int64, device=device)
    return seq_len.to(device=device, dtype=torch.int64, non_blocking=True).unsqueeze(-1)


def _longrope(spec: RopeSpec, seq_len, device):
    """LongRoPE (Phi-3), as ``_compute_longrope_parameters``: each frequency divided by its short factor, or by its
    long factor for a sequence longer than original_max_position_embeddings (transformers' rotary embedding
    switches on max(position_ids) + 1 of the forward); attention factor sqrt(1 + ln(factor) / ln(original)),
    ``factor`` being max_position_embeddings / original where the config gives none (fixed with the config)."""
    import torch

    base, dim = spec.theta, spec.head_dim
    original, factor = spec.param("original_max_position_embeddings"), spec.param("factor")
    attention_factor = spec.param("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim

    def inv_freq(name):  # the factor lists are host values: copied without waiting for the device
        factors = torch.tensor(spec.param(name), dtype=torch.float32).to(device=device, non_blocking=True)
        return 1.0 / (factors * base**shape)

    short = inv_freq("short_factor")
    if seq_len is None or isinstance(seq_len, int) and seq_len <= original:
        return short, attention_factor
    if isinstance(seq_len, int):
        return inv_freq("long_factor"), attention_factor
    return torch.where(_length_tensor(seq_len, device) > original, inv_freq("long_factor"), short), attention_factor


def _dynamic(spec: RopeSpec, seq_len, device):
    """Dynamic NTK, as ``_compute_dynamic_ntk_parameters`` under transformers' ``dynamic_rope_update``: up to the
    trained context L0 (transformers' max_position_embeddings) the base computed at init; past it the base
    theta · (factor · L / L0 - (factor - 1)) ** (d / (d - 2)) of the forward's length L, in float32 from the length
    as a tensor, as transformers computes it from max(position_ids) + 1."""
    import torch

    theta, dim = spec.theta, spec.head_dim
    factor, trained = spec.param("factor"), spec.param("max_position_embeddings")

    def inv_freq(base):
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))

    at_init = inv_freq(theta * ((factor * trained / trained) - (factor - 1)) ** (dim / (dim - 2)))
    if seq_len is None or isinstance(seq_len, int) and seq_len <= trained:
        return at_init, 1.0
    length = _length_tensor(seq_len, device)
    grown = inv_freq(theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2)))
    if length.dim() == 0:
        return grown, 1.0
    return torch.where(length > trained, grown, at_init), 1.0


def _trained_context(given: dict, max_position_embeddings: int) -> None:
    """Dynamic NTK's trained context: transformers reads the model's max_position_embeddings."""
    given.setdefault("max_position_embeddings", max_position_embeddings)


def _longrope_factor(given: dict, max_position_embeddings: int) -> None:
    """LongRoPE's factor where the config gives none: max_position_embeddings / original (Phi-3 ships none)."""
    if given.get("factor") is None and given.get("original_max_position_embeddings"):
        given["factor"] = max_position_embeddings / given["original_max_position_embeddings"]


_YARN_DEFAULTS = {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
                  "mscale_all_dim": None, "truncate": True}

ROPE_TYPES: dict[str, RopeType] = {
    "linear": RopeType(("factor",), {}, _linear, "Gemma 3 (4B and larger)"),
    "llama3": RopeType(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {},
                       _llama3, "Llama 3.1, 3.2, 3.3"),
    "yarn": RopeType(("factor", "original_max_position_embeddings"), _YARN_DEFAULTS, _yarn,
                     "Qwen3 past 32K, DeepSeek-V3 / R1, Kimi K2, GPT-OSS"),
    "longrope": RopeType(("short_factor", "long_factor", "original_max_position_embeddings"),
                         {"factor": None, "attention_factor": None}, _longrope, "Phi-3, Phi-3.5, Phi-4-mini",
                         reads_length=True, derive=_longrope_factor),
    "dynamic": RopeType(("factor", "max_position_embeddings"), {}, _dynamic,
                        "older Llama / Qwen checkpoints (dynamic NTK)", reads_length=True, derive=_trained_context),
}

# What transformers also knows, and who ships it: named in the refusal of a type torchtsp does not implement.
KNOWN_ELSEWHERE = {
    "proportional": "Gemma 4 and LFM3 (RoPE on part of each head)",
    "axial": "Qwen3-VL and GLM-4V (multimodal positions)",
}


def rope_type(name: str) -> RopeType:
    """The implemented type ``name``; one line naming it and its families otherwise."""
    if name in ROPE_TYPES:
        return ROPE_TYPES[name]
    who = f" (used by {KNOWN_ELSEWHERE[name]})" if name in KNOWN_ELSEWHERE else ""
    raise ValueError(f"rope_type {name!r}{who} is not implemented by torchtsp; it implements plain RoPE and "
                     f"{', '.join(repr(n) for n in ROPE_TYPES)}")


def check_params(name: str | None, params: tuple, max_position_embeddings: int | None = None,
                 head_dim: int | None = None) -> tuple[tuple[str, ParamValue], ...]:
    """The scaling parameters of type ``name`` in their one spelling (sorted pairs, numbers as floats except the
    integer context lengths, lists as tuples), with the model's ``max_position_embeddings`` filling what
    transformers derives from it; or one line on what is wrong (``head_dim``: LongRoPE's factor lists must have
    one entry per rotated pair)."""
    pairs = {k: v for k, v in dict(params).items() if v is not None}
    if name is None:
        if pairs:
            raise ValueError(f"RoPE parameters {sorted(pairs)} need a scaling type (rope_scaling); set it or drop them")
        return ()
    kind = rope_type(name)
    if kind.derive is not None and max_position_embeddings is not None:
        kind.derive(pairs, max_position_embeddings)
    missing = [p for p in kind.required if pairs.get(p) is None]
    if missing:
        raise ValueError(f"rope_type {name!r} needs {', '.join(missing)}")
    unknown = sorted(set(pairs) - set(kind.required) - set(kind.defaults))
    if unknown:
        raise ValueError(f"rope_type {name!r} takes {', '.join((*kind.required, *kind.defaults))}; not {unknown[0]!r}")
    out = {}
    for key, value in pairs.items():
        if isinstance(value, list | tuple):
            out[key] = tuple(float(v) for v in value)
        elif isinstance(value, bool):
            out[key] = value
        elif key.endswith("max_position_embeddings"):
            out[key] = int(value)
        else:
            out[key] = float(value)
    for key in ("factor", "original_max_position_embeddings", "max_position_embeddings"):
        if key in out and not out[key] > 0:
            raise ValueError(f"rope_type {name!r}: {key} must be positive, got {out[key]}")
    if name == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"RoPE type 'llama3': high_freq_factor={out['high_freq_factor']} must exceed "
                         f"low_freq_factor={out['low_freq_factor']} (llama3 RoPE interpolates between them)")
    if name == "longrope":
        for key in ("short_factor", "long_factor"):
            if head_dim is not None and len(out[key]) != head_dim // 2:
                raise ValueError(f"rope_type 'longrope': {key} has {len(out[key])} entries; it needs one per "
                                 f"rotated pair, head_dim / 2 = {head_dim // 2}")
        if "factor" not in out:
            raise ValueError("rope_type 'longrope' needs factor (or the model's max_position_embeddings to derive "
                             "it from)")
    return tuple(sorted(out.items()))
