from .api import parallelize
from .pipeline import pipeline_parallelize

__all__ = ["parallelize", "pipeline_parallelize"]

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
