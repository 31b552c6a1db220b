"""Named device meshes: ``init_mesh(dp=, tsp=, tp=, sp=, pp=)``."""

from __future__ import annotations

import torch

from ..layout import Layout, check_positive_int
from ..schemes import AXES, PIPELINE_AXIS
from . import comm


def default_device_type() -> str:
    """The device type a new mesh uses: CUDA (with NCCL) when there is a GPU, else the CPU (with gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def mesh_device(mesh) -> torch.device:
    """The device this rank computes on under ``mesh`` (init_mesh selected this rank's GPU under CUDA)."""
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_sizes(mesh) -> dict[str, int]:
    """Axis name -> size; a ``None`` mesh is one rank on every axis."""
    if mesh is None:
        return dict.fromkeys(AXES, 1)
    names = tuple(mesh.mesh_dim_names or ())
    return {name: mesh.size(i) for i, name in enumerate(names)}


def init_mesh(dp: int | Layout = 1, tsp: int = 1, tp: int = 1, sp: int = 1, *, pp: int = 1,
              device_type: str | None = None, timeout_s: float = comm.DEFAULT_TIMEOUT_S):
    """A DeviceMesh with axes ``dp, sp, tp, tsp`` (all four always present; unused ones have size 1), of the
    degrees given, or of a resolved ``Layout`` passed in their place (``init_mesh(layout)``).

    ``pp > 1`` adds the pipeline axis ``pp`` outermost: [pp, dp, sp, tp, tsp], so that a stage's TSP group
    (and its data-parallel replicas) are neighbouring ranks and consecutive stages are ``dp x tsp`` ranks
    apart (on a multi-node job, pipeline and data parallelism cross nodes, TSP stays inside one). A mesh
    without pipeline keeps its four axes unchanged.

    Works whether or not the default process group exists: it is created from torchrun's
    environment if present, as a one-rank group otherwise. gloo on CPU, NCCL on CUDA.
    Raises ``ValueError`` before any collective if the degrees do not multiply to the world size.
    """
    if isinstance(dp, Layout):
        dp, tsp, tp, sp, pp = (dp.mesh_degrees().get(a, 1) for a in ("dp", "tsp", "tp", "sp", PIPELINE_AXIS))
    degrees = {PIPELINE_AXIS: pp, "dp": dp, "sp": sp, "tp": tp, "tsp": tsp}
    for name, value in degrees.items():
        check_positive_int(f"mesh degree {name}", value)
    device_type = device_type or default_device_type()
    comm.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(comm.global_rank() % torch.cuda.device_count())
    names = ((PIPELINE_AXIS,) if pp > 1 else ()) + AXES
    world, product = comm.world_size(), pp * dp * sp * tp * tsp
    if product != world:
        shown = " x ".join(f"{n}={degrees[n]}" for n in names)
        raise ValueError(f"mesh {shown} needs {product} ranks but the world has {world}; "
                         f"make the degrees multiply to {world}")
    return comm.make_device_mesh(device_type, tuple(degrees[n] for n in names), names)
