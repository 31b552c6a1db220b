"""Per-rank peak memory measured from live tensor storage (PyTorch's MemTracker)."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker


def measure_peak(fn, *track: torch.nn.Module | torch.optim.Optimizer) -> tuple[object, int]:
    """Run ``fn()`` and return (its result, peak bytes of live tensors on its device).

    Tensors that already exist count only if they belong to ``track`` (parameters, gradients,
    optimizer state); everything allocated inside ``fn`` counts while it is alive.
    """
    tracker = MemTracker()
    if track:
        tracker.track_external(*track)
    with tracker:
        result = fn()
    peaks = tracker.get_tracker_snapshot("peak")
    # Meta tensors (a model built on the meta device) have no storage: they are not memory.
    return result, max((by_kind["Total"] for device, by_kind in peaks.items() if torch.device(device).type != "meta"),
                       default=0)
