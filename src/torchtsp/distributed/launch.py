"""Run a function on N local ranks: ``spawn`` for one job, ``WorkerPool`` to reuse the ranks.

A rank that raises, dies, or does not answer within the timeout fails the whole job; the report
names the rank that failed first (a rank that died before the survivors that lost their connection
to it); the other ranks are killed rather than left waiting in a collective.

The ranks belong to the process that started them: a rank whose launcher has gone exits within a
second, and ranks start with SIGINT and SIGTERM held off (blocked from the start, ignored once running,
``stop_signals_held``), so that a Ctrl-C during start-up leaves the decision to the launcher (see
``signal_ranks``) instead of killing some ranks half-way.

Ranks are forked from a fork server (``torchtsp.rank_server``) that imports torch and torchtsp once per
launcher instead of once per rank; each rank takes the launcher's environment as it is when the rank starts,
as a spawned rank would.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp

from ..errors import RankFailedError
from ..rank_server import STOP_SIGNALS, rank_server_pid, start_rank_server
from . import comm

PARENT_POLL_S = 0.5
REPORT_GRACE_S = 1.0  # after a rank fails, how long to look for a rank that died first
READY = "torchtsp: rank ready"  # what a rank sends once its process group is up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: absent, or a zombie its parent has not reaped yet (read from /proc where
    there is one; elsewhere a zombie counts as alive)."""
    state = _process_state(pid)
    if state is not None:
        return state in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, as another user's
        pass
    return False


def watch_parent(poll_s: float = PARENT_POLL_S) -> None:
    """Exit this process soon after its launcher dies: the process that started it through multiprocessing, else
    its parent (torchrun's agent; the parent's pid changes when this process is re-parented). A rank forked from
    the fork server (its parent, not the launcher) learns of the launcher through a pipe the server holds, so the
    pipe also closes when the server alone dies: the message then names the server, as the launcher's does."""
    launcher = mp.parent_process()
    parent = launcher.pid if launcher is not None else os.getppid()
    server = os.getppid() if launcher is not None and os.getppid() != launcher.pid else None

    def watch():
        if launcher is not None:
            launcher.join()
        else:
            while os.getppid() == parent:
                time.sleep(poll_s)
        if server is not None and not _gone(parent):
            what = f"the fork server it was forked from (pid {server}) has gone, its launcher (pid {parent}) lives"
        else:
            what = f"its launcher (pid {parent}) has gone"
        print(f"torchtsp: rank {os.environ.get('RANK', '?')}: {what}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="torchtsp-parent-watch", daemon=True).start()


def rank_backend(nprocs: int, device_type: str | None) -> tuple[str, str]:
    """(process group backend, device type) for ``nprocs`` local ranks: NCCL with one GPU per rank on a CUDA
    host, gloo on CPU. ``device_type`` None picks CUDA when available."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":
        return "gloo", "cpu"
    if device_type != "cuda":
        raise ValueError(f"device_type must be 'cpu', 'cuda' or None, got {device_type!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < nprocs:
        raise ValueError(f"{nprocs} local ranks need {nprocs} GPUs (one per rank) but this host has {gpus}; "
                         f"use --nproc {gpus} or fewer, or run on CPU with CUDA_VISIBLE_DEVICES=\"\"")
    return "nccl", "cuda"


def _worker(rank, nprocs, port, timeout_s, threads, backend, tasks, results, environ, hold_signals):
    # Forked with the stop signals blocked (``rank_server.start_rank_server``): a signal during start-up stays pending.
    if hold_signals:  # until a trainer listens, the launcher decides (it sends again until we stop)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    watch_parent()
    os.environ.clear()  # the launcher's environment now, not the fork server's when it started
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
    # One thread per rank: N ranks share few cores; oversubscription makes gloo runs crawl.
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        comm.init_process_group(backend, timeout_s)
    except BaseException:  # noqa: BLE001 - report anything, the parent decides
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, READY))
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            result = (rank, True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001
            result = (rank, False, traceback.format_exc())
        try:  # the job's meshes die with it: the next job builds its own
            comm.release_subgroups()
        except BaseException:  # noqa: BLE001
            result = (rank, False, traceback.format_exc())
        results.put(result)
    comm.destroy_process_group()


@contextlib.contextmanager
def stop_signals_handled(handler):
    """SIGINT and SIGTERM go to ``handler`` (or ``signal.SIG_IGN``) inside the block; the old handlers after it."""
    saved = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


def _death(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        # SIGKILL comes from another process or from the kernel's OOM killer; which one, the exit code cannot say.
        return f"killed by {name}" + (" from outside the run (a kill, or the kernel's OOM killer)"
                                      if name == "SIGKILL" else "")
    return f"exited with code {exitcode}"


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` (T: stopped), where /proc tells (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _timed_out(traceback_text: str) -> bool:
    text = traceback_text.lower()
    return "timed out" in text or "timeout" in text


class WorkerPool:
    """N spawned ranks with an initialised process group, kept alive between ``run`` calls.

    ``device_type`` "cpu" (default): gloo. "cuda": NCCL, rank r on GPU r. None: CUDA when available.
    ``preload``: modules the fork server imports for the ranks, if this pool starts it (``start_rank_server``).
    Must be created from the main thread when signals are to be handled (as Python requires).
    """

    def __init__(self, nprocs: int, timeout_s: float = comm.DEFAULT_TIMEOUT_S, threads_per_rank: int = 1,
                 device_type: str | None = "cpu", preload: Sequence[str] = ()):
        if not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
        self._backend, self.device_type = rank_backend(nprocs, device_type)
        self.nprocs, self.timeout_s, self._threads, self._preload = nprocs, timeout_s, threads_per_rank, preload
        self._start()

    def _start(self) -> None:
        start_rank_server(self._preload)
        self._server = rank_server_pid()  # the ranks' parent: if it dies, they go with it
        ctx = mp.get_context("forkserver")
        self._tasks = [ctx.Queue() for _ in range(self.nprocs)]
        self._results = ctx.Queue()
        self._ready: set[int] = set()
        port = _free_port()
        # Held in ranks that a main thread starts: the launcher, which can handle signals, decides for them.
        hold = threading.current_thread() is threading.main_thread()
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.nprocs, port, self.timeout_s, self._threads, self._backend,
                                              self._tasks[r], self._results, dict(os.environ), hold), daemon=True)
            for r in range(self.nprocs)
        ]
        for p in self._procs:
            p.start()

    def _port_taken(self, rank: int, ok: bool, value) -> bool:
        """Whether rank 0 could not listen on its port: another process took it between our choice and its bind."""
        return not ok and rank == 0 and rank not in self._ready and "EADDRINUSE" in str(value)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def signal_ranks(self, signum: int) -> None:
        """Send ``signum`` to every live rank (the trainer stops at the next step boundary on SIGINT/SIGTERM)."""
        for p in self._procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    def _dead(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if not p.is_alive()]

    def run(self, fn, *args, timeout_s: float | None = None, on_wait=None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank (fn must be importable); returns results by rank.

        ``on_wait()``, if given, is called about every half second while the ranks work.
        """
        if not self.alive:
            raise RankFailedError("worker pool is closed or a rank has died")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        restarts = 0
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        name = getattr(fn, "__name__", fn)
        results: dict[int, object] = {}
        while len(results) < self.nprocs:
            if on_wait is not None:
                on_wait()
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if self._dead():
                    raise self._failure(name, None, "", set(results)) from None
                if time.monotonic() > deadline:
                    stopped = self._stopped()
                    self.close(force=True)
                    why = f" (rank {stopped[0]} is stopped)" if stopped else ""
                    raise RankFailedError(f"{name} on {self.nprocs} ranks: no answer within {limit:.0f}s{why}",
                                          stopped[0] if stopped else None) from None
                continue
            if ok and isinstance(value, str) and value == READY:
                self._ready.add(rank)
                continue
            if self._port_taken(rank, ok, value) and restarts < 3:
                restarts += 1  # start again on another port: nothing has run yet
                self.close(force=True)
                self._start()
                for q in self._tasks:
                    q.put((fn, args, kwargs))
                results.clear()
                continue
            if not ok:
                raise self._failure(name, rank, value, set(results))
            results[rank] = value
        return [results[r] for r in range(self.nprocs)]

    def _stopped(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if p.is_alive() and _process_state(p.pid) in ("T", "t")]

    def _failure(self, name, rank: int | None, traceback_text: str, answered: set) -> RankFailedError:
        """The error to report, once the pool is closed. A rank that died outranks one that raised, since the
        survivors of a dead peer raise 'connection reset' errors of their own; a rank that never answered
        outranks the ranks whose collectives timed out waiting for it (gloo's timeout does not name the peer);
        among ranks that raised within a moment of each other (the same error on every rank, as a checked value
        gives), the lowest."""
        raised = {rank: traceback_text} if rank is not None else {}
        deadline = time.monotonic() + REPORT_GRACE_S
        while not (dead := self._dead()) and raised and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                other, ok, value = self._results.get(timeout=0.05)
                if not ok:
                    raised.setdefault(other, value)
        codes = {r: self._procs[r].exitcode for r in dead}
        silent = [r for r in range(self.nprocs) if r not in raised and r not in answered]
        stopped = set(self._stopped())
        self.close(force=True)
        if dead and self._server is not None and _gone(self._server):
            # The ranks' exit codes come through the server: with it gone they read 255 whatever happened.
            return RankFailedError(f"{name} on {self.nprocs} ranks: the fork server the ranks were forked from (pid "
                                   f"{self._server}) died, and the ranks exited with it (was it killed from outside "
                                   f"the run, or by the kernel's OOM killer?)")
        if dead:
            first = dead[0]
            return RankFailedError(f"{name} on {self.nprocs} ranks: rank {first} died ({_death(codes[first])})",
                                   first)
        first = min(raised)
        if silent and _timed_out(raised[first]):
            culprit = next((r for r in silent if r in stopped), silent[0])
            state = "its process is stopped (SIGSTOP, a debugger, or a suspended job)" if culprit in stopped \
                else "it was still busy or stuck"
            return RankFailedError(f"{name} on {self.nprocs} ranks: rank {culprit} did not answer ({state}); rank "
                                   f"{first} raised when its collective timed out waiting for it", culprit)
        return RankFailedError(f"rank {first} raised:", first, raised[first])

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
