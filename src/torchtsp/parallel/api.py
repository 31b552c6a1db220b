"""``parallelize(model, mesh, scheme)``: apply a parallel scheme to a reference Transformer from outside."""

from __future__ import annotations

from ..distributed.comm import AxisComm
from ..model import Transformer

SCHEMES = ("tsp",)


def parallelize(model: Transformer, mesh, scheme: str = "tsp", *, timeout_s: float | None = None):
    """Split ``model`` over ``mesh`` with ``scheme``; the returned module keeps only this rank's shards.

    The reference model's own parameters are released (moved to the meta device): after this call
    use the returned module, whose ``full_state_dict()`` gives the full weights back.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"parallelize expects a torchtsp Transformer, got {type(model).__name__}")
    kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
    if scheme == "tsp":
        from .tsp import TSPTransformer

        parallel = TSPTransformer(model, AxisComm.from_mesh(mesh, "tsp", **kwargs))
    else:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    model.to("meta")
    return parallel
