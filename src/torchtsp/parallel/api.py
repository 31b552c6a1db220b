"""``parallelize(model, mesh, scheme)``: apply a parallel scheme to a reference Transformer from outside."""

from __future__ import annotations

from ..distributed.comm import DEFAULT_TIMEOUT_S
from ..distributed.mesh import mesh_sizes
from ..model import Transformer
from ..schemes import SCHEMES, get_scheme
from ..weights import WeightSource
from .base import ParallelTransformer
from .dp import DataParallel, Replica
from .sp import SPTransformer
from .torch_tp import TorchTPTransformer
from .tp import TPTransformer
from .tp_sp import TPSPTransformer
from .tsp import TSPTransformer

# The model side of each registered scheme (torchtsp.schemes.SCHEMES); data parallelism wraps any of them.
SCHEME_CLASSES: dict[str, type[ParallelTransformer]] = {
    "tsp": TSPTransformer,
    "tp": TPTransformer,
    "sp": SPTransformer,
    "tp_sp": TPSPTransformer,
    "dp": Replica,
    "torch_tp": TorchTPTransformer,
}
assert SCHEME_CLASSES.keys() == SCHEMES.keys(), "every registered scheme needs its class here"


def parallelize(model: Transformer, mesh, scheme: str = "tsp", *, recompute: bool | None = None,
                sequence_parallel: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                weights: WeightSource | None = None) -> ParallelTransformer:
    """Split ``model`` over ``mesh`` with ``scheme``; returns a module with the same interface for every scheme:
    ``loss(tokens, labels)``, ``loss_on_shard``, ``shard_batch``, ``full_grads()``, ``full_state_dict()``.

    The scheme runs on its own mesh axes; a ``dp`` axis of size > 1 replicates it (``parallel/dp.py``), and the
    ``dp`` scheme is data parallelism over the whole model. The reference model is consumed: schemes that shard
    weights move its parameters to the meta device (each rank keeps only its shards), replicated schemes adopt
    it. Use the returned module afterwards.

    A model too large for one device is built with ``Transformer(cfg, device="meta")``: each rank then draws
    only its own shards of the seeded initial values (the same values ``Transformer(cfg)`` would hold), or
    reads them from ``weights`` (``torchtsp.hf.open_hf_weights``: a checkpoint read slice by slice), on the
    device this rank computes on. No rank holds more than its shards and one tensor being read.

    Options (``None``: not given): ``recompute`` (every scheme but torch_tp) keeps each layer's input only and
    re-runs its forward in backward; ``sequence_parallel`` (tp, torch_tp) adds Megatron-SP; ``timeout_s``
    bounds every collective. An option the scheme does not take is a ValueError.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"parallelize expects a torchtsp Transformer, got {type(model).__name__}")
    spec = get_scheme(scheme)
    if mesh_sizes(mesh).get("pp", 1) > 1:
        raise ValueError("a mesh with a pp axis is split into pipeline stages by "
                         "torchtsp.parallel.pipeline.pipeline_parallelize, not parallelize")
    options = {name: value for name, value in (("recompute", recompute), ("sequence_parallel", sequence_parallel))
               if value is not None}
    unsupported = sorted(set(options) - set(spec.options))
    if unsupported:
        raise ValueError(f"scheme {scheme!r} does not support {', '.join(unsupported)}; "
                         f"its options are: {', '.join(spec.options) or 'none'}")
    built = SCHEME_CLASSES[scheme](model, mesh, timeout_s=timeout_s, weights=weights, **options)
    if scheme == "dp" or mesh_sizes(mesh).get("dp", 1) > 1:  # the dp scheme is the wrapper over Replica
        return DataParallel(built, mesh, timeout_s)
    return built
