"""Log-probabilities from vocabulary-sharded logits, exactly, without gathering the vocabulary.

Each rank holds the float32 logits of one vocabulary slice, ``[N, cols]`` (padding columns -inf), as the
selector does. ``log p(t) = logit(t) - LSE`` over the whole vocabulary; the LSE is merged from each slice's
(max, sum of exp(x - max)), the online LSE the loss uses, and the top-N are the best N of the D slices' N
candidates each. One all-gather of ``[3 + 2N, rows]`` float64 values per call (float64 holds a float32 and any
vocabulary id exactly), and every rank computes the same answer from the same numbers: the bytes moved are
O(D · N · rows), never O(vocabulary).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def vocab_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, comm,
                   top_n: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target_logprobs [rows], top_logprobs [rows, top_n], top_ids [rows, top_n])`` of this rank's logits
    slice ``[rows, cols]`` (columns ``vocab_start ..``) over the vocabulary split along ``comm``. ``targets``
    [rows] are global ids (a negative id gives NaN: no target). Top entries are ordered by probability, ties by
    the lower id, as a stable sort of the whole vocabulary orders them."""
    packed = logprob_part(logits, targets, vocab_start, top_n)
    every = comm.all_gather(packed, label="infer.logprobs") if comm.size > 1 else packed.unsqueeze(0)
    return merge_logprob_parts(every, targets, top_n)


def logprob_part(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, top_n: int) -> torch.Tensor:
    """What one rank contributes for its slice ``[rows, cols]`` (columns ``vocab_start ..``): ``[3 + 2N, rows]``
    float64 rows of (max, sum of exp(x - max), the target's logit or -inf where another slice owns it, the
    slice's top-N values, their global ids). Pure: the all-gather is the caller's."""
    x = logits.float()
    rows, cols = x.shape
    peak = x.amax(dim=-1)
    shift = torch.where(torch.isfinite(peak), peak, 0.0)  # a slice of padding only: its sum is 0
    total = torch.exp(x - shift.unsqueeze(1)).sum(dim=-1)
    local = targets - vocab_start
    owned = (local >= 0) & (local < cols)
    target = torch.where(owned, x.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1), NEG_INF)
    values, index = _top(x, min(top_n, cols))
    values = torch.nn.functional.pad(values, (0, top_n - values.shape[1]), value=NEG_INF)
    ids = torch.nn.functional.pad(index + vocab_start, (0, top_n - index.shape[1]), value=-1)
    return torch.cat([torch.stack([peak, total, target]), values.T, ids.T.float()]).double()


def merge_logprob_parts(every: torch.Tensor, targets: torch.Tensor,
                        top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The D ranks' ``logprob_part``s stacked ``[D, 3 + 2N, rows]`` -> ``vocab_logprobs``'s answer: the LSE
    merged from each slice's (max, sum) rescaled to the highest max, the target's logit from the slice that owns
    it, the best N of the D x N candidates. Every rank computes it from the same numbers."""
    rows = every.shape[2]
    peaks, totals = every[:, 0], every[:, 1]  # [D, rows]
    high = peaks.amax(dim=0)
    high_shift = torch.where(torch.isfinite(high), high, 0.0)
    lse = high_shift + torch.log((totals * torch.exp(peaks - high_shift)).sum(dim=0))
    target_lp = every[:, 2].amax(dim=0) - lse
    target_lp = torch.where(targets >= 0, target_lp, float("nan"))
    cand_values = every[:, 3:3 + top_n].permute(2, 0, 1).reshape(rows, -1)  # [rows, D * top_n]
    cand_ids = every[:, 3 + top_n:].permute(2, 0, 1).reshape(rows, -1)
    best, where = _top(cand_values, top_n, cand_ids)
    return target_lp.float(), (best - lse.unsqueeze(1)).float(), cand_ids.gather(1, where).long()


def _top(values: torch.Tensor, n: int, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest values per row and their positions, ties broken by the lower id (the position itself
    when ``ids`` is None): topk alone orders ties arbitrarily."""
    if n == 0:
        return values[:, :0], torch.zeros(values.shape[0], 0, dtype=torch.long, device=values.device)
    key = torch.arange(values.shape[1], device=values.device).expand_as(values) if ids is None else ids
    by_id = key.argsort(dim=1, stable=True)
    by_value = values.gather(1, by_id).argsort(dim=1, descending=True, stable=True)[:, :n]
    where = by_id.gather(1, by_value)
    return values.gather(1, where), where
