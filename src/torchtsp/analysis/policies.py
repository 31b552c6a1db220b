"""The recompute policies as ``plan`` reports them: each policy's activations and peak per GPU, the paper's
measured figure beside where it measured the layout. Pure arithmetic, no torch."""

from __future__ import annotations

from ..recompute import FULL, NONE, POLICIES, SELECTIVE
from ..schemes import get_scheme

GB = 1e9

# The paper's measured peak memory per GPU (GB): one 8-GPU node, 7B model, batch 1, full recompute
# (plan.PAPER_ASSUMPTIONS; docs/design.md, "Where we differ from the paper").
PAPER_FIGURES = (
    # (layout label, scheme, degrees, sequence length, paper GB)
    ("TSP8", "tsp", {"tsp": 8}, 131072, 38.8),
    ("TP8", "tp", {"tp": 8}, 131072, 70.0),
    ("TP4xSP2", "tp_sp", {"tp": 4, "sp": 2}, 131072, 85.0),
    ("TP2xSP4", "tp_sp", {"tp": 2, "sp": 4}, 131072, 140.0),
    ("TSP8", "tsp", {"tsp": 8}, 16384, 31.0),
    ("TP8", "tp", {"tp": 8}, 16384, 31.5),
)

POLICY_WORDS = {NONE: "as torchtsp's modules save them (no recompute)",
                FULL: "full recompute (each layer's input saved)",
                SELECTIVE: "selective recompute (the MLP's elementwise hidden state recomputed; TSP: its MLP's input "
                           "saved, gate and up projected again in backward's ring)"}


def policy_label(args) -> str:
    return "" if args.recompute == NONE else f", recompute {args.recompute}"


def by_policy(memory) -> dict[str, dict]:
    """Activation and peak bytes per GPU under each recompute policy: ``memory(policy)`` is the prediction
    (a ``MemoryBreakdown``, or anything with ``activations`` and ``total``)."""
    return {p: {"activations_bytes": m.activations, "peak_bytes": m.total} for p, m in
            ((p, memory(p)) for p in POLICIES)}


def paper_figure(preset: str, scheme: str, degrees: dict, seq_len: int, rows_per_replica: int) -> float | None:
    """The paper's measured GB for this layout, where it measured it (paper-7b, one sequence per replica)."""
    if preset != "paper-7b" or rows_per_replica != 1 or degrees.get("sequence_parallel"):
        return None
    axes = get_scheme(scheme).axes  # the model axes it parallelises over: dp and the options are not the layout's
    degrees = {a: n for a, n in degrees.items() if a in axes and n > 1}
    return next((gb for _, s, d, S, gb in PAPER_FIGURES if (s, d, S) == (scheme, degrees, seq_len)), None)


def print_policies(figures: dict[str, dict], what: str, paper_gb: float | None) -> None:
    """``by_policy``'s figures as plan prints them, the paper's figure beside where there is one."""
    paper = f"; the paper measured {paper_gb:g} GB (with full recompute)" if paper_gb is not None else ""
    print(f"recompute policies, {what} (per GPU{paper}):")
    for policy, f in figures.items():
        fits = ("" if paper_gb is None else
                f"  {'<=' if f['peak_bytes'] <= paper_gb * GB else '> '} the paper's {paper_gb:g} GB")
        print(f"  {policy:<9} activations {f['activations_bytes'] / GB:6.1f} GB, peak {f['peak_bytes'] / GB:6.1f} GB"
              + fits)
