"""One optimizer step's forward and backward over ``grad_accum`` micro-batches, and forward-only evaluation.

The loss of a step is the mean over every target of the global batch, however it is split: each micro-batch
contributes its summed NLL divided by the target count of the whole batch (known from the labels before any
forward), so the gradients accumulated over micro-batches are those of the unsplit batch. A mixture-of-experts
model's load-balancing loss is over the whole batch too: it multiplies per-expert assignment counts (not
differentiated) by probability sums, so with the whole batch's counts it is a sum of one term per micro-batch.
Those counts come from a forward-only pass over the micro-batches first (one extra forward per step, only for
MoE models with ``grad_accum > 1``).
"""

from __future__ import annotations

import torch

from ..layers import as_documents
from ..memory import next_pass
from ..model import IGNORE_INDEX


def _micro(tokens: torch.Tensor, labels: torch.Tensor, document_ids, n: int):
    """(tokens, labels, document ids or None) of each of ``n`` micro-batches (rows split evenly)."""
    ids = [None] * n if document_ids is None else document_ids.chunk(n, dim=0)
    return list(zip(tokens.chunk(n, dim=0), labels.chunk(n, dim=0), ids))


def _loss_terms(model, tokens, labels, document_ids):
    model.check_inputs(tokens, labels)
    documents = model.shard_documents(as_documents(document_ids, tokens.shape))
    return model.loss_terms(model.shard_batch(tokens), model.shard_batch(labels), documents)


@torch.no_grad()
def _router_totals(model, micro) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments per expert, rows) over the whole batch, every rank's tokens, from a forward-only pass."""
    counts = rows = 0
    for batch in micro:
        next_pass()
        c, _, r = model.sum_router_stats(_loss_terms(model, *batch).router.close())
        counts, rows = counts + c, rows + r
    return counts, rows


def _pipeline_forward_backward(model, micro, total) -> torch.Tensor:
    """A pipeline runs forward and backward in one schedule; each micro-batch's loss is divided by the target
    count of the whole batch, so micro-batches of any target counts (document masks ignore some) add up."""
    loss = 0
    for tokens, labels, ids in micro:
        next_pass()
        loss = loss + model.forward_backward(tokens, labels, ids, target_count=total)
    return loss


def forward_backward(model, tokens: torch.Tensor, labels: torch.Tensor, grad_accum: int,
                     document_ids=None) -> torch.Tensor:
    """The global batch's loss (detached, the same on every rank); gradients accumulate into ``.grad``.
    ``document_ids``: packed rows (``ParallelTransformer.loss``)."""
    if grad_accum == 1:
        return model.forward_backward(tokens, labels, document_ids)
    micro = _micro(tokens, labels, document_ids, grad_accum)
    total = (labels != IGNORE_INDEX).sum().to(torch.float32).clamp_min(1).to(tokens.device)
    if model.joint_forward_backward:
        return _pipeline_forward_backward(model, micro, total)
    cfg = model.cfg
    if cfg.moe:
        counts, rows = _router_totals(model, micro)
    loss_total, aux_total = torch.zeros((), device=tokens.device), torch.zeros((), device=tokens.device)
    for batch in micro:
        next_pass()
        terms = _loss_terms(model, *batch)
        loss = terms.nll_sum / total
        if cfg.moe:  # this micro-batch's share of the whole batch's load-balancing loss
            aux = model.aux_loss(terms.router, totals=(counts, rows))
            loss = loss + cfg.router_aux_loss_coef * aux
            aux_total += aux.detach()
        loss.backward()
        loss_total += loss.detach()
    if cfg.moe:  # what router_metrics reports after an unsplit step
        model.router_load = (aux_total, counts)
    return loss_total


@torch.no_grad()
def evaluate(model, batches, grad_accum: int) -> float:
    """Mean NLL over every target of ``batches`` ((tokens, labels, document ids or None) each), forward only,
    a micro-batch at a time."""
    nll = count = 0.0
    for batch in batches:
        for m_tokens, m_labels, m_ids in _micro(*batch, grad_accum):
            next_pass()
            model.check_inputs(m_tokens, m_labels)
            documents = model.shard_documents(as_documents(m_ids, m_tokens.shape))
            s, c = model.nll_sum_and_count(model.shard_batch(m_tokens), model.shard_batch(m_labels), documents)
            nll, count = nll + s.item(), count + c.item()
    return nll / max(count, 1.0)
