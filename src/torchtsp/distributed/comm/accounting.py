"""Byte accounting: what one rank sent and received per operation kind, and the order in which transfers were
issued and waited on, per process group (``AxisComm.counting()``, ``Traffic``)."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol


class Counted(Protocol):
    """What ``Traffic`` needs of a comm (``AxisComm``): a ``counting()`` block."""

    def counting(self) -> contextlib.AbstractContextManager[CommStats]: ...

@dataclass(eq=False)
class Transfer:
    """One issued operation: its process group, and where its issue and its wait sit in ``events``."""

    group: str
    op: str
    label: object
    issued: int
    waited: int | None = None


@dataclass(eq=False)  # compared by identity: nested counting() blocks must each remove their own
class CommStats:
    """What one rank moved while a ``counting()`` block was open."""

    bytes_sent: Counter = field(default_factory=Counter)
    bytes_recv: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    # (event, operation, label) in program order; event is "issue", "wait" or "mark".
    events: list = field(default_factory=list)
    # Every operation in issue order (``Transfer``), with the process group it was queued on.
    transfers: list = field(default_factory=list)
    # Seconds the host spent blocked in ``Pending.wait()``: communication not hidden behind compute.
    wait_s: float = 0.0

    def issue_order(self, group: str) -> list[Transfer]:
        """The operations queued on process group ``group`` (e.g. "tsp", "tsp.weights"), in issue order."""
        return [t for t in self.transfers if t.group == group]

    @property
    def total_recv(self) -> int:
        return sum(self.bytes_recv.values())

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())



class Traffic:
    """``with Traffic(comms) as traffic:`` counts this rank's transfers on several axes at once.

    ``comms`` maps axis names to ``AxisComm`` (a model's ``comms()``); afterwards ``traffic.recv`` is the bytes
    received on all of them, ``traffic.by_op`` the bytes received per axis and operation, and
    ``traffic.stats`` each axis's ``CommStats``.
    """

    def __init__(self, comms: dict[str, Counted]):
        self.comms = comms
        self.stats: dict[str, CommStats] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Traffic:
        self.stats = {name: self._stack.enter_context(c.counting()) for name, c in self.comms.items()}
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def recv(self) -> int:
        return sum(s.total_recv for s in self.stats.values())

    @property
    def by_op(self) -> dict[str, dict[str, int]]:
        return {axis: dict(s.bytes_recv) for axis, s in self.stats.items() if s.bytes_recv}
