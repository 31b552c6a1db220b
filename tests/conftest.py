"""Shared multi-rank worker pools (spawning ranks costs seconds, so tests reuse one pool per world size) and the
``multirank`` marker: a test that runs several ranks (the ``pools`` fixture, or processes it launches itself,
marked by hand) is multirank; ``make test-fast`` runs the others, the single-process unit tests."""

import pytest
import torch

from torchtsp.distributed import WorkerPool
from torchtsp.rank_server import start_rank_server

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



# Modules whose tests launch ranks themselves (the command line with --nproc, torchrun, spawn): multirank whole.
LAUNCHING_MODULES = {"test_bench", "test_bench_infer", "test_cli", "test_distributed", "test_generate_cli",
                     "test_pipeline", "test_reliability", "test_serve", "test_serve_hybrid", "test_train",
                     "test_workflow"}

# Fixtures that start ranks: the shared pools, and every module's ``server`` (a ``torchtsp serve --nproc 2``
# process, tests/test_serve.py's Server). A test needing one, even through another fixture, is multirank.
LAUNCHING_FIXTURES = {"pools", "server"}


# What ranks started from this process run (pools, launches through the command line's ``main``): imported once,
# in the fork server they are forked from, instead of in every new pool's ranks.
RANK_MODULES = ["torchtsp.train.trainer", "torchtsp.generate_job", "torchtsp.serve.worker", "torchtsp.bench.run"]


def pytest_runtest_setup(item):
    # Once, in the first multirank test: started while pytest captures the test's output, the server (and every
    # rank forked from it) writes where the ranks of a pool started in a test always wrote.
    if item.get_closest_marker("multirank"):
        start_rank_server(RANK_MODULES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in LAUNCHING_MODULES:
            item.add_marker(pytest.mark.multirank)

