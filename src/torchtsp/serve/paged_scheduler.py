"""Rank 0's scheduling policy over the paged cache (docs/design.md, "Serving: the paged cache"): a pure class,
driven step by step (``schedule`` then ``update`` with the step's sampled tokens), that owns the waiting
queue, the running sequences and the ``KVBlockManager``.

Every sequence carries all its tokens (prompt, then generated) and how many of them have K/V in the cache;
a step computes the next tokens of each scheduled sequence, and one that reaches its last token samples the
next. So a decode is a one-token step, a prompt is prefilled in chunks, and a preempted sequence is simply
reset to nothing computed: its prompt and generated tokens become the prompt it recomputes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .blocks import KVBlockManager, extend_chain
from .plan import StepPlan


class RequestTooLong(ValueError):
    """A request that could never fit the whole cache (a 400 for the HTTP side)."""


@dataclass
class ScheduledSeq:
    """What rank 0's scheduler knows of a sequence: its tokens and how many have K/V in the cache. (The ranks'
    own state of it, its sampler and grammar, is ``batch.Sequence``.)"""

    seq_id: int
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    max_tokens: int
    arrival: int
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: str = "waiting"  # waiting | running | preempted | finished
    use_prefix_cache: bool = True  # False: every position is computed (a request for its prompt's logprobs)
    chain: list[bytes] = field(default_factory=list)  # content addresses of its full blocks, hashed once each
    # The length its last scheduled step's RoPE table read (a prefill chunk and a decode both read all its tokens:
    # ``infer.cache.KVCache.rope_lengths``).
    table_length: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


def scheduled(plan: StepPlan) -> dict[int, int]:
    """Tokens each sequence of ``plan`` computes."""
    return {**{s: n for s, _, n in plan.prefill}, **dict.fromkeys(plan.decode, 1)}


class PagedScheduler:
    """FIFO admission by free blocks, a per-step token budget and a sequence cap; preemption of the newest."""

    def __init__(self, blocks: KVBlockManager, max_num_batched_tokens: int = 2048, max_num_seqs: int = 16,
                 max_prefill_chunk: int | None = None, rebuild_at: int | None = None):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs "
                             f"({max_num_seqs}) must be >= 1")
        self.blocks = blocks
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_prefill_chunk = max_prefill_chunk  # tokens of one prompt per step at most (None: the budget)
        # LongRoPE's switch (``rope.RopeSpec.switch_length``): a sequence grown past it is computed again.
        self.rebuild_at = rebuild_at
        self.waiting: collections.deque[ScheduledSeq] = collections.deque()
        self.running: list[ScheduledSeq] = []  # in admission order: the last is the newest
        self.seqs: dict[int, ScheduledSeq] = {}
        self.num_preemptions = 0
        self._arrivals = 0
        self._step = 0
        self._pending: StepPlan | None = None  # scheduled, not yet updated

    def add_request(self, seq_id: int, prompt: Sequence[int], max_tokens: int, use_prefix_cache: bool = True) -> None:
        """Queue a request, or refuse one that could never fit the whole cache, even alone. max_tokens 0: the
        prompt only (its logprobs), which the caller finishes after the prefill."""
        if seq_id in self.seqs:
            raise ValueError(f"request id {seq_id} is already scheduled")
        self.check_request(prompt, max_tokens)
        seq = ScheduledSeq(seq_id, list(prompt), len(prompt), max_tokens, self._arrivals,
                       use_prefix_cache=use_prefix_cache)
        self._arrivals += 1
        self.seqs[seq_id] = seq
        self.waiting.append(seq)

    def check_request(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Refuse a request that could never run: no prompt, or more tokens than the whole cache holds, alone."""
        if not prompt or max_tokens < 0:
            raise ValueError(f"a request needs a prompt and max_tokens >= 0 (got {len(prompt)} tokens, "
                             f"max_tokens {max_tokens})")
        need = len(prompt) + max(max_tokens, 1) - 1  # the last sampled token is never written to the cache
        if not self.blocks.fits_ever(need):
            raise RequestTooLong(
                f"request needs {need} tokens of KV cache (prompt {len(prompt)} + max_tokens {max_tokens} - 1) "
                f"but the whole cache holds {self.blocks.capacity_tokens} tokens; shorten the prompt or "
                f"max_tokens, or raise --kv-cache-mb")

    def cancel(self, seq_id: int) -> bool:
        """Drop a request wherever it is (queued, running, preempted), freeing its blocks at once."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step: running sequences first (oldest first; decodes and unfinished prefills), then
        waiting ones in arrival order while blocks, the token budget and the sequence cap allow."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._pending.step} was scheduled but never updated: call update first")
        plan = StepPlan(self._step)
        self._step += 1
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:  # blocks just ran out: admitting now would only preempt again
            self._schedule_waiting(plan, budget)
        for seq_id in scheduled(plan):
            plan.tables[seq_id] = self.blocks.group_tables(seq_id)
        self._pending = plan
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._past_switch(seq):
                self._rebuild(seq)
                continue
            # Its sliding groups' blocks that no query from here on sees go back first (the next query is at
            # num_computed), so the chunk's blocks can take their place.
            self.blocks.free_out_of_window(seq.seq_id, seq.num_computed)
            n = self._chunk(seq, len(seq.tokens) - seq.num_computed, budget)
            while not self.blocks.append_slots(seq.seq_id, n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self._add(plan, seq, n)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.use_prefix_cache:  # the chain is hashed once, however long the head of the queue waits
                extend_chain(seq.chain, seq.tokens, self.blocks.block_tokens)
            hit = self.blocks.cached_prefix(seq.tokens, seq.chain) if seq.use_prefix_cache else []
            cached = len(hit) * self.blocks.block_tokens
            n = self._chunk(seq, len(seq.tokens) - cached, budget)
            if self.blocks.allocate(seq.seq_id, seq.tokens, n, seq.use_prefix_cache, seq.chain) is None:
                break  # FIFO: the head waits for blocks, nobody overtakes it (no starvation)
            self.waiting.popleft()
            seq.num_computed, seq.status, seq.table_length = cached, "running", len(seq.tokens)
            self.running.append(seq)
            plan.prefill.append((seq.seq_id, cached, n))  # a (re)admitted sequence always starts as a prefill
            budget -= n

    def _chunk(self, seq: ScheduledSeq, remaining: int, budget: int) -> int:
        """Tokens ``seq``, with ``remaining`` to compute, runs this step (at most what the pool holds for the step
        of a sequence of its length, alone: ``KVBlockManager.max_chunk_tokens``)."""
        cap = self.blocks.max_chunk_tokens(len(seq.tokens))
        return min(remaining, budget, self.max_prefill_chunk or remaining, remaining if cap is None else cap)

    def _add(self, plan: StepPlan, seq: ScheduledSeq, n: int) -> None:
        seq.table_length = len(seq.tokens)
        if n == 1 and seq.num_computed == len(seq.tokens) - 1 and seq.num_generated > 0:
            plan.decode.append(seq.seq_id)
        else:
            plan.prefill.append((seq.seq_id, seq.num_computed, n))

    def _past_switch(self, seq: ScheduledSeq) -> bool:
        """Whether ``seq`` grew past LongRoPE's switch while its cache holds K/V of the table before it."""
        return (self.rebuild_at is not None and seq.num_computed > 0
                and seq.table_length <= self.rebuild_at < len(seq.tokens))

    def _rebuild(self, seq: ScheduledSeq) -> None:
        """Free ``seq``'s blocks and put it first in the queue, to be computed again from position 0 (its prompt and
        generated tokens, with the table past the switch), as transformers' Phi-3 drops its cache there."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed, seq.status = 0, "waiting"
        self.waiting.appendleft(seq)

    def _preempt(self, seq: ScheduledSeq, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed, seq.status = 0, "preempted"
        self.waiting.appendleft(seq)  # older preempted ones are pushed later, so they end up in front
        plan.preempted.append(seq.seq_id)
        self.num_preemptions += 1

    def update(self, plan: StepPlan, sampled: dict[int, int], stopped: dict[int, str], *,
               written: Iterable[int]) -> list[tuple[int, str]]:
        """After the ranks ran ``plan``: advance the scheduled sequences whose tokens the ranks ``written`` (their
        K/V are in the cache now); one that computed its last token takes its sampled token (if it has one) and
        finishes at ``max_tokens`` or when the ranks ``stopped`` it (id -> reason: they decide EOS, stop ids,
        grammars, min_tokens). Full blocks just written join the prefix cache. Returns the sequences that ended
        and why.

        A block enters the prefix cache only once the ranks say they wrote it: a scheduled sequence the ranks
        did not run (they refused it at admission, or forgot it) advances nothing and ends with their reason
        ("rejected" if they gave none), its blocks freed uncached, so no later request reuses a block that
        holds nothing."""
        if plan is not self._pending:
            raise RuntimeError(f"update of step {plan.step}, but the step in flight is "
                               f"{getattr(self._pending, 'step', None)}")
        self._pending = None
        written, ended = set(written), []
        for seq_id, n in scheduled(plan).items():
            seq = self.seqs.get(seq_id)
            if seq is None or seq.status != "running":
                continue  # cancelled while the step ran
            reason = stopped.get(seq_id)
            if seq_id in written:
                seq.num_computed += n
                self.blocks.cache_blocks(seq_id, seq.tokens, seq.num_computed)
                if seq.num_computed == len(seq.tokens):  # its last token computed: a new one was sampled
                    if seq_id in sampled:
                        seq.tokens.append(sampled[seq_id])
                    if seq.num_generated >= seq.max_tokens:
                        reason = reason or "length"
            else:
                reason = reason or "rejected"
            if reason:
                self.running.remove(seq)
                self._finish(seq)
                ended.append((seq_id, reason))
        return ended

    def abandon(self, plan: StepPlan, reason: str = "error") -> list[int]:
        """The ranks failed while running ``plan``: nothing of it counts as written. Every sequence it scheduled
        ends with ``reason``, its blocks freed and none of this step's blocks cached; returns their ids."""
        if plan is not self._pending:
            raise RuntimeError(f"abandon of step {plan.step}, but the step in flight is "
                               f"{getattr(self._pending, 'step', None)}")
        self._pending = None
        ended = []
        for seq_id in scheduled(plan):
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.status == "running":
                self.running.remove(seq)
                self._finish(seq)
                ended.append(seq_id)
        return ended

    def _finish(self, seq: ScheduledSeq) -> None:
        self.blocks.free(seq.seq_id)
        seq.status = "finished"
        del self.seqs[seq.seq_id]
