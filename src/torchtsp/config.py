"""Model configuration and named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION, LayerSpec, layer_specs
from .rope import RopeSpec, check_params

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "gemma3_text", "gpt_oss")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "gpt_oss")
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

    GPT-OSS's variants (all off by default):

    * ``attention_sinks``: every head has a learned sink, a logit in its softmax's denominator that takes no value
      (``layers.apply_sinks``: it enters once, after every partial attention is merged); ``o_bias``: the output
      projection has a bias too.
    * ``router_bias``: the router's logits have a bias; ``expert_bias``: each expert's gate, up and down
      projections have biases; ``swiglu_limit`` (with ``swiglu_alpha``): the experts' clamped SwiGLU,
      (up + 1) · gate · sigmoid(alpha · gate) with gate <= limit and |up| <= limit (``layers.ExpertKind``).

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
    attention_sinks: bool = False
    o_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None

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
        """The config of a run of this model's layers (a pipeline stage): its layer types and which of them are
        sparse go with it."""
        types = self.layer_types[layers.start:layers.stop] if self.layer_types else ()
        moe = {}
        if self.n_experts:
            dense = tuple(j for j, i in enumerate(layers) if not self.is_moe_layer(i))
            moe = dict(moe_layer_step=1, dense_layers=dense)
        return self.replace(n_layers=len(layers), layer_types=types, **moe)

    def _check_moe(self):
        # JSON (checkpoint metadata) turns the tuple into a list: one spelling, so configs compare equal.
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        if self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be >= 0 (0: a dense model), got {self.n_experts}")
        if self.n_experts and self.geglu:
            raise ValueError("ModelConfig.mlp_activation='gelu_tanh' is for dense models: experts are SwiGLU; set "
                             "mlp_activation='silu' or n_experts=0")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ValueError("ModelConfig.swiglu_limit and swiglu_alpha go together (GPT-OSS's clamped SwiGLU); set "
                             "both or neither")
        if self.swiglu_limit is not None and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise ValueError(f"ModelConfig.swiglu_limit={self.swiglu_limit} and swiglu_alpha={self.swiglu_alpha} "
                             "must be positive")
        if self.n_experts == 0:
            moe_fields = ("moe_top_k", "moe_ffn_dim", "shared_expert_ffn_dim", "dense_layers", "router_aux_loss_coef",
                          "router_bias", "expert_bias", "swiglu_limit")
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

    _GPT_OSS_FEATURES = ("attention_sinks", "o_bias", "router_bias", "expert_bias", "swiglu_limit")

    def _check_family(self):
        if (self.family or self._inferred_family()) == "gpt_oss":
            self._check_gpt_oss()
        elif any(getattr(self, name) for name in self._GPT_OSS_FEATURES):
            name = next(n for n in self._GPT_OSS_FEATURES if getattr(self, n))
            raise ValueError(f"ModelConfig.{name} is a GPT-OSS feature: only family='gpt_oss' exports it (and it "
                             "needs attention_sinks); fix it or set the family")
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
        if self.attention_sinks:
            return "gpt_oss"
        if self.n_experts:
            return "qwen2_moe"
        if self.gemma_norms or self.geglu or self.embed_scale:
            return "gemma3_text"
        return "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"

    def _check_gpt_oss(self):
        """What GPT-OSS's architecture expresses: all of its variants, every layer sparse, nothing else."""
        problems = [name for name, bad in (("attention_sinks", not self.attention_sinks),
                                           ("n_experts", not self.n_experts),
                                           ("qkv_bias", not self.qkv_bias), ("o_bias", not self.o_bias),
                                           ("router_bias", not self.router_bias), ("expert_bias", not self.expert_bias),
                                           ("swiglu_limit", self.swiglu_limit is None), ("qk_norm", self.qk_norm),
                                           ("shared_expert_ffn_dim", self.shared_expert_ffn_dim),
                                           ("moe_norm_topk", not self.moe_norm_topk),
                                           ("dense_layers", self.dense_layers or self.moe_layer_step != 1),
                                           ("moe_ffn_dim", self.moe_ffn_dim != self.ffn_dim),
                                           ("gemma features", self.gemma_norms or self.geglu or self.embed_scale))
                    if bad]
        if problems:
            raise ValueError(f"ModelConfig: family 'gpt_oss' cannot express {problems[0]} as set (GPT-OSS: sinks, "
                             "q/k/v/o biases, a biased router, biased experts with the clamped SwiGLU, every layer "
                             "sparse with experts of width ffn_dim, renormalised top-k, no shared expert); fix it")

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

