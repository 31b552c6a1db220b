"""Shared multi-rank worker pools (spawning ranks costs seconds, so tests reuse one pool per world size) and the
``multirank`` marker: a test that runs several ranks (the ``pools`` fixture, or processes it launches itself,
marked by hand) is multirank; ``make test-fast`` runs the others, the single-process unit tests."""

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



def pytest_collection_modifyitems(config, items):
    for item in items:
        if "pools" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multirank)
