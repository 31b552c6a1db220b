"""Process groups: the default group's lifecycle, the second groups over a mesh axis (weight streams, replicated
KV-head blocks, pipeline stages), and the job's rank and size. Every other part of the comm package, and nothing
outside it, creates or destroys process groups."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...host import on_host
from ...runenv import launched_by_torchrun
from ...timeouts import COLLECTIVE_TIMEOUT_S

DEFAULT_TIMEOUT_S = COLLECTIVE_TIMEOUT_S  # torchtsp.timeouts says why

# ---------------------------------------------------------------- process group


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_process_group(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise the default group unless the caller (torchrun, our spawner, user code) already did.

    Without launcher environment variables this is a one-rank group, so D = 1 runs need no launcher.
    """
    if is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def init_fake_process_group(rank: int, world: int, stands_for: str = "nccl") -> None:
    """The default group as rank ``rank`` of a job of ``world`` ranks, all in this one process (``torchtsp.trace``).

    torch's fake backend moves nothing: under ``FakeTensorMode`` every collective and point-to-point transfer
    returns tensors of the right shape, so one process runs one rank's real code at any world size. ``stands_for``
    is the backend it plays: "gloo" makes the model's axes move K/V and collectives point to point as on gloo
    (``AxisComm.point_to_point``), "nccl" as collectives. Refuses if a process group exists already.
    """
    if is_initialized():
        raise RuntimeError("a fake process group needs a process without one; this one has a "
                           f"{dist.get_backend()} group of {world_size()} ranks")
    if stands_for not in ("nccl", "gloo"):
        raise ValueError(f"a fake process group stands for nccl or gloo, got {stands_for!r}")
    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels of the c10d ops)
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    _FAKE_STANDS_FOR["default"] = stands_for


# The backend the fake process group plays (``init_fake_process_group``); empty when there is none.
_FAKE_STANDS_FOR: dict[str, str] = {}


def moves_point_to_point(group) -> bool:
    """Whether ``group``'s backend runs our collectives as point-to-point transfers: gloo, or a fake group
    standing for it."""
    backend = dist.get_backend(group)
    if backend == "fake":
        return _FAKE_STANDS_FOR.get("default") == "gloo"
    return backend == "gloo"


def destroy_process_group() -> None:
    _SIBLING_GROUPS.clear()  # they die with the default group
    _FAKE_STANDS_FOR.clear()
    if is_initialized():
        dist.destroy_process_group()


def release_subgroups() -> None:
    """Destroy every process group but the default one, and forget the cached ones.

    A long-lived worker (``launch.WorkerPool``) runs many jobs, each building its own meshes and groups;
    without this their communicators (each gloo group with its own threads) pile up for the worker's life.
    Local, not collective: every rank of a pool calls it after the same job.
    """
    _SIBLING_GROUPS.clear()
    if not is_initialized():
        return
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):  # torch keeps no public list of live groups
        if group is not default:
            dist.destroy_process_group(group)


# Second process groups over the ranks of a mesh axis, by (every slice's ranks, purpose): building a model
# twice reuses them instead of leaking a new communicator per model.
_SIBLING_GROUPS: dict = {}


def sibling_group(mesh: DeviceMesh, name: str, purpose: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A second process group over this rank's ranks of mesh axis ``name`` (created once per purpose).

    Every rank must call this, in the same order: ``new_group`` is collective over the default group,
    so each rank creates the groups of every slice of the axis and keeps its own.
    """
    return block_group(mesh, name, mesh.size(mesh.mesh_dim_names.index(name)), purpose, timeout_s)


def pipeline_group(mesh: DeviceMesh, timeout_s: float = DEFAULT_TIMEOUT_S):
    """This rank's process group along the ``pp`` mesh axis, for ``torch.distributed.pipelining``.

    A group of its own (created once, collectively), with the run's timeout: the pipelining library waits on
    its transfers without a timeout of its own, so the group's timeout is what turns a dead stage into an
    error instead of a hang.
    """
    return sibling_group(mesh, "pp", "pipeline", timeout_s)


def cpu_world_group(timeout_s: float = DEFAULT_TIMEOUT_S):
    """A process group of every rank on the CPU (gloo), for host-side decisions such as a server's step plans:
    the default group itself when it is gloo, else a gloo group made once (collective over every rank)."""
    if world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    key = ((tuple(range(world_size())),), "cpu")
    if key not in _SIBLING_GROUPS:
        _SIBLING_GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _SIBLING_GROUPS[key]


def world_size() -> int:
    """Ranks in the job: the process group's, or the launcher's (torchrun) before the group exists."""
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def global_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def make_device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def block_group(mesh: DeviceMesh, name: str, block: int, purpose: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A process group over this rank's block of ``block`` consecutive ranks of mesh axis ``name`` (created
    once per purpose; collective over the default group like ``sibling_group``)."""
    with on_host():  # the mesh's rank table is host data, real in a fake-tensor trace too (torchtsp.trace)
        ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index(name), -1)
        slices = tuple(tuple(row) for row in ranks.reshape(-1, block).tolist())
    key = (slices, purpose)
    if key not in _SIBLING_GROUPS:
        timeout = datetime.timedelta(seconds=timeout_s)
        mine = None
        for members in slices:
            group = dist.new_group(list(members), timeout=timeout)
            if global_rank() in members:
                mine = group
        _SIBLING_GROUPS[key] = mine
    return _SIBLING_GROUPS[key]


def barrier() -> None:
    """Wait for every rank (bounded by the process group's timeout)."""
    if world_size() > 1:
        dist.barrier()
