"""The running batch on one rank: continuous batching over any inference engine's KV cache.

Every rank holds the same ``BatchRunner`` state and applies the same step plans in the same order, so the
rows, the cache slots and the tokens chosen agree everywhere without more messages. The running
sequences occupy cache rows [0, n): a sequence that leaves hands its row to the last one (a local copy of
that row's slots), so an engine always runs on one contiguous view of the cache (``KVCache.rows``).

A step: sequences cancelled by the plan leave; admitted ones become the prefill group, in the rows after the
running ones (right padded to the longest prompt); the group runs one chunk of at most ``prefill_chunk``
tokens per sequence (so a long prompt does not stall the others' decoding); when its last chunk is done
its sequences get their first token and join the running rows; then every running sequence decodes one
token; sequences that reached a stop id or ``max_tokens`` leave. One group prefills at a time.
Rows hold sequences of different lengths: each row writes after its own last slot and attention reads
positions and validity, never slot order (cache.py), so a sequence computes what it would alone.

Token choice is per sequence: greedy rows take the argmax; a sampling row draws its Gumbel noise from its
own generator seeded by the request's seed (the draw ``generate`` makes for a one-prompt batch), so a
request's tokens never depend on what else is in the batch.

Before the choice, each rank masks its own columns of the logits: the ids that would end a sequence (EOS, its
stop ids) while it has fewer than ``min_tokens`` tokens, and what a sequence's grammar forbids (structured.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..infer.logprobs import vocab_logprobs
from ..infer.sampling import TokenSelector, filter_logits
from .plan import Admission, StepPlan


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_slots(token_ranks: int, padded_prompt: int, max_tokens: int) -> int:
    """Cache slots one sequence needs on every rank: a cache whose tokens are split over ``token_ranks`` ranks
    (``Engine.kv_token_ranks``: D for a sequence-sharded one) holds that share of the padded prompt and of the
    decoded tokens; with 1 every token."""
    return padded_prompt // token_ranks + -(-(max_tokens - 1) // token_ranks)


@dataclass
class Sequence:
    request: Admission
    row: int
    generated: int = 0  # tokens chosen so far
    last: int = -1  # the last chosen token: the next decode's input
    sampler: TokenSelector | None = None  # its noise generator (sampling only)
    matcher: object | None = None  # its xgrammar GrammarMatcher (structured output only)
    finish: str | None = None
    prompt_logprobs: list = field(default_factory=list)  # (logprob, top) of prompt tokens 1.. (echo), so far

    @property
    def request_id(self) -> int:
        return self.request.request_id


@dataclass
class PrefillGroup:
    """Sequences being prefilled together in rows [first, first + k), one chunk per step."""

    seqs: list[Sequence]
    first: int
    tokens: torch.Tensor  # [k, padded prompt]
    lengths: torch.Tensor  # [k]
    last: torch.Tensor  # [k, dim]: this rank's share of each last prompt token's hidden state so far
    done: int = 0  # prompt positions prefilled
    cancelled: set = field(default_factory=set)  # leave as soon as the prefill ends


@dataclass
class StepResult:
    tokens: list[tuple[int, int]] = field(default_factory=list)  # (request id, token), in order of choice
    finished: list[tuple[int, str]] = field(default_factory=list)  # (request id, "stop" | "length" | "cancelled")
    admitted: list[int] = field(default_factory=list)
    # (request id, logprob, [(id, logprob)] top first) of each chosen token whose request asks for logprobs
    logprobs: list[tuple[int, float, list]] = field(default_factory=list)
    # (request id, [None, (logprob, top), ...]) of each prompt token, when a request's prefill ends (echo)
    prompt_logprobs: list[tuple[int, list]] = field(default_factory=list)


class BatchRunner:
    """Continuous batching of up to ``max_batch`` sequences of at most ``max_model_len`` tokens each."""

    def __init__(self, engine, max_batch: int, max_model_len: int, prefill_chunk: int = 512,
                 schedule: str = "auto", eos_token_id: int | None = None, grammars=None):
        self.engine, self.cfg, self.schedule = engine, engine.cfg, schedule
        self.max_batch, self.max_model_len, self.eos = max_batch, max_model_len, eos_token_id
        self.grammars = grammars  # structured.Grammars, or None: a request with a grammar is refused
        self._matchers: dict = {}  # request id -> matcher, from a plan's admissions to their rows
        self.token_multiple, self.token_ranks = engine.token_multiple, engine.kv_token_ranks
        self.prefill_chunk = round_up(max(1, prefill_chunk), self.token_multiple)
        # Rows sized for the worst single sequence (row_slots with max_model_len), plus one padding block of
        # slack for a prompt prefilled next to a longer one (the scheduler checks every admission against it).
        engine.start(max_batch, round_up(max_model_len, self.token_multiple) + self.token_multiple,
                     self.token_multiple + 1)
        self.cache = engine.cache
        self.capacity = self.cache.capacity
        self.rows: list[Sequence] = []  # running (decoding) sequences, in rows [0, n)
        self.prefilling: PrefillGroup | None = None
        self.decode_steps = 0  # decoded token t of the batch goes to rank t mod D (TSP, SP)
        device = engine.device
        self.device = device
        self.greedy = TokenSelector(engine.vocab_comm, self.cfg.vocab_size, engine.vocab_start, 1, slice(0, 1),
                                    0.0, None, None, 0, device)

    # -- what the scheduler asks ------------------------------------------------------

    def row_slots(self, padded_prompt: int, max_tokens: int) -> int:
        """Cache slots a sequence needs in a row of this runner's engine (``row_slots``)."""
        return row_slots(self.token_ranks, padded_prompt, max_tokens)

    def slots_used(self) -> int:
        """Cache slots this rank holds for its sequences (real tokens and prompt padding; free rows hold 0)."""
        return int(self.cache.row_fill.sum())

    def active_ids(self) -> set[int]:
        """Requests with a row: running or being prefilled."""
        group = self.prefilling.seqs if self.prefilling is not None else []
        return {s.request_id for s in (*self.rows, *group)}

    # -- one step, on every rank --------------------------------------------------------

    def step(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        cancel = set(plan.cancel)
        with torch.inference_mode():
            for seq in [s for s in self.rows if s.request_id in cancel]:
                self._leave(seq)
                result.finished.append((seq.request_id, "cancelled"))
            if self.prefilling is not None:
                self.prefilling.cancelled |= cancel
            admit = self._with_grammars(plan.admit, result)
            if admit:
                self._admit(admit)
            if self.prefilling is not None:
                self._prefill_chunk(result)
            if self.rows:
                self._decode(result)
        return result

    def _move_row(self, src: int, dst: int) -> None:
        """Row src's used slots to row dst (a local copy); row src is then free."""
        if src == dst:
            return
        cache, n = self.cache, int(self.cache.row_fill[src])
        for k in (*cache.k, *cache.v):
            k[dst, :, :n] = k[src, :, :n]
        cache.pos[dst] = cache.pos[src]
        cache.valid[dst] = cache.valid[src]
        cache.row_fill[dst] = cache.row_fill[src]
        self._clear_row(src)

    def _clear_row(self, row: int) -> None:
        self.cache.valid[row] = False  # slots past a row's count must read as empty when the row is reused
        self.cache.row_fill[row] = 0

    def _leave(self, seq: Sequence) -> None:
        """Free a running sequence's row; the last running row moves into it."""
        last = len(self.rows) - 1
        moved = self.rows[last]
        if seq.row != last:
            self._move_row(last, seq.row)
            self.rows[seq.row], moved.row = moved, seq.row
        else:
            self._clear_row(last)
        self.rows.pop()

    def _with_grammars(self, admitted: list[Admission], result: StepResult) -> list[Admission]:
        """The admissions whose grammar compiles (each gets its matcher); the others finish "bad_grammar" at once.
        Compiling is deterministic, so every rank keeps the same ones."""
        self._matchers, kept = {}, []
        for a in admitted:
            if a.grammar is None:
                kept.append(a)
                continue
            try:
                if self.grammars is None:
                    raise RuntimeError("this server was started without structured output")
                self._matchers[a.request_id] = self.grammars.matcher(*a.grammar)
                kept.append(a)
            except Exception:  # noqa: BLE001 - the HTTP side parsed it; whatever still fails fails that request
                result.finished.append((a.request_id, "bad_grammar"))
        return kept

    def _admit(self, admitted: list[Admission]) -> None:
        first = len(self.rows)
        if self.prefilling is not None or first + len(admitted) > self.max_batch:
            raise RuntimeError(f"step plan admits {len(admitted)} sequences to {first} running of at most "
                               f"{self.max_batch} (or while a group prefills); the scheduler and the ranks disagree")
        prompts = [a.prompt for a in admitted]
        padded = round_up(max(len(p) for p in prompts), self.token_multiple)
        tokens = torch.zeros(len(prompts), padded, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.tensor(p, device=self.device)
        self.prefilling = PrefillGroup(
            [Sequence(a, first + i, sampler=self._sampler(a), matcher=self._matchers.pop(a.request_id, None))
             for i, a in enumerate(admitted)], first, tokens,
            torch.tensor([len(p) for p in prompts], device=self.device),
            torch.zeros(len(prompts), self.cfg.dim, dtype=self.engine.dtype, device=self.device))

    def _prefill_chunk(self, result: StepResult) -> None:
        """The group's next chunk (the last may be shorter: still a multiple of token_multiple); after the last
        one, its first tokens, and the group joins the running rows."""
        engine, g = self.engine, self.prefilling
        k, padded = g.tokens.shape
        c0, c1 = g.done, min(g.done + self.prefill_chunk, padded)
        engine.choose_schedule(self.schedule, k, c1 - c0)
        engine.attach_cache(self.cache.rows(g.first, g.first + k))
        pos = torch.arange(c0, c1, device=self.device).expand(k, c1 - c0)
        echo = [i for i, s in enumerate(g.seqs) if s.request.prompt_logprobs is not None]
        last = engine.prefill_chunk(g.tokens[:, c0:c1], pos, pos < g.lengths.unsqueeze(1), g.lengths,
                                    all_positions=echo or None)
        if echo:
            last, hidden = last
            self._prompt_logprobs([g.seqs[i] for i in echo], g.tokens[echo], hidden, c0)
        g.last += last
        g.done = c1
        if c1 < padded:
            return
        logits = engine.head(engine.finish_last(g.last))
        self.prefilling = None
        for i, seq in enumerate(g.seqs):  # down to the rows right after the running ones
            self._move_row(g.first + i, len(self.rows))
            seq.row = len(self.rows)
            self.rows.append(seq)
        result.admitted += [s.request_id for s in g.seqs]
        result.prompt_logprobs += [(g.seqs[i].request_id, [None, *g.seqs[i].prompt_logprobs]) for i in echo]
        self._take(g.seqs, logits, result)
        for seq in [s for s in g.seqs if s.request_id in g.cancelled and s.finish is None]:
            self._leave(seq)
            result.finished.append((seq.request_id, "cancelled"))

    def _prompt_logprobs(self, seqs: list[Sequence], tokens: torch.Tensor, hidden: torch.Tensor, c0: int) -> None:
        """The log-probabilities of the prompt tokens that positions c0.. of this chunk predict (position t's
        hidden state, hidden [n, T, h], predicts token t + 1), appended to each sequence's. Collective: one
        ``vocab_logprobs`` per sequence with such a token in the chunk (the same on every rank: the lengths are
        the plan's), over its real positions only."""
        engine = self.engine
        for j, seq in enumerate(seqs):
            end = min(c0 + hidden.shape[1], len(seq.request.prompt) - 1)  # the last position predicts a new token
            if end <= c0:
                continue
            lp, top_lp, top_ids = vocab_logprobs(engine.head(hidden[j, :end - c0]), tokens[j, c0 + 1:end + 1],
                                                 engine.vocab_start, engine.vocab_comm, seq.request.prompt_logprobs)
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

    def _decode(self, result: StepResult) -> None:
        engine, rows = self.engine, self.rows
        ids = torch.tensor([s.last for s in rows], device=self.device)
        pos = torch.tensor([len(s.request.prompt) + s.generated - 1 for s in rows], device=self.device)
        engine.choose_schedule(self.schedule, len(rows), 1)
        engine.attach_cache(self.cache.rows(0, len(rows)))
        logits = engine.decode(ids, pos, self.decode_steps)
        self.decode_steps += 1
        self._take(list(rows), logits, result)

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
            p = s.request.sampling
            scores = full[i:i + 1] / p.temperature
            if p.top_k is not None or p.top_p is not None:
                scores = filter_logits(scores, p.top_k, p.top_p)
            ids[i] = (scores + s.sampler.gumbel()).nan_to_num(nan=float("-inf")).argmax(dim=-1)[0]
        return ids.tolist()

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
        constrained, ended = self._constrain(growing, logits)
        chosen = self.choose(growing, constrained) if growing else []
        # Logprobs of the raw model distribution (before grammars and min_tokens, as vLLM's default), for the
        # tokens actually emitted (a row whose grammar allows nothing ends without one).
        emitting = [i for i in range(len(growing)) if i not in ended]
        self._token_logprobs([growing[i] for i in emitting], logits[emitting], [chosen[i] for i in emitting], result)
        for i, (s, token) in enumerate(zip(growing, chosen)):
            if i in ended:
                s.finish = "stop"
                continue
            s.last, s.generated = token, s.generated + 1
            result.tokens.append((s.request_id, token))
            if s.matcher is not None and (not s.matcher.accept_token(token) or s.matcher.is_terminated()):
                s.finish = "stop"  # the grammar is complete (or, never expected, refused the token it allowed)
            elif (token == self.eos and not s.request.ignore_eos) or token in s.request.stop_token_ids:
                s.finish = "stop"
            elif s.generated >= s.request.max_tokens:
                s.finish = "length"
        for s in [s for s in seqs if s.finish is not None]:
            self._leave(s)
            result.finished.append((s.request_id, s.finish))


def _entries(logprobs: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> list[tuple[float, list]]:
    """``vocab_logprobs``'s answer as plain values: (logprob, [(id, logprob), ...] best first) per row."""
    return [(lp, list(zip(ids, lps))) for lp, ids, lps in
            zip(logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist())]
