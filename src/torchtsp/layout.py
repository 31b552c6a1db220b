"""A parallel layout, resolved once: scheme, mesh degrees, pipeline, options, checked against model and batch.

``Layout.resolve`` turns what a user asked for (flags, a TOML file, keyword arguments) into a frozen
description of the run, or raises the one-line ValueError that says what to change, before any rank
communicates. ``init_mesh(layout)`` builds its mesh and ``parallelize(model, mesh, layout)`` its model;
the constructors of the schemes then only assert. The registry (``torchtsp.schemes``) holds the rules; this
module applies them, once, in one place.

Imports no torch, so the command line validates before it pays for importing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .recompute import recompute_policy
from .schemes import AXES, PIPELINE_AXIS, Scheme, check_microbatch_split, check_pipeline, get_scheme

OPTIONS = ("recompute", "sequence_parallel")


def check_positive_int(name: str, value) -> None:
    """The one check of an integer setting (a degree, a count): a bool is not an integer here."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """Where every part of a run lives. ``degrees``: (axis, size) for each of ``schemes.AXES``; ``pp`` pipeline
    stages (each a ``degrees`` mesh); ``microbatches`` per replica and step (the pipeline's; 1 without);
    ``options``: (name, value) of the scheme options given (``recompute``: a ``recompute.POLICIES`` name;
    ``sequence_parallel``: a bool)."""

    scheme: str
    degrees: tuple[tuple[str, int], ...]
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    options: tuple[tuple[str, bool | str], ...] = ()

    @classmethod
    def resolve(cls, scheme: str = "tsp", world: int | None = None, *, dp: int | None = None,
                tsp: int | None = None, tp: int | None = None, sp: int | None = None, pp: int = 1,
                microbatches: int | None = None, schedule: str = "1f1b", recompute: str | bool | None = None,
                sequence_parallel: bool | None = None, cfg=None, batch: int | None = None,
                seq_len: int | None = None) -> Layout:
        """The layout of ``scheme`` on ``world`` ranks (None: the product of the degrees given) from the degrees
        given (None: not given; the scheme's free axis takes the ranks left over). With ``cfg``, the model must
        split over it (heads, KV heads, FFN, experts, layers into stages); with ``batch`` and ``seq_len``, the
        batch too (rows over dp and microbatches, zigzag chunks). Raises ValueError with what to change."""
        spec = get_scheme(scheme)
        check_positive_int("--pp", pp)
        if world is None:
            given = [v for v in (dp, tsp, tp, sp) if v is not None]
            for axis, value in zip(("dp", "tsp", "tp", "sp"), (dp, tsp, tp, sp)):
                if value is not None:
                    check_positive_int(f"--{axis}", value)
            world = pp * math.prod(given)
        check_positive_int("the number of ranks", world)
        if world % pp:
            raise ValueError(f"--pp {pp} needs a multiple of {pp} ranks, but the world has {world}")
        degrees = spec.degrees(world // pp, dp=dp, tsp=tsp, tp=tp, sp=sp)
        options = {name: convert(value) for name, value, convert in (
            ("recompute", recompute, recompute_policy), ("sequence_parallel", sequence_parallel, bool))
                   if value is not None}
        unsupported = sorted(set(options) - set(spec.options))
        if unsupported:
            raise ValueError(f"scheme {scheme!r} does not support {', '.join(unsupported)}; "
                             f"its options are: {', '.join(spec.options) or 'none'}")
        if cfg is None and pp > 1:  # the checks that need the model (layers into stages) wait until it is known
            stages = pp if microbatches is None else microbatches
            check_positive_int("--microbatches", stages)
        else:
            stages = check_pipeline(spec, cfg, pp, microbatches, batch, degrees, schedule)
        layout = cls(scheme, tuple((a, degrees[a]) for a in AXES), pp, stages if pp > 1 else 1, schedule,
                     tuple(sorted(options.items())))
        if cfg is not None:
            layout.check_model(cfg)
        if batch is not None and seq_len is not None:
            layout.check_batch(batch, seq_len)
        return layout

    @classmethod
    def of_degrees(cls, scheme: str, cfg=None, batch: int | None = None, seq_len: int | None = None, *,
                   dp: int = 1, tsp: int = 1, tp: int = 1, sp: int = 1, sequence_parallel: bool = False,
                   pp: int = 1, microbatches: int | None = None, schedule: str = "1f1b") -> Layout:
        """``resolve`` with every degree given, as the analysis models and the planner take them (a degree of 1
        on an axis the scheme lacks is no request; ``sequence_parallel`` False is no request either)."""
        for axis, value in (("dp", dp), ("tsp", tsp), ("tp", tp), ("sp", sp)):
            check_positive_int(f"--{axis}", value)
        spec = get_scheme(scheme)
        given = {a: v for a, v in (("tsp", tsp), ("tp", tp), ("sp", sp)) if a in spec.axes or v != 1}
        return cls.resolve(scheme, pp * dp * tsp * tp * sp, dp=dp, **given, pp=pp, microbatches=microbatches,
                           schedule=schedule, sequence_parallel=sequence_parallel or None, cfg=cfg, batch=batch,
                           seq_len=seq_len)

    @classmethod
    def of_mesh(cls, scheme: str, sizes: dict[str, int], cfg=None, **options) -> Layout:
        """The layout an existing mesh (axis name -> size, ``pp`` included) gives ``scheme``: refuses a mesh that
        lacks one of its axes or has another axis of size > 1 the scheme would ignore. ``options``: those of
        ``resolve`` (recompute, sequence_parallel, microbatches, schedule)."""
        spec = get_scheme(scheme)
        spec.check_mesh(sizes)
        given = {a: sizes.get(a, 1) for a in AXES if a in spec.axes or a == "dp"}
        return cls.resolve(scheme, math.prod(sizes.values()), pp=sizes.get(PIPELINE_AXIS, 1), cfg=cfg,
                           **given, **options)

    # -- views --------------------------------------------------------------------------

    @property
    def spec(self) -> Scheme:
        return get_scheme(self.scheme)

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> degree of one stage's mesh (every axis of ``schemes.AXES``)."""
        return dict(self.degrees)

    @property
    def world(self) -> int:
        return self.pp * math.prod(self.sizes.values())

    @property
    def option_values(self) -> dict[str, bool]:
        return dict(self.options)

    @property
    def sequence_parallel(self) -> bool:
        return self.option_values.get("sequence_parallel", False)

    @property
    def label(self) -> str:
        """Display name, e.g. ``DP2xTSP4``, ``TP4+seqpar``, ``TP2xSP2`` (tables, plots)."""
        return self.spec.label_for(self.sizes, self.sequence_parallel)

    @property
    def mesh_label(self) -> str:
        """The mesh's axes of size > 1, e.g. ``dp=2 x tsp=4`` (``1 rank`` for none)."""
        return " x ".join(f"{a}={n}" for a, n in self.mesh_degrees().items() if n > 1) or "1 rank"

    def degree_flags(self) -> dict:
        """Keyword arguments of the analysis models (``predict_memory``, ``predict_comm``) for this layout."""
        return {**self.sizes, "sequence_parallel": self.sequence_parallel}

    def mesh_degrees(self) -> dict[str, int]:
        """Keyword arguments of ``init_mesh`` for this layout."""
        return {**self.sizes, **({PIPELINE_AXIS: self.pp} if self.pp > 1 else {})}

    # -- checks -------------------------------------------------------------------------

    def check_model(self, cfg) -> None:
        """Refuse a model whose heads, KV heads, FFN width or experts do not split over this layout."""
        self.spec.check_model(cfg, self.sizes)
        if self.sequence_parallel and getattr(cfg, "moe", False):
            raise ValueError("mixture-of-experts models run under tp without Megatron-SP; drop sequence_parallel")

    def check_batch(self, batch: int, seq_len: int) -> None:
        """Refuse a global batch [batch, seq_len] this layout cannot split (host-side shapes only)."""
        self.spec.check_batch(batch, seq_len, self.sizes, self.sequence_parallel)
        if self.pp > 1:
            check_microbatch_split(batch, self.sizes["dp"], self.microbatches)
