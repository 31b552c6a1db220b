"""Run a function on N local CPU ranks: ``spawn`` for one job, ``WorkerPool`` to reuse the ranks.

A rank that raises, dies, or does not answer within the timeout fails the whole job with
that rank's traceback; the other ranks are killed rather than left waiting in a collective.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

from ..errors import RankFailedError
from . import comm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, nprocs, port, timeout_s, threads, tasks, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
    # One thread per rank: N ranks share few cores; oversubscription makes gloo runs crawl.
    torch.set_num_threads(threads)
    try:
        comm.init_process_group("gloo", timeout_s)
    except BaseException:  # noqa: BLE001 - report anything, the parent decides
        results.put((rank, False, traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001
            results.put((rank, False, traceback.format_exc()))
    comm.destroy_process_group()


class WorkerPool:
    """N spawned ranks with an initialised gloo process group, kept alive between ``run`` calls."""

    def __init__(self, nprocs: int, timeout_s: float = comm.DEFAULT_TIMEOUT_S, threads_per_rank: int = 1):
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        self.nprocs, self.timeout_s = nprocs, timeout_s
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(nprocs)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, nprocs, port, timeout_s, threads_per_rank, self._tasks[r],
                                              self._results), daemon=True)
            for r in range(nprocs)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout_s: float | None = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank (fn must be importable); returns results by rank."""
        if not self.alive:
            raise RankFailedError("worker pool is closed or a rank has died")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: dict[int, object] = {}
        while len(results) < self.nprocs:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    why = f"rank(s) {dead} died" if dead else f"no answer within {timeout_s or self.timeout_s:.0f}s"
                    raise RankFailedError(f"{getattr(fn, '__name__', fn)} on {self.nprocs} ranks: {why}") from None
                continue
            if not ok:
                self.close(force=True)
                raise RankFailedError(f"rank {rank} raised:", rank, value)
            results[rank] = value
        return [results[r] for r in range(self.nprocs)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)


def spawn(fn, nprocs: int, *args, timeout_s: float = comm.DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` once on ``nprocs`` local CPU ranks; returns the results by rank."""
    with WorkerPool(nprocs, timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)
