"""Host-side values (seeds, rank tables, the batch's token ids) read as numbers even inside a fake-tensor trace.

``torchtsp.trace`` runs the real training step under ``FakeTensorMode``, where a tensor has a shape but no values,
so reading one (``.item()``, ``.tolist()``, a comparison's truth) cannot work. A few values of a step are not model
data but host bookkeeping that exists before the step and is real in a trace too: the model's initial seed drawn
from the CPU generator, the mesh's table of ranks, the host batch a check reads. ``on_host()`` evaluates such
reads on the real tensors they belong to; outside a trace it changes nothing.
"""

from __future__ import annotations

import contextlib


def on_host() -> contextlib.AbstractContextManager:
    """A block in which tensor operations run on real (host) tensors even when a fake-tensor mode is active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
