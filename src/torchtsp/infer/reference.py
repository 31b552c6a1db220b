"""The single-device reference ``Transformer`` through the Megatron engine with one rank: a plain cache."""

from __future__ import annotations

from ..distributed.comm import AxisComm
from ..parallel.base import reference_view
from .tp import MegatronEngine


class ReferenceEngine(MegatronEngine):
    scheme = "reference"

    def __init__(self, model):
        super().__init__(reference_view(model, AxisComm(None, "reference")))
