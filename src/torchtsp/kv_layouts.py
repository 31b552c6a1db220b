"""Which KV-cache layout an inference engine decodes with (docs/design.md, "Decode cache layouts"). Torch-free:
``plan`` and the CLI read it before any rank starts.

A scheme whose registry entry lists ``kv_layouts`` (TSP) chooses among them:

- ``heads`` (n_kv % D == 0): rank j caches every position of KV head group j, the group whose weights it holds;
  decode is TP's step on TSP's weight slices (two sums per layer).
- ``grouped`` (D % n_kv == 0, D > n_kv): the c = D / n_kv ranks that share one KV head cache its tokens
  interleaved; queries gather and partial attentions merge inside those groups.
- ``sequence`` (any n_kv, D): every rank caches all heads of its own 1/D of the tokens.

``auto`` picks the first of those the model allows, in that order. Every other scheme has one layout of its own
(``Scheme.own_kv_layout``: tp caches by heads, copied when n_kv < D; sp by sequence) and accepts only ``auto`` or
that one. The single-device reference holds the whole cache, which every layout is at D = 1: it accepts any.
"""

from __future__ import annotations

KV_LAYOUTS = ("auto", "heads", "grouped", "sequence")
# The --kv-layout flag's help (generate, serve, bench --mode infer, plan --mode infer).
KV_LAYOUT_HELP = ("tsp: how decode lays out the KV cache over the D ranks, for a model of n_kv KV heads: heads "
                  "(n_kv %% D == 0; each rank caches every token of its own KV heads and decodes as TP does), grouped "
                  "(D %% n_kv == 0, D > n_kv; the D/n_kv ranks sharing a KV head split its tokens), sequence (any; "
                  "each rank caches every head for 1/D of the tokens); auto picks heads, else grouped, else sequence "
                  "(default: auto)")
_RULES = {"heads": ("n_kv % D == 0", lambda n_kv, D: n_kv % D == 0),
          "grouped": ("D % n_kv == 0 with D > n_kv", lambda n_kv, D: D % n_kv == 0 and D > n_kv),
          "sequence": ("nothing", lambda n_kv, D: True)}


def _spec(scheme):
    from .schemes import get_scheme

    return get_scheme(scheme) if isinstance(scheme, str) else scheme


def has_kv_layouts(scheme) -> bool:
    """Whether ``scheme`` (a name or registry entry) chooses its decode cache layout (``kv_layout``)."""
    return bool(_spec(scheme).kv_layouts)


def allowed_kv_layouts(n_kv: int, ranks: int, scheme="tsp") -> tuple[str, ...]:
    """The layouts of ``scheme`` a model with ``n_kv`` KV heads allows on ``ranks`` ranks, in auto's order."""
    return tuple(name for name, _ in _spec(scheme).kv_layouts if _RULES[name][1](n_kv, ranks))


def resolve_kv_layout(requested: str, n_kv: int, ranks: int, scheme="tsp") -> str:
    """The layout ``requested`` means for this model and scheme (a name, a registry entry, or None for the
    single-device reference); ValueError (one line, naming n_kv and D) for one it does not allow."""
    if requested not in KV_LAYOUTS:
        raise ValueError(f"unknown kv_layout {requested!r}; choose one of: {', '.join(KV_LAYOUTS)}")
    if scheme is None:
        return "sequence" if requested == "auto" else requested
    spec = _spec(scheme)
    if not spec.kv_layouts:
        own = spec.own_kv_layout
        if requested not in ("auto", own):
            raise ValueError(f"kv_layout={requested!r} is a TSP layout; {spec.name} caches by {own} "
                             f"(use kv_layout='auto' or '{own}')")
        return own
    allowed = allowed_kv_layouts(n_kv, ranks, spec)
    if requested == "auto":
        return allowed[0]
    if requested not in allowed:
        raise ValueError(f"kv_layout={requested!r} needs {_RULES[requested][0]}, but the model has n_kv={n_kv} KV "
                         f"heads on D={ranks} ranks; use one of: {', '.join(('auto', *allowed))}")
    return requested


def layout_engine(scheme, layout: str) -> str:
    """The import path of ``scheme``'s inference engine for ``layout`` (a resolved one)."""
    spec = _spec(scheme)
    return dict(spec.kv_layouts).get(layout, spec.inference)
