from .comm import AxisComm, CommStats
from .launch import RankFailedError, WorkerPool, spawn
from .mesh import init_mesh

__all__ = ["AxisComm", "CommStats", "RankFailedError", "WorkerPool", "init_mesh", "spawn"]

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
