"""Which KV-cache layout a TSP engine decodes with (docs/design.md, "Decode cache layouts").

- ``heads`` (n_kv % D == 0): rank j caches every position of KV head group j, the group whose weights it holds;
  decode is TP's step on TSP's weight slices (two sums per layer).
- ``grouped`` (D % n_kv == 0): the c = D / n_kv ranks that share one KV head cache its tokens interleaved;
  queries gather and partial attentions merge inside those groups.
- ``sequence`` (any n_kv, D): every rank caches all heads of its own 1/D of the tokens.

``auto`` picks the first of heads, grouped, sequence that the model allows. Other schemes have one layout of
their own (tp: heads, copied when n_kv < D; sp and dp: sequence) and accept only ``auto`` or that one. The
single-device reference holds the whole cache, which every layout is at D = 1: it accepts any.
"""

from __future__ import annotations

KV_LAYOUTS = ("auto", "heads", "grouped", "sequence")

# The TSP engine of each layout (import paths, resolved on use like the scheme registry's).
TSP_ENGINES = {
    "heads": "torchtsp.infer.tsp_heads:TSPHeadsEngine",
    "sequence": "torchtsp.infer.tsp:TSPEngine",
}

# The one layout of each other scheme's engine.
OWN_LAYOUT = {"tp": "heads", "sp": "sequence", "dp": "sequence"}


def allowed_kv_layouts(n_kv: int, ranks: int) -> tuple[str, ...]:
    """The TSP layouts a model with ``n_kv`` KV heads allows on ``ranks`` ranks, in auto's order of preference."""
    allowed = []
    if n_kv % ranks == 0:
        allowed.append("heads")
    if ranks % n_kv == 0 and ranks > n_kv:
        allowed.append("grouped")
    allowed.append("sequence")
    return tuple(layout for layout in allowed if layout in TSP_ENGINES)


def resolve_kv_layout(requested: str, n_kv: int, ranks: int, scheme: str = "tsp") -> str:
    """The layout ``requested`` means for this model and scheme; ValueError (one line) for one it does not allow."""
    if requested not in KV_LAYOUTS:
        raise ValueError(f"unknown kv_layout {requested!r}; choose one of: {', '.join(KV_LAYOUTS)}")
    if scheme == "reference":
        return requested
    if scheme != "tsp":
        own = OWN_LAYOUT.get(scheme, "sequence")
        if requested not in ("auto", own):
            raise ValueError(f"kv_layout={requested!r} is a TSP layout; {scheme} caches by {own} "
                             f"(use kv_layout='auto' or '{own}')")
        return own
    allowed = allowed_kv_layouts(n_kv, ranks)
    if requested == "auto":
        return allowed[0]
    if requested not in allowed:
        rule = {"heads": f"n_kv % D == 0 ({n_kv} % {ranks} = {n_kv % ranks})",
                "grouped": f"D % n_kv == 0 with D > n_kv ({ranks} % {n_kv} = {ranks % n_kv})"}.get(requested, "")
        raise ValueError(f"kv_layout={requested!r} needs {rule}, but the model has n_kv={n_kv} KV heads on D={ranks} "
                         f"ranks; use one of: {', '.join(('auto', *allowed))}")
    return requested
