"""The one way into ``torch.distributed``.

Every collective, point-to-point transfer and process-group call of torchtsp goes
through this module, so that

* every operation has a timeout (a dead peer fails loudly instead of hanging),
* every operation is counted: bytes sent and received by this rank, per operation
  kind, readable through ``AxisComm.counting()`` and comparable with the analytic
  model in ``torchtsp.analysis``,
* the order in which transfers are issued and waited on is recorded, per process group,
  so tests can check that communication is requested before the compute it should hide
  behind, and that nothing needed now queues behind something needed later (NCCL runs
  the collectives of one process group in issue order on one stream),
* the seconds the host spends blocked in ``Pending.wait()`` are summed (exposed communication).

An axis may carry a second process group over the same ranks (``weight_stream=True``):
TSP moves weights on it, so that weight broadcasts and activation transfers never queue
behind each other.

Byte counts are the *logical payload* of each operation for this rank, the volume
the analytic model speaks of (n = bytes of one rank's tensor, D = axis size):

=================  ===========================  ===========================
operation          received                     sent
=================  ===========================  ===========================
broadcast          n (0 at the source)          (D-1)·n at the source, else 0
all_gather         (D-1)·n                      (D-1)·n
reduce_scatter     (D-1)·n (n = output bytes)   (D-1)·n
reduce             (D-1)·n at the destination   n elsewhere
all_reduce         2(D-1)/D·n (ring algorithm)  2(D-1)/D·n
ring_shift         n                            n
all_to_all_single  rows from the other ranks    rows to the other ranks
pipeline_p2p       n per received tensor        n per sent tensor
exchange           the tensors received         the tensors sent
=================  ===========================  ===========================

``all_gather_prefixes`` and ``reduce_scatter(prefix=...)`` (the causally pruned K/V exchange) count what
they move on point-to-point backends, where the parts of earlier ranks are cut to a prefix (so the figures
depend on the rank), and the whole all-gather / reduce-scatter figures on collective ones.

``exchange`` is a step of point-to-point transfers of uneven sizes that every rank derives from one rule (a
sliding layer's K/V and their gradients, ``distributed/window.py``), batched on every backend; its figures
depend on the rank everywhere.

``pipeline_p2p`` is the one kind of traffic this module does not issue itself: the sends and
receives of ``torch.distributed.pipelining`` between pipeline stages. Its stage hands every
batch of point-to-point ops it is about to issue to ``AxisComm.count_p2p`` first (see
``parallel/pipeline.py``), which counts the bytes of exactly those tensors; they run on a process
group from ``pipeline_group`` whose timeout bounds every wait.
"""

from .accounting import CommStats, Traffic, Transfer
from .axis import AxisComm, Pending
from .groups import (
    DEFAULT_TIMEOUT_S,
    barrier,
    block_group,
    cpu_world_group,
    destroy_process_group,
    global_rank,
    init_fake_process_group,
    init_process_group,
    is_initialized,
    make_device_mesh,
    pipeline_group,
    release_subgroups,
    sibling_group,
    world_size,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AxisComm",
    "CommStats",
    "Pending",
    "Traffic",
    "Transfer",
    "barrier",
    "block_group",
    "cpu_world_group",
    "destroy_process_group",
    "global_rank",
    "init_fake_process_group",
    "init_process_group",
    "is_initialized",
    "make_device_mesh",
    "pipeline_group",
    "release_subgroups",
    "sibling_group",
    "world_size",
]

from ...lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
