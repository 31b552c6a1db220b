"""``parallelize(model, mesh, scheme)``: apply a parallel scheme to a reference Transformer from outside."""

from __future__ import annotations

from dataclasses import replace

from ..distributed.comm import DEFAULT_TIMEOUT_S
from ..distributed.mesh import mesh_sizes
from ..layout import Layout
from ..model import Transformer
from ..schemes import SCHEMES
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


def parallelize(model: Transformer, mesh, scheme: str | Layout = "tsp", *, recompute: bool | None = None,
                sequence_parallel: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                weights: WeightSource | None = None) -> ParallelTransformer:
    """Split ``model`` over ``mesh`` with ``scheme``; returns a module with the same interface for every scheme:
    ``loss(tokens, labels)``, ``loss_on_shard``, ``shard_batch``, ``full_grads()``, ``full_state_dict()``.

    ``scheme`` is a registered scheme's name, with its options as keywords, or a ``Layout`` resolved before
    (``Layout.resolve``: scheme, degrees and options in one checked object), whose mesh ``init_mesh(layout)``
    built. Either way the layout is checked against the mesh and the model before any communication.

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
    sizes = mesh_sizes(mesh)
    if sizes.get("pp", 1) > 1:
        raise ValueError("a mesh with a pp axis is split into pipeline stages by "
                         "torchtsp.parallel.pipeline.pipeline_parallelize, not parallelize")
    if isinstance(scheme, Layout):
        layout = scheme
        if layout.pp > 1 or any(sizes.get(a, 1) != n for a, n in layout.degrees):
            raise ValueError(f"the mesh {sizes} is not the layout's {layout.mesh_degrees()}; build it with "
                             f"torchtsp.init_mesh(layout)")
        layout.check_model(model.cfg)
    else:
        layout = Layout.of_mesh(scheme, sizes, cfg=model.cfg, recompute=recompute,
                                sequence_parallel=sequence_parallel)
    built = SCHEME_CLASSES[layout.scheme](model, mesh, timeout_s=timeout_s, weights=weights, **layout.option_values)
    if "sequence_parallel" in layout.spec.options:  # the scheme's default when not given (torch_tp: on)
        layout = replace(layout, options=tuple(sorted({**layout.option_values,
                                                       "sequence_parallel": bool(built.sequence_parallel)}.items())))
    if layout.scheme == "dp" or sizes.get("dp", 1) > 1:  # the dp scheme is the wrapper over Replica
        built = DataParallel(built, mesh, timeout_s)
    built.layout = layout
    return built
