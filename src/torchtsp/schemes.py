"""The scheme registry: everything torchtsp knows about each parallel scheme, in one object per scheme.

Every part of torchtsp that depends on the scheme (``parallelize``, ``generate``, the trainer, ``serve``,
``bench``, ``plan``, the memory, traffic and step-time models, the command line's choices) reads it from its
``Scheme`` entry here: the mesh axes a scheme uses, how its degrees come from flags or the world size, which
layouts it can split (``validate``, raised before any rank communicates), and where its code lives (its model
class, inference engine, traffic formula, memory walk and step-cost model) as import paths resolved on first
use. Nothing else names a scheme: adding one means one file under ``parallel/`` and one entry below
(docs/design.md, "Adding a scheme").

Data parallelism is not a model axis of any scheme: it is applied over every scheme by
``parallel/dp.py`` on the ``dp`` mesh axis. The ``dp`` scheme is that wrapper over a model axis of
size 1 (the whole model on each rank).

This module imports no torch (the import paths are resolved only when used), so ``torchtsp --help`` and
``torchtsp plan`` start instantly.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

# Mesh axes, outermost first: data-parallel replicas, then the sequence axis of TP x SP, then TP, then TSP
# (innermost, so that one TSP group stays inside a node).
AXES = ("dp", "sp", "tp", "tsp")
# Pipeline stages wrap a scheme from outside, like data parallelism, on one more axis outside all of AXES
# (a mesh has it only when pp > 1). Only schemes with ``pipeline=True`` run as stages.
PIPELINE_AXIS = "pp"
# Schedules of torch.distributed.pipelining that ``--schedule`` names; interleaved runs several stages per rank.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# Model features (ModelConfig fields) beyond plain Llama that a scheme must implement to run the model.
# ``sliding``: layers with a window (one ``layers.Mask``, read by every kernel that takes it); the Gemma variants of
# the layer core: (1 + w) and sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar; GPT-OSS's sinks, output
# bias, router and expert biases and clamped SwiGLU.
MODEL_FEATURES = ("rope_scaling", "qkv_bias", "qk_norm", "moe", "sliding", "gemma_norms", "geglu", "embed_scale",
                  "query_pre_attn_scalar", "attention_sinks", "o_bias", "router_bias", "expert_bias", "swiglu_limit")
_GEMMA = ("gemma_norms", "geglu", "embed_scale", "query_pre_attn_scalar")


def _prod(values) -> int:
    return math.prod(values)


def resolve(path: str):
    """The object an import path ``"package.module:attribute"`` names, imported now (on first use)."""
    module, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"the registry's import path {path!r} does not load ({e}); fix the scheme's entry "
                         f"in torchtsp.schemes") from e


@dataclass(frozen=True)
class Scheme:
    """One parallel scheme.

    ``axes``: the model axes it parallelises over (``dp`` is applied over any scheme from outside).
    ``weight_axes``: axes whose ranks each hold 1/degree of every weight matrix and vocabulary row.
    ``token_axes``: axes whose ranks each hold 1/degree of every sequence (zigzag layout).
    ``free_axis``: the axis that takes the ranks the flags leave over (``None``: a square T x Σ split).
    ``options``: keyword options ``parallelize`` accepts besides ``timeout_s``.
    ``features``: the ``MODEL_FEATURES`` it implements; a model with another is refused, never run without it.
    ``kv_replication``: fewer KV heads than the weight degree are held as copies by groups of consecutive ranks
    (the degree must then be a multiple of n_kv_heads).
    ``pipeline``: whether it runs as the stages of a pipeline (``parallel/pipeline.py``, the ``pp`` axis).
    ``weight_schedules``: TSP's two inference schedules (weights move / activations move), chosen per phase by
    ``infer_schedule``. ``zero``: its parameters can be sharded over dp by the distributed optimizer
    (``train/zero.py``; plain tensors, not DTensors). ``rows_over_dp``: its inference engine runs over the dp
    axis, each replica decoding its own rows of the batch (``serve``'s continuous batching does not run it yet).

    Where its code lives, as ``"module:attribute"`` import paths resolved on first use (``load``), so that
    reading the registry imports no torch:
    ``model``: its ``ParallelTransformer`` class (what ``parallelize`` builds).
    ``inference``: its inference engine class in ``torchtsp.infer`` (None: ``generate`` does not run it).
    ``kv_layouts``: (layout, the class of that layout's steps, of which the ``inference`` engine is composed)
    pairs when its decode cache layout is chosen (``kv_layouts.py``), in ``auto``'s order of preference;
    ``own_kv_layout``: the one layout of a scheme that lists none.
    ``traffic``: its per-step traffic formula (``analysis.comm_model``), ``memory_walk``: its memory model
    (``analysis.memory_model``); None for both: not modelled (its traffic is not counted by our comm layer).
    ``step_cost``: which of its step's communication the GEMMs hide (``analysis.hardware``; None: not priced).
    ``color``, ``marker``: how ``bench``'s plots draw it. ``bench_peer``: an outside implementation of the same
    layout that ``bench`` times interleaved beside it (its step-time ratio to it). ``decode_baseline``: the scheme
    whose time per output token ``bench --infer`` reports it against, run by run.
    """

    name: str
    label: str
    description: str
    axes: tuple[str, ...]
    model: str
    weight_axes: tuple[str, ...] = ()
    token_axes: tuple[str, ...] = ()
    free_axis: str | None = None
    options: tuple[str, ...] = ()
    features: tuple[str, ...] = MODEL_FEATURES
    kv_replication: bool = False
    pipeline: bool = False
    weight_schedules: bool = False
    zero: bool = True
    rows_over_dp: bool = False
    inference: str | None = None
    kv_layouts: tuple[tuple[str, str], ...] = ()
    own_kv_layout: str = "heads"
    traffic: str | None = None
    memory_walk: str | None = None
    step_cost: str | None = None
    color: str = "#000000"
    marker: str = "o"
    bench_peer: str | None = None
    decode_baseline: str | None = None

    def load(self, part: str):
        """The object the import path in field ``part`` names (``model``, ``inference``, ``traffic``,
        ``memory_walk``, ``step_cost``), imported now. ValueError when the scheme has none."""
        path = getattr(self, part)
        if path is None:
            raise ValueError(f"scheme {self.name!r} has no {part.replace('_', ' ')} (its registry entry names none)")
        return resolve(path)

    # -- degrees --------------------------------------------------------------------------

    def degrees(self, world: int, dp: int | None = None, tsp: int | None = None, tp: int | None = None,
                sp: int | None = None) -> dict[str, int]:
        """Degree of every mesh axis on ``world`` ranks from the flags given (``None``: not given).

        Axes the scheme does not use must be 1; the scheme's unset axis takes the ranks the others leave
        (TP x SP with neither given: the most square T x Σ, T >= Σ). Raises ValueError with what to change.
        """
        given = {"dp": dp, "tsp": tsp, "tp": tp, "sp": sp}
        for axis, value in given.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"--{axis} must be a positive integer, got {value!r}")
        ignored = [f"--{axis} {value}" for axis, value in given.items()
                   if value not in (None, 1) and axis != "dp" and axis not in self.axes]
        if ignored:
            raise ValueError(f"scheme {self.name!r} does not use {', '.join(ignored)}: it parallelises over "
                             f"{self._axes_text()}; drop the flag or choose a scheme that uses that axis")
        degrees = {axis: given[axis] or 1 for axis in AXES}
        unset = [axis for axis in (*self.axes, "dp") if given[axis] is None]
        free = [self.free_axis] if self.free_axis in unset else [a for a in unset if a in self.axes]
        if free:
            rest = _prod(v for a, v in degrees.items() if a not in free)
            if world % rest:
                raise ValueError(f"{self._shown(degrees, free)} needs a multiple of {rest} ranks, but the world "
                                 f"has {world}; change the degrees or the number of ranks")
            left = world // rest
            if len(free) == 1:
                degrees[free[0]] = left
            else:  # TP x SP: the most square split, T >= Σ
                sp_degree = max(d for d in range(1, math.isqrt(left) + 1) if left % d == 0)
                degrees.update(tp=left // sp_degree, sp=sp_degree)
        if _prod(degrees.values()) != world:
            raise ValueError(f"mesh {self._shown(degrees)} needs {_prod(degrees.values())} ranks but the world has "
                             f"{world}; make the degrees multiply to {world}")
        return degrees

    def _axes_text(self) -> str:
        return ", ".join(self.axes) + " (and dp)" if self.axes else "dp only"

    @staticmethod
    def _shown(degrees: dict, free=()) -> str:
        return " x ".join(f"{a}={'?' if a in free else degrees[a]}" for a in AXES)

    def weight_degree(self, degrees: dict[str, int]) -> int:
        """Ranks that split each weight matrix (1: replicated)."""
        return _prod(degrees.get(a, 1) for a in self.weight_axes)

    def token_degree(self, degrees: dict[str, int]) -> int:
        """Ranks that split each sequence (1: every rank of a replica holds whole sequences)."""
        return _prod(degrees.get(a, 1) for a in self.token_axes)

    def label_for(self, degrees: dict[str, int], sequence_parallel: bool = False) -> str:
        """Display name of a layout, e.g. ``DP2xTSP4``, ``TP4+seqpar``, ``TP2xSP2``."""
        parts = [f"DP{degrees['dp']}"] if degrees.get("dp", 1) > 1 else []
        if self.axes:
            model = "x".join(f"{a.upper()}{degrees.get(a, 1)}" for a in self.axes)
            parts.append(model + ("+seqpar" if sequence_parallel else ""))
        return "x".join(parts) or "DP1"

    # -- legality -------------------------------------------------------------------------

    def check_mesh(self, sizes: dict[str, int]) -> None:
        """Refuse a mesh (axis name -> size) that lacks one of the scheme's axes or has another axis of size
        > 1 that the scheme would ignore (``dp`` is always allowed: data parallelism wraps any scheme)."""
        missing = [a for a in self.axes if a not in sizes]
        if missing:
            raise ValueError(f"scheme {self.name!r} needs a mesh with the axis {', '.join(missing)}, got axes "
                             f"{', '.join(sizes) or 'none'}; build it with torchtsp.init_mesh")
        if sizes.get(PIPELINE_AXIS, 1) > 1 and not self.pipeline:
            raise ValueError(f"scheme {self.name!r} does not run as pipeline stages (pp={sizes[PIPELINE_AXIS]}); "
                             f"use one of: {', '.join(SCHEMES.pipelined())}, or drop --pp")
        ignored = {a: n for a, n in sizes.items() if n > 1 and a not in ("dp", PIPELINE_AXIS) and a not in self.axes}
        if ignored:
            shown = ", ".join(f"{a}={n}" for a, n in ignored.items())
            raise ValueError(f"scheme {self.name!r} does not use the mesh axis {shown}: it parallelises over "
                             f"{self._axes_text()}; give those ranks to its axes or choose a scheme that uses them")

    def check_model(self, cfg, degrees: dict[str, int]) -> None:
        """Refuse a model whose heads, KV heads or FFN width do not split over the weight-sharding degree."""
        missing = [f for f in MODEL_FEATURES if getattr(cfg, f, None) and f not in self.features]
        if missing:
            able = [s.name for s in SCHEMES.values() if not set(missing) - set(s.features)]
            raise ValueError(f"scheme {self.name!r} does not implement the model's {', '.join(missing)} yet; "
                             f"use one of: {', '.join(able)}")
        ways = self.weight_degree(degrees)
        axes = " x ".join(f"{a}={degrees.get(a, 1)}" for a in self.weight_axes)
        for field in ("n_heads", "n_kv_heads", "ffn_dim"):
            if field == "n_kv_heads" and self.kv_replication and cfg.n_kv_heads < ways:
                if ways % cfg.n_kv_heads:
                    raise ValueError(f"{self.label} over {axes} needs n_kv_heads={cfg.n_kv_heads} divisible by {ways}, "
                                     f"or {ways} a multiple of it (each KV head is then copied on {ways}/n_kv_heads "
                                     f"ranks); choose such a degree")
                continue
            if getattr(cfg, field) % ways:
                able = ", ".join(s.name for s in SCHEMES.values() if s.kv_replication)
                hint = (f"; {self.name} cannot replicate KV heads, use one of {able} for n_kv_heads < {ways}"
                        if field == "n_kv_heads" and cfg.n_kv_heads < ways else "")
                raise ValueError(f"{self.label} over {axes} needs {field}={getattr(cfg, field)} divisible by {ways}; "
                                 f"choose a degree that divides it{hint}")
        if getattr(cfg, "moe", False) and ways > 1:
            # TSP places whole experts on its ranks; TP cuts every expert along its FFN width.
            split = "n_experts" if "tsp" in self.weight_axes else "moe_ffn_dim"
            for field in (split, "shared_expert_ffn_dim"):
                if getattr(cfg, field) % ways:
                    raise ValueError(f"{self.label} over {axes} needs {field}={getattr(cfg, field)} divisible by "
                                     f"{ways}; choose a degree that divides it")

    def check_batch(self, batch: int, seq_len: int, degrees: dict[str, int], sequence_parallel: bool = False) -> None:
        """Refuse a global batch the layout cannot split (rows over dp, zigzag chunks, Megatron-SP chunks)."""
        if batch < 1 or seq_len < 1:
            raise ValueError(f"batch and sequence length must be positive, got {batch} and {seq_len}")
        dp = degrees.get("dp", 1)
        if batch % dp:
            raise ValueError(f"batch size {batch} must be divisible by the DP degree {dp}")
        tokens = self.token_degree(degrees)
        if tokens > 1 and seq_len % (2 * tokens):
            raise ValueError(f"sequence length {seq_len} must be divisible by 2*D = {2 * tokens} for zigzag sharding "
                             f"over D={tokens} ranks; pick a length that is a multiple of {2 * tokens}")
        if sequence_parallel:
            if "sequence_parallel" not in self.options:
                raise ValueError(f"sequence_parallel (Megatron-SP) applies to tp and torch_tp, not {self.name}")
            T = degrees.get("tp", 1)
            if seq_len % T:
                raise ValueError(f"sequence length {seq_len} must be divisible by the TP degree T={T} with sequence "
                                 f"parallelism; pick a multiple of {T}")


class Registry(dict):
    """The registered schemes by name, in the order tables and plots show them."""

    def add(self, scheme: Scheme) -> Scheme:
        """Register ``scheme`` (a new name only)."""
        if scheme.name in self:
            raise ValueError(f"a scheme named {scheme.name!r} is already registered; choose another name")
        self[scheme.name] = scheme
        return scheme

    def with_inference(self) -> tuple[str, ...]:
        """The schemes ``generate`` runs (those that name an inference engine)."""
        return tuple(s.name for s in self.values() if s.inference)

    def servable(self) -> tuple[str, ...]:
        """The schemes ``serve`` runs: an inference engine whose batch is one, not rows split over replicas."""
        return tuple(s.name for s in self.values() if s.inference and not s.rows_over_dp)

    def pipelined(self) -> tuple[str, ...]:
        """The schemes that run as pipeline stages."""
        return tuple(s.name for s in self.values() if s.pipeline)


_COMM, _MEMORY, _HW = "torchtsp.analysis.comm_model", "torchtsp.analysis.memory_model", "torchtsp.analysis.hardware"
SCHEMES = Registry()
SCHEMES.add(Scheme(
    "tsp", "TSP", "this project: weights and tokens both 1/D on one axis",
    axes=("tsp",), weight_axes=("tsp",), token_axes=("tsp",), free_axis="tsp", options=("recompute",),
    kv_replication=True, pipeline=True, weight_schedules=True, model="torchtsp.parallel.tsp:TSPTransformer",
    inference="torchtsp.infer.tsp:TSPEngine", traffic=f"{_COMM}:tsp_step_traffic",
    kv_layouts=(("heads", "torchtsp.infer.tsp_heads:HeadsLayout"),
                ("grouped", "torchtsp.infer.tsp_grouped:GroupedLayout"),
                ("sequence", "torchtsp.infer.tsp:SequenceLayout")),
    memory_walk=f"{_MEMORY}:TSP_WALK", step_cost=f"{_HW}:overlapped_exposed_s", color="#d62728", marker="o",
    decode_baseline="tp"))
SCHEMES.add(Scheme(
    "tp", "TP", "Megatron tensor parallelism (optionally with Megatron-SP)",
    axes=("tp",), weight_axes=("tp",), free_axis="tp", options=("sequence_parallel", "recompute"),
    kv_replication=True, pipeline=True, model="torchtsp.parallel.tp:TPTransformer",
    inference="torchtsp.infer.tp:MegatronEngine",
    traffic=f"{_COMM}:tp_step_traffic", memory_walk=f"{_MEMORY}:REFERENCE_WALK", step_cost=f"{_HW}:tp_exposed_s",
    color="#1f77b4", marker="s", bench_peer="torch_tp"))
SCHEMES.add(Scheme(
    "sp", "SP", "sequence (context) parallelism: replicated weights, zigzag tokens, K/V all-gather",
    axes=("sp",), token_axes=("sp",), free_axis="sp", options=("recompute",), pipeline=True,
    model="torchtsp.parallel.sp:SPTransformer", inference="torchtsp.infer.sp:SPEngine", own_kv_layout="sequence",
    traffic=f"{_COMM}:sp_step_traffic", memory_walk=f"{_MEMORY}:REFERENCE_WALK", step_cost=f"{_HW}:serial_exposed_s",
    color="#2ca02c", marker="^"))
SCHEMES.add(Scheme(
    "tp_sp", "TPxSP", "the conventional 2D layout: TP inside, SP across",
    axes=("tp", "sp"), weight_axes=("tp",), token_axes=("sp",), free_axis=None, options=("recompute",),
    kv_replication=True, features=("rope_scaling", "qkv_bias", "qk_norm", "sliding", *_GEMMA),
    model="torchtsp.parallel.tp_sp:TPSPTransformer",
    traffic=f"{_COMM}:tp_step_traffic", memory_walk=f"{_MEMORY}:REFERENCE_WALK", step_cost=f"{_HW}:serial_exposed_s",
    color="#9467bd", marker="D"))
SCHEMES.add(Scheme(
    "dp", "DP", "data parallelism: the whole model on every rank, batch rows split",
    axes=(), free_axis="dp", options=("recompute",), rows_over_dp=True, model="torchtsp.parallel.dp:Replica",
    inference="torchtsp.infer.dp:DPEngine", traffic=f"{_COMM}:dp_step_traffic",
    memory_walk=f"{_MEMORY}:REFERENCE_WALK", color="#8c564b", marker="v"))
SCHEMES.add(Scheme(
    "torch_tp", "torch TP", "PyTorch's own DTensor tensor parallelism (an outside peer; not counted)",
    axes=("tp",), weight_axes=("tp",), free_axis="tp", options=("sequence_parallel", "recompute"),
    features=("sliding",), zero=False,
    model="torchtsp.parallel.torch_tp:TorchTPTransformer", color="#7f7f7f", marker="x"))


def stage_layer_ranges(n_layers: int, stages: int) -> list[range]:
    """The contiguous layer range of every stage (equal sizes: ``check_pipeline`` refuses the rest)."""
    per = n_layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def check_pipeline(scheme: Scheme, cfg, pp: int, microbatches: int | None, batch: int | None, degrees: dict[str, int],
                   schedule: str = "1f1b") -> int:
    """Refuse, before any communication, a pipeline the model, batch or schedule cannot run; return the
    number of microbatches (default: one per stage, so that ``--pp N`` alone works). ``batch`` None: not known
    yet (checked again when the batch arrives).

    The stages (``pp`` of them, ``pp x v`` for the interleaved schedule, v = 2 stages per rank) are
    contiguous, equal layer ranges; the embedding goes to the first, the final norm, head and loss to the last.
    """
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"--pp must be a positive integer, got {pp!r}")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of: {', '.join(PIPELINE_SCHEDULES)}")
    microbatches = pp if microbatches is None else microbatches
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"--microbatches must be a positive integer, got {microbatches!r}")
    if pp == 1:
        return microbatches
    if not scheme.pipeline:
        raise ValueError(f"scheme {scheme.name!r} does not run as pipeline stages; use one of: "
                         f"{', '.join(SCHEMES.pipelined())}, or drop --pp")
    stages = pp * stages_per_rank(schedule)
    if microbatches < pp:
        raise ValueError(f"--microbatches {microbatches} is fewer than the {pp} pipeline stages: a stage would idle "
                         f"for the whole step; use at least {pp}")
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        raise ValueError(f"the interleaved schedule runs rounds of --pp {pp} microbatches: --microbatches "
                         f"{microbatches} must be a multiple of {rounds}")
    if cfg.n_layers % stages:
        what = f"{pp} stages" if stages == pp else f"{stages} stages ({pp} ranks x {stages // pp} each)"
        fix = "a --pp that divides them" if stages == pp else "another schedule, or a --pp whose double divides them"
        raise ValueError(f"the model's {cfg.n_layers} layers do not divide into {what}; choose {fix}")
    if getattr(cfg, "moe", False) and getattr(cfg, "router_aux_loss_coef", 0):
        raise ValueError(f"a mixture-of-experts model with a load-balancing loss (router_aux_loss_coef="
                         f"{cfg.router_aux_loss_coef}) cannot be split into pipeline stages yet (the loss needs router "
                         "statistics of every layer at once); drop --pp, or set router_aux_loss_coef to 0")
    if getattr(cfg, "tie_embeddings", False):
        raise ValueError("a model with tied embeddings cannot be split into pipeline stages yet (the embedding "
                         "lives in the first stage, the head in the last); drop --pp or untie them")
    if batch is not None:
        check_microbatch_split(batch, degrees.get("dp", 1), microbatches)
    return microbatches


def check_microbatch_split(batch: int, dp: int, microbatches: int) -> None:
    """Refuse a batch that does not divide into ``microbatches`` microbatches on each of ``dp`` replicas."""
    rows = dp * microbatches
    if batch % rows:
        raise ValueError(f"batch size {batch} does not divide into {microbatches} microbatches on each of "
                         f"{dp} data-parallel replicas; choose a batch divisible by {rows}")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def inference_schemes() -> tuple[str, ...]:
    """The schemes ``generate`` runs (those that name an inference engine)."""
    return SCHEMES.with_inference()


INFERENCE_SCHEDULES = ("auto", "weights", "activations")


def infer_schedule(scheme: str, tokens_in_flight: int, crossover_tokens: int, schedule: str = "auto") -> str:
    """The schedule an inference phase runs with ``tokens_in_flight`` tokens per step: for a scheme with two
    (TSP), weights move when the tokens reach ``crossover_tokens`` (``sizes.tsp_tp_crossover_tokens``: the
    paper's B·S at which moving the weights costs no more traffic than moving activations), else activations
    move, unless ``schedule`` names one; the others have one schedule, named after the scheme. The one rule of
    ``generate`` and of the memory model."""
    if not get_scheme(scheme).weight_schedules:
        return scheme
    if schedule != "auto":
        return schedule
    return "weights" if tokens_in_flight >= crossover_tokens else "activations"


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; choose one of: {', '.join(SCHEMES)}") from None
