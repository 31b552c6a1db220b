"""``torchtsp bench``: every scheme on the same model, batch and ranks, measured against the analytic model.

``args.add_bench_arguments(parser)`` (torch-free) declares the flags; ``run.run_bench(args)`` runs the sweep
(or the ``--max-seq-under`` search) and writes JSON, a markdown table and plots (``report``).
"""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
