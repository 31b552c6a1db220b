"""The fork server local ranks are forked from, and the stop signals held while they start.

A rank started as a fresh interpreter spends seconds of CPU importing torch and torchtsp before it can do
anything, and N ranks on a few cores pay that N times over. multiprocessing's fork server imports them once,
then forks each rank from that state: a rank starts at once. Forking is safe there because the server has made
no thread, process group or device context; ranks make theirs after the fork.

This module imports no torch, so that a launcher can start the server first thing and let its imports run
beside the launcher's own imports and checks (``torchtsp.cli``); ``WorkerPool`` starts it otherwise.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
from collections.abc import Sequence

# What every rank imports, whatever it runs (torch with it).
RANK_PRELOAD = ("torchtsp.distributed.launch",)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signals_held():
    """SIGINT and SIGTERM blocked in this thread inside the block. A process started here inherits the block (the
    fork server, and so every rank forked from it), so a Ctrl-C during a rank's start-up cannot kill it; ``_worker``
    then ignores the signals until a trainer listens. Blocking, not ignoring, here: a signal that arrives meanwhile
    stays pending and reaches this process's handler (another thread takes it at once, or this one after the
    block); an ignored one would be lost."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _quiet_resource_tracker() -> None:
    """Ranks killed on a failure (``WorkerPool.close``) cannot unregister the semaphores they made (tqdm's lock, ...);
    multiprocessing's resource tracker then frees them at exit, but warns first, after torchtsp's one-line error.
    The tracker is started with this process's -W options, so the warning is filtered there, before it starts."""
    quiet = "ignore:resource_tracker:UserWarning"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)


def rank_server_pid() -> int | None:
    """The pid of this process's fork server (None before it starts): the parent of every rank forked from it, which
    a failure report names when the server, not a rank, is what died. multiprocessing keeps it in a private
    attribute; None if a Python version keeps it elsewhere."""
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def start_rank_server(preload: Sequence[str] = ()) -> None:
    """Start this process's fork server unless it runs already (multiprocessing keeps one per process): it
    imports ``RANK_PRELOAD`` and ``preload`` (the module of the function the ranks will run), and starts with the
    stop signals blocked, so that every rank forked from it starts with them blocked, whichever thread asks."""
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.set_forkserver_preload(list(dict.fromkeys([*RANK_PRELOAD, *preload])))  # read at its start
    _quiet_resource_tracker()
    resource_tracker.ensure_running()  # first: starting it unblocks SIGINT and SIGTERM in this thread
    with stop_signals_held():
        forkserver.ensure_running()
