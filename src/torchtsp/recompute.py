"""Activation recompute policies: what a decoder layer keeps for its backward.

``none``: every scheme saves what its autograd graph (or hand-written backward) needs. ``full``: each layer
keeps its input only and backward runs its forward again (``torch.utils.checkpoint``), collectives included.
``selective``: the MLP's elementwise hidden state is recomputed in backward from the saved GEMM outputs,
never from a re-run collective: every scheme saves the gate and up projections (matmul outputs), not the
activation, the product and the down projection's input; TSP, whose MLP already recomputes the elementwise
part, keeps its MLP input only and projects gate and up again as the weight shards pass in backward's ring
(the shards travel in backward anyway, so no byte moves twice). See docs/design.md, "Selective recompute".
"""

from __future__ import annotations

NONE, FULL, SELECTIVE = "none", "full", "selective"
POLICIES = (NONE, FULL, SELECTIVE)


def recompute_policy(value) -> str:
    """The policy named by ``value``: one of ``POLICIES``, or a bool as the flag was before the policies
    (True: full, False or None: none)."""
    if value is None or value is False:
        return NONE
    if value is True:
        return FULL
    if isinstance(value, str) and value in POLICIES:
        return value
    raise ValueError(f"recompute must be one of {', '.join(POLICIES)} (or a bool: True is full), got {value!r}")
