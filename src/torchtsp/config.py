"""Model configuration and named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION, LayerSpec, layer_specs
from .rope import RopeSpec, check_params

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "gemma3_text")
MOE_FAMILIES = ("mixtral", "qwen2_moe")
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# Checkpoints written before ``rope_params`` held llama3 / linear scaling in fields of their own.
_LEGACY_ROPE_FIELDS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_position_embeddings": "original_max_position_embeddings",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) and the features of its family.

    The family features all default to off, which is plain Llama:

    * ``rope_scaling``: a RoPE scaling type of ``rope.ROPE_TYPES`` ("llama3": Llama 3.1+, "linear", "yarn",
      "longrope": Phi-3, "dynamic": dynamic NTK), with its parameters in ``rope_params`` by Hugging Face's names
      (e.g. ``(("factor", 8.0), ...)``; a dict is taken too); both empty for plain RoPE. What transformers derives
      from max_position_embeddings (dynamic NTK's trained context, LongRoPE's factor) is fixed in ``rope_params``
      when the config is made, so raising ``max_seq_len`` later changes no table; ``max_length`` is the longest
      sequence the model then takes.
    * ``qkv_bias``: q, k and v projections have a bias, o has none (Qwen2 / Qwen2.5).
    * ``qk_norm``: an RMSNorm over head_dim, one weight shared by all heads, applied to each q and k
      head after the projection and before RoPE, with ``norm_eps`` (Qwen3).
    * ``family`` only names the Hugging Face architecture an export writes (``hf_model_type``). None
      infers it from the features: qwen3 with qk_norm, qwen2 with qkv_bias, llama otherwise; a family
      equal to the inferred one is stored as None. So in practice only "mistral" and "phi3" (Llama's math;
      Phi-3's fused q/k/v and gate/up projections are split on load and joined on export) are ever stored, to
      export such a checkpoint as its family again. MoE models are "mixtral" (no shared
      expert, every layer sparse, top-k weights always renormalised) or "qwen2_moe" (the default for MoE).

    Mixture of experts (``n_experts > 0``; all default to off, i.e. a dense model):

    * ``n_experts`` experts per sparse layer, each a SwiGLU MLP of width ``moe_ffn_dim``; a router (a linear
      layer to ``n_experts`` logits, softmax in float32) sends each token to its ``moe_top_k`` best experts,
      weighted by their probabilities, renormalised to sum to one if ``moe_norm_topk``. Dropless: no
      capacity limit, no token is ever dropped.
    * ``shared_expert_ffn_dim > 0``: a dense SwiGLU MLP of that width that every token also passes through,
      scaled by a sigmoid gate (a linear layer to one logit), as Qwen2-MoE.
    * Layer i is sparse unless it is in ``dense_layers`` or ``(i + 1) % moe_layer_step != 0`` (Hugging Face's
      ``mlp_only_layers`` and ``decoder_sparse_step``); dense layers use ``ffn_dim``.
    * The training loss adds ``router_aux_loss_coef`` times the load-balancing loss (``model.load_balancing_loss``).

    Attention shape and hybrid attention (defaults: every layer full, head_dim = dim / n_heads):

    * ``head_dim``: width of one head (None: dim // n_heads, stored as that number). Qwen3's small sizes and
      Gemma 3 have heads wider or narrower than dim / n_heads: wq is [n_heads·head_dim, dim], wo its transpose.
    * ``layer_types``: per layer "full_attention" or "sliding_attention" (Hugging Face's names; () or all full:
      every layer sees the whole causal context). A sliding layer's query at position i sees keys j with
      i - ``sliding_window`` < j <= i (transformers' convention: the window counts the query itself).
    * ``rope_local_theta``: the RoPE base of sliding layers, which then use plain RoPE (Gemma 3's
      rope_local_base_freq); None: sliding layers share the global layers' tables. ``rope_scaling="linear"``
      divides the frequencies by its "factor" (Gemma 3's global layers on its larger sizes).

    Gemma 3's variants of the one layer core (all off by default):

    * ``norm_offset``: every RMSNorm (q/k norms included) scales by (norm_offset + w), in float32 before the cast
      back, as Gemma's RMSNorm does; its weights start at zero. ``sandwich_norm``: each sublayer's output is
      normed too (post_attention / post_feedforward) before the residual add.
    * ``mlp_activation``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh approximation).
    * ``embed_scale``: embeddings are multiplied by sqrt(dim), rounded to the model's dtype.
    * ``query_pre_attn_scalar``: attention scores are scaled by query_pre_attn_scalar**-0.5 instead of
      head_dim**-0.5 (None, or equal to head_dim: the usual scale).
    """

    dim: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 384
    vocab_size: int = 257
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: str | None = None
    rope_params: tuple = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    family: str | None = None
    n_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_dim: int = 0
    moe_norm_topk: bool = True
    shared_expert_ffn_dim: int = 0
    moe_layer_step: int = 1
    dense_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    head_dim: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None

    def __post_init__(self):
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        self._check_head_dim()
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        self._check_rope_scaling()
        self._check_layer_types()
        self._check_variants()
        self._check_moe()
        self._check_family()

    def _check_head_dim(self):
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}, or set head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        object.__setattr__(self, "head_dim", int(self.head_dim))
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be positive and even (RoPE rotates pairs)")

    def _check_layer_types(self):
        types = tuple(self.layer_types)
        if types and len(types) != self.n_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(types)} entries for {self.n_layers} layers; give "
                             "one per layer or leave it empty (every layer full)")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"ModelConfig.layer_types has {bad[0]!r}; use {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
        # One spelling per model: all-full is (), a window no layer uses is None.
        sliding = SLIDING_ATTENTION in types
        object.__setattr__(self, "layer_types", types if sliding else ())
        if sliding and (self.sliding_window is None or int(self.sliding_window) < 1):
            raise ValueError(f"ModelConfig.sliding_window={self.sliding_window!r} must be a positive number of "
                             "tokens when a layer is 'sliding_attention'")
        object.__setattr__(self, "sliding_window", int(self.sliding_window) if sliding else None)
        if self.rope_local_theta is not None and not sliding:
            object.__setattr__(self, "rope_local_theta", None)  # no layer reads it
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(f"ModelConfig.rope_local_theta must be positive, got {self.rope_local_theta}")

    def _check_variants(self):
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ModelConfig.mlp_activation={self.mlp_activation!r}; use one of: "
                             f"{', '.join(MLP_ACTIVATIONS)}")
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"ModelConfig.norm_offset={self.norm_offset}; use 0 (Llama's RMSNorm: w) or 1 "
                             "(Gemma's: 1 + w)")
        object.__setattr__(self, "norm_offset", float(self.norm_offset))
        scalar = self.query_pre_attn_scalar
        if scalar is not None and not scalar > 0:
            raise ValueError(f"ModelConfig.query_pre_attn_scalar must be positive, got {scalar}")
        if scalar is not None and float(scalar) == self.head_dim:
            object.__setattr__(self, "query_pre_attn_scalar", None)  # the usual scale: one spelling

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Every layer's kind (``layer_kinds.LayerSpec``): what the mask, the exchange, the cache, the RoPE tables
        and the analysis models dispatch on."""
        return layer_specs(self)

    def layer_type(self, i: int) -> str:
        """Layer i's attention as Hugging Face names it: "full_attention" or "sliding_attention"."""
        return self.layer_specs[i].attention.name

    def window(self, i: int) -> int | None:
        """The window of layer i's attention (None: the whole causal context)."""
        return self.layer_specs[i].attention.window

    @property
    def sliding(self) -> bool:
        """Whether any layer attends within a window (a model feature a scheme must implement)."""
        return bool(self.layer_types)

    @property
    def norms_per_layer(self) -> int:
        """RMSNorm weights of one layer (h each): before attention and the MLP, and after each too (sandwich)."""
        return 4 if self.sandwich_norm else 2

    @property
    def gemma_norms(self) -> bool:
        """Whether the norms are Gemma's: (1 + w) and sandwiched (a model feature a scheme must implement)."""
        return bool(self.norm_offset or self.sandwich_norm)

    @property
    def geglu(self) -> bool:
        return self.mlp_activation != "silu"

    @property
    def attention_scale(self) -> float:
        """The factor of q·k in attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def query_scale(self) -> float | None:
        """What queries are multiplied by so that the kernels' usual head_dim**-0.5 gives ``attention_scale``
        (None: 1, nothing to do). Folded into the queries once, so no kernel takes a scale argument."""
        return None if self.query_pre_attn_scalar is None else (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    def stage(self, layers: range) -> ModelConfig:
        """The config of a run of this model's layers (a pipeline stage): its layer types go with it."""
        types = self.layer_types[layers.start:layers.stop] if self.layer_types else ()
        return self.replace(n_layers=len(layers), layer_types=types)

    def _check_moe(self):
        # JSON (checkpoint metadata) turns the tuple into a list: one spelling, so configs compare equal.
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        if self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be >= 0 (0: a dense model), got {self.n_experts}")
        if self.n_experts and self.geglu:
            raise ValueError("ModelConfig.mlp_activation='gelu_tanh' is for dense models: experts are SwiGLU; set "
                             "mlp_activation='silu' or n_experts=0")
        if self.n_experts == 0:
            moe_fields = ("moe_top_k", "moe_ffn_dim", "shared_expert_ffn_dim", "dense_layers", "router_aux_loss_coef")
            set_fields = [name for name in moe_fields if getattr(self, name)]
            if set_fields:
                raise ValueError(f"ModelConfig.{set_fields[0]} is a mixture-of-experts setting but n_experts=0; "
                                 "set n_experts or leave it at its default")
            return
        if not 1 <= self.moe_top_k <= self.n_experts:
            raise ValueError(f"ModelConfig.moe_top_k={self.moe_top_k} must lie in [1, n_experts={self.n_experts}]")
        if self.moe_ffn_dim <= 0:
            raise ValueError(f"ModelConfig.moe_ffn_dim must be positive with experts, got {self.moe_ffn_dim}")
        if self.shared_expert_ffn_dim < 0 or self.moe_layer_step < 1 or self.router_aux_loss_coef < 0:
            raise ValueError("ModelConfig.shared_expert_ffn_dim and router_aux_loss_coef must be >= 0 and "
                             f"moe_layer_step >= 1, got {self.shared_expert_ffn_dim}, {self.router_aux_loss_coef} "
                             f"and {self.moe_layer_step}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"ModelConfig.dense_layers has {bad[0]}, not a layer of a {self.n_layers}-layer model")

    @property
    def moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_moe_layer(i) for i in range(self.n_layers))

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is the mixture of experts (else the dense MLP of width ffn_dim)."""
        return self.n_experts > 0 and i not in self.dense_layers and (i + 1) % self.moe_layer_step == 0

    def _check_rope_scaling(self):
        params = self.rope_params.items() if isinstance(self.rope_params, dict) else self.rope_params
        try:
            object.__setattr__(self, "rope_params", check_params(self.rope_scaling, tuple(params), self.max_seq_len,
                                                                 self.head_dim))
        except ValueError as e:
            raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r}: {e}") from None

    @property
    def rope(self) -> RopeSpec:
        """The RoPE table of the full-attention layers: base ``rope_theta``, with the scaling (sliding layers may
        have their own, ``layer_specs``)."""
        return RopeSpec(self.rope_theta, self.head_dim, self.rope_scaling, self.rope_params)

    @property
    def max_length(self) -> int | None:
        """The longest sequence the model takes (None: no bound): ``max_seq_len``, or what its RoPE scaling is built
        for (``rope.RopeSpec.max_length``: YaRN's factor x original context; dynamic NTK has no bound)."""
        return self.rope.max_length(self.max_seq_len)

    def check_length(self, n: int, what: str = "sequence length") -> None:
        """Refuse ``n`` tokens (``what``: the words before the number) past ``max_length``, in one line."""
        limit = self.max_length
        if limit is not None and n > limit:
            name = f"max_seq_len={limit}" if limit == self.max_seq_len else \
                f"{self.rope_scaling} RoPE's context of {limit} tokens"
            raise ValueError(f"{what} {n} exceeds the model's {name}")

    def rope_param(self, name: str):
        """The value of RoPE scaling parameter ``name`` (Hugging Face's name: "factor", ...)."""
        return dict(self.rope_params)[name]

    def _check_family(self):
        if self.family is None:
            return
        if self.family not in FAMILIES:
            raise ValueError(
                f"ModelConfig.family={self.family!r} is unknown; use None or one of: {', '.join(FAMILIES)}"
            )
        if self.family == self._inferred_family():
            # One spelling per model, so that configs compare equal however they were made.
            object.__setattr__(self, "family", None)
            return
        # What each Hugging Face architecture can express: an export must not drop or invent a feature.
        if self.family in MOE_FAMILIES or self.n_experts:
            self._check_moe_family()
            return
        gemma = self.gemma_norms or self.geglu or self.embed_scale
        if (self.family == "gemma3_text") != gemma:
            raise ValueError(f"ModelConfig.family={self.family!r} {'needs' if not gemma else 'cannot express'} "
                             "Gemma's norms (norm_offset=1, sandwich_norm), GeGLU and embed_scale; fix them or set "
                             "family=None")
        if self.family == "gemma3_text":
            return
        wants_bias, wants_norm = self.family == "qwen2", self.family == "qwen3"
        if self.qkv_bias != wants_bias or self.qk_norm != wants_norm:
            raise ValueError(
                f"ModelConfig.family={self.family!r} needs qkv_bias={wants_bias} and qk_norm={wants_norm}, got "
                f"qkv_bias={self.qkv_bias} and qk_norm={self.qk_norm}; fix them or set family=None"
            )

    def _inferred_family(self) -> str:
        if self.n_experts:
            return "qwen2_moe"
        if self.gemma_norms or self.geglu or self.embed_scale:
            return "gemma3_text"
        return "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"

    def _check_moe_family(self):
        if self.family not in MOE_FAMILIES or not self.n_experts:
            wanted = "> 0" if self.family in MOE_FAMILIES else "= 0"
            raise ValueError(f"ModelConfig.family={self.family!r} needs n_experts {wanted}; fix n_experts or set "
                             "family=None")
        if self.family == "mixtral":
            problems = [name for name, bad in (("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                                               ("shared_expert_ffn_dim", self.shared_expert_ffn_dim),
                                               ("moe_norm_topk", not self.moe_norm_topk),
                                               ("dense_layers", self.dense_layers or self.moe_layer_step != 1),
                                               ("moe_ffn_dim", self.moe_ffn_dim != self.ffn_dim)) if bad]
            if problems:
                raise ValueError(f"ModelConfig.family='mixtral' cannot express {problems[0]} (Mixtral: every layer "
                                 "sparse, experts of width ffn_dim, no shared expert, renormalised top-k, no q/k/v "
                                 "bias or q/k norm); fix it or set family=None")

    @property
    def hf_model_type(self) -> str:
        """The Hugging Face model_type an export writes: ``family``, or the one the features imply."""
        return self.family or self._inferred_family()

    @property
    def group_size(self) -> int:
        """g = query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        # A head_dim derived from dim / n_heads follows them; one set on its own stays.
        derived = self.head_dim == self.dim // self.n_heads
        if {"dim", "n_heads"} & set(changes) and "head_dim" not in changes and derived:
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON values (tuples as lists), equal to what a JSON round trip gives back."""
        values = dataclasses.asdict(self)
        values["dense_layers"] = list(self.dense_layers)
        values["layer_types"] = list(self.layer_types)
        values["rope_params"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_params}
        return values

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        values = dict(values)
        legacy = {new: values.pop(old) for old, new in _LEGACY_ROPE_FIELDS.items() if values.get(old) is not None}
        for old in _LEGACY_ROPE_FIELDS:
            values.pop(old, None)
        if legacy:
            values["rope_params"] = {**legacy, **dict(values.get("rope_params") or {})}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return cls(**values)


# Llama 3.1 / 3.2's RoPE scaling, except the factor, which differs between sizes.
def _llama3_rope(factor: float) -> dict:
    return dict(rope_scaling="llama3", rope_params=(("factor", factor), ("high_freq_factor", 4.0),
                                                    ("low_freq_factor", 1.0),
                                                    ("original_max_position_embeddings", 8192)))


# Qwen3's YaRN as its model cards say to switch it on for 128K: factor 4 over the 32K it was trained at.
_QWEN3_YARN = dict(rope_scaling="yarn", rope_params=(("factor", 4.0), ("original_max_position_embeddings", 32768)))

# Phi-3.5-mini's LongRoPE factors, one per rotated pair of its 96-wide heads (its config.json's rope_scaling, as
# public copies of it give them: the Hub was not reachable when this was written).
_PHI35_SHORT = (1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, *(1.0499999523162842,) * 5,
                1.0699999332427979, 1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094,
                1.1699998378753662, 1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378,
                1.8199998140335083, 1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
                1.9899996519088745, *(2.0199997425079346,) * 6, *(2.0299997329711914,) * 9, 2.0799996852874756,
                2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
                2.749999523162842, 2.8399994373321533)
_PHI35_LONG = (1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
               1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
               4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
               17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
               32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
               50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
               62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
               63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
               64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
               64.51000213623047, 64.52999877929688, 64.83999633789062)


def layer_pattern(n_layers: int, every: int) -> tuple[str, ...]:
    """Gemma 3's layer types: every ``every``-th layer full, the others sliding (its sliding_window_pattern)."""
    return tuple(FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION for i in range(n_layers))


# Gemma 3's variants of the layer core, the same in every size.
_GEMMA3 = dict(norm_offset=1.0, sandwich_norm=True, mlp_activation="gelu_tanh", embed_scale=True, qk_norm=True,
               tie_embeddings=True, norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
               family="gemma3_text")

PRESETS: dict[str, ModelConfig] = {
    # Trains in seconds on a CPU; GQA (g=2) and every head count divisible by 1, 2 and 4.
    "tiny": ModelConfig(),
    # The tiny model with 4 experts (top-2) and a shared expert in every layer: tests and the MoE demo.
    "tiny-moe": ModelConfig(n_experts=4, moe_top_k=2, moe_ffn_dim=192, shared_expert_ffn_dim=128,
                            router_aux_loss_coef=0.01),
    # The tiny model with one KV head (MQA): at D = 2 TP keeps a copy of it on both ranks, TSP half of its tokens on
    # each, so the same cache budget holds twice the tokens under TSP (bench --mode serve's capacity figure).
    "tiny-mqa": ModelConfig(n_kv_heads=1),
    # Toy hybrid models (tests and demos): a sliding and a full layer each, heads wider than dim / n_heads.
    # Gemma 3's layer core: (1 + w) and sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar 24.
    "tiny-gemma3": ModelConfig(head_dim=32, layer_types=layer_pattern(2, 2), sliding_window=64,
                               query_pre_attn_scalar=24, **_GEMMA3),
    # Qwen3 with a window in its upper layer (use_sliding_window, max_window_layers 1) and head_dim 32.
    "tiny-qwen3-window": ModelConfig(head_dim=32, qk_norm=True, norm_eps=1e-6, sliding_window=64,
                                     layer_types=(FULL_ATTENTION, SLIDING_ATTENTION)),
    # Mistral v0.1's every-layer window.
    "tiny-mistral-window": ModelConfig(layer_types=(SLIDING_ATTENTION,) * 2, sliding_window=64, family="mistral"),
    # One toy per long-context RoPE type: YaRN x4 over 256 tokens (sequences up to 1024); Phi-3 with LongRoPE (its
    # long factors from 257 tokens on); dynamic NTK x2 from 1024 tokens (no length bound).
    "tiny-yarn": ModelConfig(rope_scaling="yarn", rope_params=(("factor", 4.0),
                                                               ("original_max_position_embeddings", 256))),
    "tiny-longrope": ModelConfig(family="phi3", rope_scaling="longrope",
                                 rope_params=(("short_factor", tuple(1.0 + 0.05 * i for i in range(8))),
                                              ("long_factor", tuple(1.0 + 1.5 * i for i in range(8))),
                                              ("original_max_position_embeddings", 256))),
    "tiny-dynamic": ModelConfig(rope_scaling="dynamic", rope_params=(("factor", 2.0),)),
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1536, max_seq_len=4096),
    # The paper's 7B reference: h=4096, 32 layers, 32 query and 32 KV heads, ffn = 4h.
    "paper-7b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=16384, vocab_size=32000, max_seq_len=131072
    ),
    # Llama-3-8B shape (GQA g=4, 128K vocabulary), for planning.
    "llama3-8b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
    ),
    # The shapes of public checkpoints (their config.json), to try scale with random weights, nothing downloaded.
    # Llama 3.2 1B: tied embeddings, llama3 RoPE scaling by 32 from an 8K pretraining context.
    "llama3.2-1b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=True,
        **_llama3_rope(32.0),
    ),
    # Llama 3.1 8B: llama3 RoPE scaling by 8.
    "llama3.1-8b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        **_llama3_rope(8.0),
    ),
    # Qwen2.5 7B: q/k/v bias, 28 query and 4 KV heads (g=7), head_dim 128.
    "qwen2.5-7b": ModelConfig(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=152064,
        max_seq_len=131072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
    ),
    # Qwen3 8B: per-head q/k RMSNorm, head_dim 128 = 4096/32.
    "qwen3-8b": ModelConfig(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=12288,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
    ),
    # Qwen3 8B with YaRN switched on as Qwen's card says (config.json keeps max_position_embeddings 40960):
    # sequences up to 4 x 32768 = 131072 tokens.
    "qwen3-8b-yarn-128k": ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
                                      vocab_size=151936, max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6,
                                      qk_norm=True, **_QWEN3_YARN),
    # Phi-3.5-mini (3.8B): LongRoPE from 4K to 128K, 32 heads of 96, fused q/k/v and gate/up in its checkpoints.
    "phi-3.5-mini": ModelConfig(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=8192, vocab_size=32064,
                                max_seq_len=131072, family="phi3", rope_scaling="longrope",
                                rope_params=(("short_factor", _PHI35_SHORT), ("long_factor", _PHI35_LONG),
                                             ("original_max_position_embeddings", 4096))),
    # Qwen3 4B: 32 heads of 128 (wider than dim / n_heads = 80), tied embeddings.
    "qwen3-4b": ModelConfig(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728,
                            vocab_size=151936, max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                            tie_embeddings=True),
    # Mistral 7B v0.1: a 4096-token window in every layer.
    "mistral-7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                              max_seq_len=32768, layer_types=(SLIDING_ATTENTION,) * 32, sliding_window=4096,
                              family="mistral"),
    # Gemma 3 (text): 5 local layers (window 512 / 1024, RoPE base 1e4) to 1 global (base 1e6, linear scaling by
    # 8 on 4B and 27B); 27B's heads are narrower than dim / n_heads and its attention scale 168**-0.5.
    "gemma3-1b": ModelConfig(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                             vocab_size=262144, max_seq_len=32768,
                             layer_types=layer_pattern(26, 6), sliding_window=512,
                             **_GEMMA3),
    "gemma3-4b": ModelConfig(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=10240,
                             vocab_size=262208, max_seq_len=131072,
                             layer_types=layer_pattern(34, 6), sliding_window=1024,
                             rope_scaling="linear", rope_params=(("factor", 8.0),), **_GEMMA3),
    "gemma3-27b": ModelConfig(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=21504,
                              vocab_size=262208, max_seq_len=131072,
                              layer_types=layer_pattern(62, 6), sliding_window=1024,
                              rope_scaling="linear", rope_params=(("factor", 8.0),), query_pre_attn_scalar=168,
                              **_GEMMA3),
    # Mixtral 8x7B: 8 experts of width 14336 in every layer, top-2, GQA g=4.
    "mixtral-8x7b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1000000.0,
        n_experts=8,
        moe_top_k=2,
        moe_ffn_dim=14336,
        router_aux_loss_coef=0.02,
        family="mixtral",
    ),
    # Qwen2 57B-A14B (Qwen2-MoE): 64 experts of width 2560, top-8, a shared expert of width 20480, q/k/v bias.
    "qwen2-57b-a14b": ModelConfig(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=151936,
        max_seq_len=131072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        n_experts=64,
        moe_top_k=8,
        moe_ffn_dim=2560,
        shared_expert_ffn_dim=20480,
        moe_norm_topk=False,
        router_aux_loss_coef=0.001,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
