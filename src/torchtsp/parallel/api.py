"""``parallelize(model, mesh, scheme)``: apply a parallel scheme to a reference Transformer from outside."""

from __future__ import annotations

import importlib
import inspect

from ..model import Transformer
from ..schemes import SCHEMES


def parallelize(model: Transformer, mesh, scheme: str = "tsp", **options):
    """Split ``model`` over ``mesh`` with ``scheme``; returns a module with the same interface for every scheme:
    ``loss(tokens, labels)``, ``loss_on_shard``, ``shard_batch``, ``full_grads()``, ``full_state_dict()``.

    The reference model is consumed: schemes that shard weights move its parameters to the meta device
    (each rank keeps only its shards), replicated schemes adopt it. Use the returned module afterwards.
    Options are scheme-specific: ``timeout_s`` (all), ``recompute`` (tsp, tp, sp, tp_sp),
    ``sequence_parallel`` (tp, torch_tp).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"parallelize expects a torchtsp Transformer, got {type(model).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    module, name = SCHEMES[scheme].split(":")
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    accepted = set(inspect.signature(cls).parameters) - {"model", "mesh"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"scheme {scheme!r} does not support {', '.join(unknown)}; "
                         f"its options are: {', '.join(sorted(accepted)) or 'none'}")
    return cls(model, mesh, **options)
