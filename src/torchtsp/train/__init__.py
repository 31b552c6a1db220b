"""Training: the parallel trainer, its data, checkpoints and the single-device reference loop."""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
