"""Per-rank peak memory measured from live tensor storage (PyTorch's MemTracker)."""

from __future__ import annotations

import warnings

import torch

# MemTracker's module pulls in Dynamo, Inductor and sympy (about 1.8 s of CPU): imported when a peak is measured,
# not by every rank that merely imports this module.
_measuring: list = []


def next_pass() -> None:
    """Tell a measurement in progress that the same modules run forward again within the measured call (the
    micro-batches of gradient accumulation): MemTracker would otherwise take it for a second iteration."""
    for tracker in _measuring:
        tracker.reset_mod_stats()  # per-module figures only: the peak over the whole call is kept


def measure_peak(fn, *track: torch.nn.Module | torch.optim.Optimizer) -> tuple[object, int]:
    """Run ``fn()`` and return (its result, peak bytes of live tensors on its device).

    Tensors that already exist count only if they belong to ``track`` (parameters, gradients,
    optimizer state); everything allocated inside ``fn`` counts while it is alive.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if track:
        tracker.track_external(*track)
    _measuring.append(tracker)
    try:
        with tracker, warnings.catch_warnings():
            # Its post-accumulate hook finds no gradient where a distributed optimizer (train/zero.py) has taken
            # it into a bucket already; the gradient was counted as it arrived (its tensor hook).
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            result = fn()
    finally:
        _measuring.remove(tracker)
    peaks = tracker.get_tracker_snapshot("peak")
    # Meta tensors (a model built on the meta device) have no storage: they are not memory.
    return result, max((by_kind["Total"] for device, by_kind in peaks.items() if torch.device(device).type != "meta"),
                       default=0)


def live_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views and aliases are not counted twice), as
    ``measure_peak``'s MemTracker counts a tensor; meta tensors hold none. Cheap enough to call during backward."""
    storages = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP2's sharded parameters, their gradients): this rank's piece
            t = t.to_local()
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
