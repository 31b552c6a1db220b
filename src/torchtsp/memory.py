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
    result, peak, _ = measure_peak_by_kind(fn, *track)
    return result, peak


# MemTracker's kinds of tensor -> the analytic model's parts of a peak (analysis.memory_model.MemoryBreakdown).
# "Other" is what MemTracker was handed as bare tensors: here only optimizers' own parameters (``_optimizer_owned``).
PEAK_PARTS = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "transient", "Other": "optimizer"}


def _optimizer_owned(track) -> list[torch.Tensor]:
    """The tensors the optimizers in ``track`` update that no module in ``track`` holds: float32 masters of
    bfloat16 weights (``train/optim.py``'s MasterWeights, ZeRO's owned chunks). MemTracker counts an optimizer's
    state but not its parameters, so without them a mixed-precision step's peak would leave the masters out."""
    def storage(t: torch.Tensor) -> int:  # as live_bytes keys it; a DTensor (FSDP2's) by its local piece
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()._cdata

    held = {storage(p) for m in track if isinstance(m, torch.nn.Module) for p in m.parameters()}
    owned = {}
    for opt in (o for o in track if isinstance(o, torch.optim.Optimizer)):
        for p in (p for group in opt.param_groups for p in group["params"] if p.device.type != "meta"):
            if storage(p) not in held:
                owned.setdefault(storage(p), p)
    return list(owned.values())


def measure_peak_by_kind(fn, *track: torch.nn.Module | torch.optim.Optimizer) -> tuple[object, int, dict[str, int]]:
    """``measure_peak``, with the live bytes at the peak by part: params, grads, optimizer, activations (tensors made
    in forward, saved or not) and transient (made in backward or the optimizer step), as MemTracker tells them
    apart (float32 masters of bfloat16 weights are the optimizer's tensors: "optimizer", as the analytic model
    counts them)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if track:
        tracker.track_external(*track, *_optimizer_owned(track))
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
    real = [by_kind for device, by_kind in peaks.items() if torch.device(device).type != "meta"]
    at_peak = max(real, key=lambda by_kind: by_kind["Total"], default={"Total": 0})
    parts = dict.fromkeys(dict.fromkeys(PEAK_PARTS.values()), 0)
    for kind, nbytes in at_peak.items():
        if kind != "Total":
            parts[PEAK_PARTS.get(getattr(kind, "value", kind), "transient")] += nbytes
    return result, at_peak["Total"], parts


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
        # Keyed by the storage itself (_cdata: its address in memory): a fake tensor's storage (torchtsp.trace) has
        # no data, every data_ptr() 0.
        storages[(t.device, storage._cdata)] = storage.nbytes()
    return sum(storages.values())
