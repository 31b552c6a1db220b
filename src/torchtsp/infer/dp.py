"""DP inference: every rank holds the whole model and decodes its own rows of the batch (no communication
until the end, when the rows are all-gathered so that every rank returns every prompt's tokens)."""

from __future__ import annotations

from .reference import ReferenceEngine


class DPEngine(ReferenceEngine):
    scheme = "dp"

    def __init__(self, model):
        super().__init__(model.module.module)  # DataParallel over Replica over the reference Transformer
        self.rows_comm = model.dp

    def batch_rows(self, batch):
        """Rank r decodes rows [r·b, (r+1)·b) with b = ceil(B/D); rows past B are padding (dropped)."""
        per_rank = -(-batch // self.rows_comm.size)
        return slice(self.rows_comm.rank * per_rank, (self.rows_comm.rank + 1) * per_rank)
