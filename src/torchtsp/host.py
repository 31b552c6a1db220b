"""Host-side values (seeds, rank tables, the batch's token ids) read as numbers even inside a fake-tensor trace.

``torchtsp.trace`` runs the real training step under ``FakeTensorMode``, where a tensor has a shape but no values,
so reading one (``.item()``, ``.tolist()``, a comparison's truth) cannot work. A few values of a step are not model
data but host bookkeeping that exists before the step and is real in a trace too: the model's initial seed drawn
from the CPU generator, the mesh's table of ranks, the host batch a check reads. ``on_host()`` evaluates such
reads on the real tensors they belong to; outside a trace it changes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars


def on_host() -> contextlib.AbstractContextManager:
    """A block in which tensor operations run on real (host) tensors even when a fake-tensor mode is active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# Set by ``tracing()`` alone: a fake tensor met elsewhere (a test's fake CUDA world) is read as it always was.
_TRACING = contextvars.ContextVar("torchtsp_tracing", default=False)


@contextlib.contextmanager
def tracing():
    """The block of a ``torchtsp.trace`` run: host reads of fake tensors take the values the trace assumes."""
    token = _TRACING.set(True)
    try:
        yield
    finally:
        _TRACING.reset(token)


def traced(tensor) -> bool:
    """Whether ``tensor`` is a fake-tensor trace's (``torchtsp.trace``, inside ``tracing()``): it has a shape, but no
    values to read."""
    from torch._subclasses.fake_tensor import FakeTensor

    return _TRACING.get() and isinstance(tensor, FakeTensor)


def balanced(total: int, parts: int) -> list[int]:
    """``total`` split as evenly as whole numbers allow over ``parts`` (the first ``total % parts`` one more)."""
    share, extra = divmod(total, parts)
    return [share + (i < extra) for i in range(parts)]


def counts_on_host(counts, assumed) -> list[int]:
    """A tensor of counts the host must know (a mixture of experts' split sizes) as a list of ints: its values; in a
    fake-tensor trace, which has none, ``assumed()`` (routing is data, so a trace assumes it: the balanced
    assignment, said in the trace's result)."""
    return assumed() if traced(counts) else counts.tolist()
