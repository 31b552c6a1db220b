"""The sequences on one rank: rank 0's step plans run on any inference engine over a paged KV pool.

Every rank holds the same ``BatchRunner`` state and applies the same step plans in the same order, so the
sequences, their tokens and the tokens chosen agree everywhere without more messages. The KV cache is a pool
of blocks (``infer.cache.KVPool``) sized by the server's budget; rank 0's scheduler (``paged_scheduler``)
owns the block tables and sends each step's with the plan, so a rank never decides where a token goes.

A step: requests cancelled by the plan are forgotten (their blocks are already free on rank 0); admitted ones
get their state (sampler, grammar); the plan's prefill chunks run as one batch, each sequence from its own
first position (a chunk after a cached prefix, a prompt's next chunk, or a preempted sequence's recompute of
its prompt and generated tokens), padded to a common length; a sequence whose chunk reaches its last token
gets its next token; then every decoding sequence feeds its last token and gets the next one. Attention reads
positions through the block tables (cache.py), so a sequence computes what it would alone.

Token choice is per sequence: greedy rows take the argmax; a sampling row draws its Gumbel noise from its
own generator seeded by the request's seed (the draw ``generate`` makes for a one-prompt batch), so a
request's tokens never depend on what else is in the batch, nor on a preemption (the generator lives with
the sequence's state, which a preemption keeps; the one exception, a dynamic-NTK sequence past its trained
context, whose recomputed K/V are one forward's: docs/inference.md).

Before the choice, each rank applies a sequence's logit_bias and repetition, frequency and presence penalties to
its own columns of the logits (penalties.py), then masks them: the ids that would end a sequence (EOS, its stop
ids) while it has fewer than ``min_tokens`` tokens, and what a sequence's grammar forbids (structured.py). A
sampling row's temperature, top-k, top-p and min-p apply to the gathered distribution.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from ..infer.logprobs import vocab_logprobs
from ..infer.sampling import TokenSelector
from .penalties import penalize_slice, sampling_scores
from .plan import Admission, StepPlan


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Sequence:
    request: Admission
    tokens: list[int]  # the prompt, then the tokens chosen so far
    sampler: TokenSelector | None = None  # its noise generator (sampling only)
    matcher: object | None = None  # its xgrammar GrammarMatcher (structured output only)
    finish: str | None = None
    started: bool = False  # its first token was chosen (a recompute after a preemption is not a start)
    prompt_logprobs: list = field(default_factory=list)  # (logprob, top) of prompt tokens 1.. (echo), so far

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def last(self) -> int:
        return self.tokens[-1]


@dataclass
class StepResult:
    tokens: list[tuple[int, int]] = field(default_factory=list)  # (request id, token), in order of choice
    finished: list[tuple[int, str]] = field(default_factory=list)  # (request id, "stop" | "length" | "bad_grammar")
    # Requests whose tokens of the step this rank ran, so their K/V are in the cache: only these advance on rank
    # 0's scheduler and may give it blocks for the prefix cache (a refused request's blocks hold nothing).
    written: list[int] = field(default_factory=list)
    # How each grammar of the plan's ``poll`` stands on this rank (1 compiled, 0 compiling, -1 failed); the worker
    # takes the minimum over the ranks before rank 0 reads it.
    grammar_states: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # requests whose prefill ended (first token chosen)
    # (request id, logprob, [(id, logprob)] top first) of each chosen token whose request asks for logprobs
    logprobs: list[tuple[int, float, list]] = field(default_factory=list)
    # (request id, [None, (logprob, top), ...]) of each prompt token, when a request's prefill ends (echo)
    prompt_logprobs: list[tuple[int, list]] = field(default_factory=list)


class BatchRunner:
    """The engine, its KV pool of ``num_blocks`` blocks (pages, shared by the model's block groups) of ``block_size``
    slots, and the sequences' state."""

    def __init__(self, engine, num_blocks: int, block_size: int, schedule: str = "auto",
                 eos_token_id: int | None = None, grammars=None):
        self.engine, self.cfg, self.schedule, self.eos = engine, engine.cfg, schedule, eos_token_id
        self.grammars = grammars  # structured.Grammars, or None: a request with a grammar is refused
        # Request id -> its grammar's compile, running on the compiler's threads while steps go on (a grammar can
        # take seconds); rank 0 schedules the request once it has compiled on every rank.
        self.compiling: dict[int, concurrent.futures.Future] = {}
        self.token_multiple = engine.token_multiple
        # The model's block groups (kv_layouts.KVGroups) share the pool's pages.
        self.pool = engine.kv_pool(num_blocks, block_size, grouped=True)
        self.seqs: dict[int, Sequence] = {}
        self.device = engine.device
        self.greedy = TokenSelector(engine.vocab_comm, self.cfg.vocab_size, engine.vocab_start, 1, slice(0, 1),
                                    0.0, None, None, 0, self.device)

    @property
    def block_tokens(self) -> int:
        """Tokens of a sequence one block id covers (block_size x the ranks sharing its tokens)."""
        return self.pool.block_tokens

    # -- one step, on every rank --------------------------------------------------------

    def step(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        with torch.inference_mode():
            for rid in plan.cancel:
                self.seqs.pop(rid, None)
                if rid in self.compiling:
                    self.compiling.pop(rid).cancel()
            for a in plan.admit:
                self.seqs[a.request_id] = Sequence(a, list(a.prompt), sampler=self._sampler(a))
                if a.grammar is not None:
                    self.compiling[a.request_id] = self._compile(a.grammar)
            self._attach_matchers(plan, result)
            prefill = [(self.seqs[r], start, n) for r, start, n in plan.prefill if r in self.seqs]
            if prefill:
                self._prefill(prefill, plan.tables, result)
                result.written += [s.request_id for s, _, _ in prefill]
            decode = [self.seqs[r] for r in plan.decode if r in self.seqs]
            if decode:
                self._decode(decode, plan.tables, result)
                result.written += [s.request_id for s in decode]
        result.grammar_states = [self.grammar_state(rid) for rid in plan.poll]
        return result

    def _attach(self, seqs: list[Sequence], tables: dict, cached: list[int], after: list[int],
                whole: list[int] | None = None) -> None:
        """Give the engine the sequences' block tables, how many tokens each has cached and will have after the
        step (and ``whole``: once their prefill is done, the length a context-dependent RoPE table reads)."""
        rows = [tables[s.request_id] for s in seqs]  # per sequence, its table in each block group
        groups = len(self.pool.groups.windows)
        short = [s.request_id for s, r, n in zip(seqs, rows, after)
                 if len(r) != groups or any(len(t) * self.block_tokens < n for t in r)]
        if short:  # a token would land in another sequence's block (tables are padded with block 0)
            raise RuntimeError(f"the plan's block tables of requests {short} do not cover this step's tokens in each "
                               f"of the {groups} block groups; rank 0's scheduler and the ranks disagree")
        index = torch.zeros(groups, len(rows), max(len(t) for r in rows for t in r), dtype=torch.long)
        for i, r in enumerate(rows):
            for g, t in enumerate(r):
                index[g, i, :len(t)] = torch.tensor(t, dtype=torch.long)
        self.engine.attach_cache(self.pool.rows(index, torch.tensor(cached, dtype=torch.long)))
        self.engine.cache.expect(after, whole)

    def _compile(self, grammar: tuple[str, str]) -> concurrent.futures.Future:
        """The grammar's matcher, compiling on the compiler's threads (xgrammar lets go of the GIL meanwhile)."""
        if self.grammars is None:
            failed = concurrent.futures.Future()
            failed.set_exception(RuntimeError("this server was started without structured output"))
            return failed
        return self.grammars.pool.submit(self.grammars.matcher, *grammar)

    def grammar_state(self, rid: int) -> int:
        """1: the request's grammar compiled on this rank; 0: still compiling; -1: it failed (or is unknown)."""
        future = self.compiling.get(rid)
        if future is None:
            return -1
        if not future.done():
            return 0
        return -1 if future.cancelled() or future.exception() is not None else 1

    def _attach_matchers(self, plan: StepPlan, result: StepResult) -> None:
        """Scheduled requests take their compiled grammar (rank 0 schedules one only once every rank compiled it,
        so this does not wait); one whose compile failed here after all ends "bad_grammar" without running."""
        for rid in [*(r for r, _, _ in plan.prefill), *plan.decode]:
            future = self.compiling.pop(rid, None)
            if future is None or rid not in self.seqs:
                continue
            try:
                self.seqs[rid].matcher = future.result()
            except Exception:  # noqa: BLE001 - the HTTP side compiled it; whatever still fails fails that request
                del self.seqs[rid]
                result.finished.append((rid, "bad_grammar"))

    def _prefill(self, work: list[tuple[Sequence, int, int]], tables: dict, result: StepResult) -> None:
        """The plan's chunks (sequence, first position, tokens) as one batch, right padded to a common multiple of
        the engine's token multiple; the sequences whose chunk ends at their last token get their next token."""
        engine, seqs = self.engine, [s for s, _, _ in work]
        T = round_up(max(n for _, _, n in work), self.token_multiple)
        ids = torch.zeros(len(work), T, dtype=torch.long)
        for i, (seq, start, n) in enumerate(work):
            ids[i, :n] = torch.tensor(seq.tokens[start:start + n])
        starts = torch.tensor([start for _, start, _ in work])
        counts = torch.tensor([n for _, _, n in work])
        pos = (starts.unsqueeze(1) + torch.arange(T)).to(self.device)
        valid = (torch.arange(T) < counts.unsqueeze(1)).to(self.device)
        engine.choose_schedule(self.schedule, len(work), T)
        self._attach(seqs, tables, starts.tolist(), (starts + counts).tolist(), [len(s.tokens) for s in seqs])
        echo = [i for i, (seq, start, _) in enumerate(work) if seq.request.prompt_logprobs is not None
                and len(seq.prompt_logprobs) < len(seq.request.prompt) - 1]
        last = engine.prefill_chunk(ids.to(self.device), pos, valid, (starts + counts).to(self.device),
                                    all_positions=echo or None)
        if echo:
            last, hidden = last
            for j, i in enumerate(echo):
                self._prompt_logprobs(seqs[i], hidden[j], work[i][1])
        done = [i for i, (seq, start, n) in enumerate(work) if start + n == len(seq.tokens)]
        if not done:
            return
        logits = engine.head(engine.finish_last(last))[done]
        ending = [seqs[i] for i in done]
        for seq in [s for s in ending if not s.started]:
            result.admitted.append(seq.request_id)
            if seq.request.prompt_logprobs is not None:
                result.prompt_logprobs.append((seq.request_id, [None, *seq.prompt_logprobs]))
        self._take(ending, logits, result)

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, c0: int) -> None:
        """The log-probabilities of the prompt tokens that positions c0.. of this chunk predict (position t's
        hidden state, hidden [T, h], predicts token t + 1), appended to the sequence's, from the first position
        it has none for (a recompute after a preemption does not count them twice). Collective: every rank runs
        it for the same sequences and chunks (they are the plan's)."""
        begin = max(c0, len(seq.prompt_logprobs))
        end = min(c0 + hidden.shape[0], len(seq.request.prompt) - 1)  # the last position predicts a new token
        if end <= begin:
            return
        engine, prompt = self.engine, seq.request.prompt
        targets = torch.tensor(prompt[begin + 1:end + 1], device=self.device)
        lp, top_lp, top_ids = vocab_logprobs(engine.head(hidden[begin - c0:end - c0]), targets, engine.vocab_start,
                                             engine.vocab_comm, seq.request.prompt_logprobs)
        seq.prompt_logprobs += _entries(lp, top_ids, top_lp)

    def _token_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, chosen: list[int],
                        result: StepResult) -> None:
        """The chosen tokens' log-probabilities under the raw model distribution (log_softmax of the logits they
        were chosen from, before temperature and filters, as vLLM returns them), for the sequences that ask."""
        want = [i for i, s in enumerate(seqs) if s.request.logprobs is not None]
        if not want:  # the same on every rank: the requests come from the plan
            return
        engine = self.engine
        top_n = max(seqs[i].request.logprobs for i in want)
        targets = torch.tensor([chosen[i] for i in want], device=self.device)
        lp, top_lp, top_ids = vocab_logprobs(logits[want], targets, engine.vocab_start, engine.vocab_comm, top_n)
        entries = _entries(lp, top_ids, top_lp)
        for i, (lp, top) in zip(want, entries):
            result.logprobs.append((seqs[i].request_id, lp, top[:seqs[i].request.logprobs]))

    def _decode(self, seqs: list[Sequence], tables: dict, result: StepResult) -> None:
        engine = self.engine
        ids = torch.tensor([s.last for s in seqs], device=self.device)
        pos = [len(s.tokens) - 1 for s in seqs]
        engine.choose_schedule(self.schedule, len(seqs), 1)
        self._attach(seqs, tables, pos, [p + 1 for p in pos])
        self._take(seqs, engine.decode(ids, torch.tensor(pos, device=self.device)), result)

    def _sampler(self, a: Admission) -> TokenSelector | None:
        s = a.sampling
        if s.temperature == 0:
            return None
        engine = self.engine
        return TokenSelector(engine.vocab_comm, self.cfg.vocab_size, engine.vocab_start, 1, slice(0, 1),
                             s.temperature, s.top_k, s.top_p, s.seed, self.device)

    def choose(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Next token of each sequence from its rows of vocabulary-sliced logits [n, cols] (collective)."""
        if all(s.sampler is None for s in seqs):
            return self.greedy.argmax_over_slices(logits).tolist()
        full = self.greedy.gather_full(logits)  # [n, V]: sampling rows need the whole distribution
        ids = full.nan_to_num(nan=float("-inf")).argmax(dim=-1)
        for i, s in enumerate(seqs):
            if s.sampler is None:
                continue
            scores = sampling_scores(full[i:i + 1], s.request.sampling)
            ids[i] = (scores + s.sampler.gumbel()).nan_to_num(nan=float("-inf")).argmax(dim=-1)[0]
        return ids.tolist()

    def _penalize(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits slice with each sequence's logit_bias and repetition, frequency and presence penalties
        (penalties.py; no collective)."""
        rows = [(s.request.sampling, s.request.prompt, s.tokens[len(s.request.prompt):])
                if s.request.sampling.penalized else None for s in seqs]
        return penalize_slice(logits, self.engine.vocab_start, rows)

    def _ending_ids(self, s: Sequence) -> list[int]:
        """The ids that end ``s`` when chosen: EOS (unless ignore_eos) and its stop ids."""
        eos = [] if self.eos is None or s.request.ignore_eos else [self.eos]
        return [*eos, *s.request.stop_token_ids]

    def _constrain(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
        """This rank's logits slice with min_tokens and grammars applied (no collective), and the rows whose grammar
        allows no token at all (they end without one). A grammar that allows nothing but an ending id wins over
        min_tokens: its text is complete."""
        from .structured import allowed_counts, mask_vocab_slice

        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        held = [i for i, s in enumerate(seqs) if s.generated < s.request.min_tokens]
        if not guided and not held:
            return logits, set()
        start, cols, ended = self.engine.vocab_start, logits.shape[-1], set()
        if guided:
            bitmask = self.grammars.bitmask([seqs[i].matcher for i in guided])
            rows = torch.tensor(guided, device=logits.device)
            logits = logits.index_copy(0, rows, mask_vocab_slice(logits[rows], bitmask, start, self.cfg.vocab_size))
            for j, i in enumerate(guided):
                ending = self._ending_ids(seqs[i])
                allowed, ending_allowed = allowed_counts(bitmask[j:j + 1], self.cfg.vocab_size, ending)
                if allowed[0] == 0:
                    ended.add(i)
                elif allowed[0] == ending_allowed[0]:
                    held = [h for h in held if h != i]
        if held:
            logits = logits.clone() if not guided else logits
            for i in held:
                local = [t - start for t in self._ending_ids(seqs[i]) if start <= t < start + cols]
                logits[i, local] = float("-inf")
        return logits, ended

    def _take(self, seqs: list[Sequence], logits: torch.Tensor, result: StepResult) -> None:
        """Record each sequence's new token; sequences that end leave the batch."""
        live = [i for i, s in enumerate(seqs) if s.request.max_tokens > 0]
        if len(live) < len(seqs):  # echo with max_tokens 0: its prompt's logprobs were all it asked for
            for s in seqs:
                s.finish = s.finish or (None if s.request.max_tokens > 0 else "length")
            logits = logits[live]
        growing = [seqs[i] for i in live]
        constrained, ended = self._constrain(growing, self._penalize(growing, logits))
        chosen = self.choose(growing, constrained) if growing else []
        # Logprobs of the raw model distribution (before grammars and min_tokens, as vLLM's default), for the
        # tokens actually emitted (a row whose grammar allows nothing ends without one).
        emitting = [i for i in range(len(growing)) if i not in ended]
        self._token_logprobs([growing[i] for i in emitting], logits[emitting], [chosen[i] for i in emitting], result)
        for s in seqs:
            s.started = True
        for i, (s, token) in enumerate(zip(growing, chosen)):
            if i in ended:
                s.finish = "stop"
                continue
            s.tokens.append(token)
            result.tokens.append((s.request_id, token))
            if s.matcher is not None and (not s.matcher.accept_token(token) or s.matcher.is_terminated()):
                s.finish = "stop"  # the grammar is complete (or, never expected, refused the token it allowed)
            elif (token == self.eos and not s.request.ignore_eos) or token in s.request.stop_token_ids:
                s.finish = "stop"
            elif s.generated >= s.request.max_tokens:
                s.finish = "length"
        for s in [s for s in seqs if s.finish is not None]:
            del self.seqs[s.request_id]
            result.finished.append((s.request_id, s.finish))


def _entries(logprobs: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> list[tuple[float, list]]:
    """``vocab_logprobs``'s answer as plain values: (logprob, [(id, logprob), ...] best first) per row."""
    return [(lp, list(zip(ids, lps))) for lp, ids, lps in
            zip(logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist())]
