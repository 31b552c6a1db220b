"""Submodules as attributes on first use (PEP 562), so that ``import torchtsp`` alone makes every dotted name the
docs show work (``torchtsp.train.zero.ZeroOptimizer``) while importing nothing heavy: a package's submodule (and
torch, if it needs it) is imported when the name is first read, not when the package is."""

from __future__ import annotations

import importlib
import importlib.util


def submodule_getattr(package: str):
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` when ``name`` is one of its
    submodules; any other missing name raises AttributeError, as a module without one would."""

    def __getattr__(name: str):
        # Dunder probes (copy, pickle, doctest, IPython) never name a submodule: answer them without a file search.
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
