"""Choosing the next token from vocabulary-sharded logits, identically on every rank and at every D.

Each rank holds the logits of one vocabulary slice ``[B, V_pad/D]`` (columns past the real vocabulary
are -inf). Greedy: each rank takes the max over its slice and one all-gather of (value, index) picks
the winner; the first rank holding the maximum wins, so ties go to the lowest id, as with argmax.

Sampling is Gumbel-max: argmax(logits/T + G) with G ~ Gumbel(0, 1) i.i.d. per vocabulary entry is an
exact sample of softmax(logits/T). Every rank seeds the same generator and draws G for the WHOLE
batch and the WHOLE (unpadded) vocabulary in the same order every step, then uses its own slice, so
the noise attached to each (sequence, token id) does not depend on D, on the scheme or on which rank
holds the row: the same seed gives the same tokens everywhere. Top-k / top-p need the whole
distribution: the slices are all-gathered (B·V per step is small in decode) and every rank applies
the same filter to the same numbers.
"""

from __future__ import annotations

import math

import torch


def check_sampling(temperature, top_k, top_p) -> None:
    """ValueError (the same on every rank) unless temperature is a finite number >= 0, top_k None or an integer
    >= 1, and top_p None or a number in (0, 1]; NaN and infinity are refused (softmax(logits / inf) is the
    uniform distribution only in exact arithmetic: in floats every score becomes 0 or NaN)."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Scaled logits [B, V] with tokens outside top-k, then outside the top-p nucleus, set to -inf.

    Top-p keeps the smallest set of most likely tokens whose probability reaches p (at least one);
    ties at the top-k boundary are all kept.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
        drop = mass_before >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


class TokenSelector:
    """``selector(logits_slice) -> next ids [B]`` for the rows ``rows`` of a global batch of ``batch`` sequences.

    ``comm`` is the axis the vocabulary is split over (a one-rank comm when every rank has all of it),
    ``vocab_start`` the first id of this rank's slice.
    """

    def __init__(self, comm, vocab_size: int, vocab_start: int, batch: int, rows: slice, temperature: float,
                 top_k: int | None, top_p: float | None, seed: int, device):
        check_sampling(temperature, top_k, top_p)
        self.comm, self.V, self.start, self.batch, self.rows = comm, vocab_size, vocab_start, batch, rows
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def gumbel(self) -> torch.Tensor:
        """Noise [B_global, V] drawn identically on every rank; this rank's rows."""
        u = torch.rand(self.batch, self.V, generator=self.generator, device=self.device)
        noise = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
        padding_rows = max(0, self.rows.stop - self.batch)  # DP pads the batch to equal shares
        return torch.nn.functional.pad(noise, (0, 0, 0, padding_rows))[self.rows]

    def argmax_over_slices(self, scores: torch.Tensor) -> torch.Tensor:
        """Global argmax of [B, cols] scores split by columns over ``comm`` (lowest id among ties). Padding
        columns and NaN scores (argmax would pick a NaN) never win, so the id is always in [0, vocab)."""
        real = torch.arange(self.start, self.start + scores.shape[-1], device=scores.device) < self.V
        scores = scores.nan_to_num(nan=float("-inf")).masked_fill(~real, float("-inf"))
        index = scores.argmax(dim=-1)  # the first maximum: the lowest id
        value = scores.gather(1, index.unsqueeze(1)).squeeze(1)
        # float64 holds both the float32 value and any vocabulary index exactly: one all-gather.
        both = self.comm.all_gather(torch.stack([value.double(), (index + self.start).double()]),
                                    label="infer.select")  # [D, 2, B]
        winner = both[:, 0].argmax(dim=0, keepdim=True)  # first rank with the maximum
        return both[:, 1].gather(0, winner).squeeze(0).long()

    def gather_full(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice -> [B, V] (padding columns dropped)."""
        gathered = self.comm.all_gather(logits.contiguous(), label="infer.logits")  # [D, B, cols]
        return gathered.movedim(0, 1).flatten(1)[:, : self.V]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return self.argmax_over_slices(logits)
        noise = self.gumbel()
        if self.top_k is None and self.top_p is None:
            cols = logits.shape[-1]
            own = noise[:, self.start: self.start + cols]
            own = torch.nn.functional.pad(own, (0, cols - own.shape[1]))  # padding columns stay -inf
            return self.argmax_over_slices(logits / self.temperature + own)
        full = filter_logits(self.gather_full(logits) / self.temperature, self.top_k, self.top_p)
        return (full + noise).nan_to_num(nan=float("-inf")).argmax(dim=-1)
