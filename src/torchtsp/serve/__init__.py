"""``torchtsp serve``: an OpenAI-compatible HTTP server over the inference engines, with continuous batching.

* ``batch``: the running batch on every rank (rows join and leave at step boundaries; per-request sampling);
* ``plan``: the step plan rank 0 broadcasts to every rank each step (int64 tensors, no pickle);
* ``worker``: what each rank runs; rank 0's scheduler;
* ``client``: the HTTP process's channel to rank 0;
* ``protocol``, ``text``, ``app``, ``metrics``: the OpenAI API (validation, detokenization, chat templates,
  streaming, Prometheus figures);
* ``server``: the launcher (``torchtsp serve``); ``args``: its flags.

The HTTP side needs the ``serve`` extra (``pip install 'torchtsp[serve]'``); this package imports nothing of it
until the server starts.
"""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
