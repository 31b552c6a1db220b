"""Sampling penalties on a rank's vocabulary slice of the logits, and the sampling distribution of one request.

Each rank holds the logits of columns [vocab_start, vocab_start + cols) only. ``logit_bias`` and the
repetition, frequency and presence penalties change each column by what that column's token id did (its bias,
whether it was seen, how often it was generated), so each rank applies them to its own columns with no
collective: ``penalize_slice`` is a pure function of the slice, its first id and the request's tokens, and the
slices together are exactly the penalty applied to the full logits. They change the argmax, so greedy rows get
them too.

The order is vLLM's: the bias first, then the repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``:
a seen token's positive logit divided by it, a negative one multiplied; seen = in the prompt or generated), then
OpenAI's ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the generated tokens.

``min_p`` compares each token's probability with the likeliest one's, which needs the whole row: it applies where
sampling already gathers the whole distribution (``sampling_scores``), after temperature, top-k and top-p as
transformers' warpers run (``MinPLogitsWarper``). It never changes the argmax, so greedy rows ignore it.
"""

from __future__ import annotations

import torch

from ..infer.sampling import filter_logits
from .plan import Sampling


def _local(ids, start: int, cols: int, device) -> torch.Tensor:
    """The ids that fall in this slice, as column indices."""
    return torch.tensor([t - start for t in ids if start <= t < start + cols], dtype=torch.long, device=device)


def penalize_row(row: torch.Tensor, start: int, s: Sampling, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One sequence's logits slice [cols] (ids start..start + cols - 1) with its penalties applied (a new tensor)."""
    cols, device = row.shape[-1], row.device
    row = row.clone()
    if s.logit_bias:
        inside = [(t - start, b) for t, b in s.logit_bias.items() if start <= t < start + cols]
        if inside:
            cols_, biases = zip(*inside)
            index = torch.tensor(cols_, dtype=torch.long, device=device)
            row[index] += torch.tensor(biases, dtype=row.dtype, device=device)
    if s.repetition_penalty != 1.0:
        seen = _local(set(prompt) | set(generated), start, cols, device)
        v = row[seen]
        row[seen] = torch.where(v < 0, v * s.repetition_penalty, v / s.repetition_penalty)
    if s.frequency_penalty != 0.0 or s.presence_penalty != 0.0:
        counts = torch.bincount(_local(generated, start, cols, device), minlength=cols).to(row.dtype)
        row -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(row.dtype)
    return row


def penalize_slice(logits: torch.Tensor, start: int, rows: list) -> torch.Tensor:
    """A vocabulary slice [n, cols] of logits whose first column is id ``start``, with each row's penalties:
    ``rows[i]`` is (Sampling, prompt ids, generated ids), or None for a row without penalties. Rows without
    penalties are returned as they were (bit for bit); the input is not changed."""
    wanted = [i for i, r in enumerate(rows) if r is not None and r[0].penalized]
    if not wanted:
        return logits
    out = logits.clone()
    for i in wanted:
        out[i] = penalize_row(logits[i], start, *rows[i])
    return out


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Scores [B, V] with the tokens whose probability is below ``min_p`` times the likeliest's set to -inf
    (transformers' MinPLogitsWarper; the likeliest token always stays)."""
    if min_p <= 0.0:
        return scores
    probs = scores.softmax(dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(drop, float("-inf"))


def sampling_scores(full: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The scores [B, V] a sampling row draws from (softmax of them is its distribution): the full (penalized,
    masked) logits over temperature, then top-k, top-p and min-p."""
    scores = full / s.temperature
    if s.top_k is not None or s.top_p is not None:
        scores = filter_logits(scores, s.top_k, s.top_p)
    return min_p_filter(scores, s.min_p)
