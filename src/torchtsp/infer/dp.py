"""DP inference: every rank holds the whole model and decodes its own rows of the batch (no communication
until the end, when the rows are all-gathered so that every rank returns every prompt's tokens)."""

from __future__ import annotations

from dataclasses import replace

from ..distributed.comm import AxisComm
from ..parallel.base import ShardView
from .tp import MegatronEngine


class DPEngine(MegatronEngine):
    scheme = "dp"

    def __init__(self, view: ShardView):
        # The whole model on every rank (no slices): a one-rank engine; ``view.comm`` splits the batch rows.
        super().__init__(replace(view, comm=AxisComm(None, "dp.model")))
        self.rows_comm = view.comm

    def batch_rows(self, batch):
        """Rank r decodes rows [r·b, (r+1)·b) with b = ceil(B/D); rows past B are padding (dropped)."""
        per_rank = -(-batch // self.rows_comm.size)
        return slice(self.rows_comm.rank * per_rank, (self.rows_comm.rank + 1) * per_rank)
