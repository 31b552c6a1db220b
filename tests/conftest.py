"""Shared multi-rank worker pools: spawning ranks costs seconds, so tests reuse one pool per world size."""

import pytest
import torch

from torchtsp.distributed import WorkerPool

torch.set_num_threads(1)


class Pools:
    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world: int) -> WorkerPool:
        pool = self._pools.get(world)
        if pool is None or not pool.alive:  # a test that made a rank fail on purpose kills its pool
            pool = self._pools[world] = WorkerPool(world, timeout_s=240)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close(force=not pool.alive)


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()

