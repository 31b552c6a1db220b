"""The step plan: what rank 0's scheduler tells every rank before each engine step, and how it travels.

A plan is a few integers (requests that join, with their prompts, sampling values and seeds; requests that
leave; the step's prefill chunks and decodes with their block tables; whether to stop), so it travels as
int64 tensors over the CPU control group, not as a pickle: a fixed-size header broadcast every step (the
ranks stay in lockstep even when it says "nothing to do"), then one payload tensor of the announced
length. Floats travel as their
IEEE-754 bits, so every rank sees exactly the sampling values the HTTP process checked.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import torch

HEADER = 6  # magic, step, stop, cancels, admissions, payload length
MAGIC = 0x7E5A
MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's limit)


@dataclass
class Sampling:
    """Per request: temperature 0 is greedy; the seed drives its own noise, whatever else is in the batch."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


@dataclass
class Admission:
    """A request joining the batch: its prompt ids and how to end it."""

    request_id: int
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # run to max_tokens even past the model's EOS (load tests)
    min_tokens: int = 0  # EOS and the stop ids cannot end it before this many tokens
    grammar: tuple[str, str] | None = None  # (kind in GRAMMAR_KINDS, source): structured output (serve/structured.py)
    # Log-probabilities (None: not asked): each chosen token's, with this many top alternatives; the prompt
    # tokens' (echo), with this many. max_tokens 0 is allowed with prompt_logprobs: the prefill only.
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass
class StepPlan:
    """One engine step. ``admit``: requests the ranks see for the first time (their state starts here);
    ``cancel``: requests the ranks drop; ``prefill`` (request id, first position, tokens) and ``decode``
    (request ids): the work of the step; ``tables``: the block table of every request with work;
    ``preempted``: requests whose blocks rank 0 took back (they recompute from position 0 later)."""

    step: int
    admit: list[Admission] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    stop: bool = False
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")  # travel as 1 + their index (0: none)
MAX_GRAMMAR_BYTES = 1 << 16


def _text_words(text: str) -> list[int]:
    """UTF-8 bytes packed 8 to an int64 (little-endian, zero padded): a grammar's source in the payload."""
    data = text.encode("utf-8")
    data += bytes(-len(data) % 8)
    return [struct.unpack("<q", data[i:i + 8])[0] for i in range(0, len(data), 8)]


def _words_text(words: list[int], n_bytes: int) -> str:
    return b"".join(struct.pack("<q", w) for w in words)[:n_bytes].decode("utf-8")


def _grammar_values(a: Admission) -> list[int]:
    if a.grammar is None:
        return [0, 0]
    kind, source = a.grammar
    return [GRAMMAR_KINDS.index(kind) + 1, len(source.encode("utf-8")), *_text_words(source)]


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(n)))[0]


def _admission_values(a: Admission) -> list[int]:
    s = a.sampling
    return [a.request_id, a.max_tokens, s.seed, _float_bits(s.temperature), s.top_k or 0,
            _float_bits(s.top_p if s.top_p is not None else -1.0), int(a.ignore_eos),
            len(a.stop_token_ids), len(a.prompt), *a.stop_token_ids, *a.prompt, a.min_tokens, *_grammar_values(a),
            _optional(a.logprobs), _optional(a.prompt_logprobs)]


def _optional(n: int | None) -> int:
    return -1 if n is None else n


def _from_optional(n: int) -> int | None:
    return None if n < 0 else n


def admission_problem(a: Admission, vocab_size: int, max_model_len: int) -> str | None:
    """Why a request would break the step plan or a rank's step (None: it would not). The HTTP side refuses
    all of these first; rank 0 checks again before planning, so that a request that slipped through fails
    alone instead of failing every rank."""
    s = a.sampling
    if a.grammar is not None and (a.grammar[0] not in GRAMMAR_KINDS or not isinstance(a.grammar[1], str)
                                  or len(a.grammar[1].encode("utf-8")) > MAX_GRAMMAR_BYTES):
        return f"the grammar is not one of {GRAMMAR_KINDS} with a source of at most {MAX_GRAMMAR_BYTES} bytes"
    if not all(isinstance(v, int) and -2**63 <= v < 2**63 for v in _admission_values(a)):
        return "a value does not fit a signed 64-bit integer"
    least = 0 if a.prompt_logprobs is not None else 1
    if not a.prompt or len(a.prompt) + a.max_tokens > max_model_len or a.max_tokens < least:
        return f"the prompt ({len(a.prompt)} tokens) and max_tokens ({a.max_tokens}) do not fit [1, {max_model_len}]"
    if any(not 0 <= t < vocab_size for t in (*a.prompt, *a.stop_token_ids)):
        return f"a token id is outside the vocabulary [0, {vocab_size})"
    if s.top_k is not None and not 1 <= s.top_k <= vocab_size:
        return f"top_k {s.top_k} is outside [1, {vocab_size}]"
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        return f"temperature {s.temperature} is not a finite number >= 0"
    if s.top_p is not None and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        return f"top_p {s.top_p} is outside (0, 1]"
    if not 0 <= a.min_tokens <= a.max_tokens:
        return f"min_tokens {a.min_tokens} is outside [0, max_tokens {a.max_tokens}]"
    if any(n is not None and not 0 <= n <= MAX_LOGPROBS for n in (a.logprobs, a.prompt_logprobs)):
        return f"logprobs ({a.logprobs}) or prompt_logprobs ({a.prompt_logprobs}) is outside [0, {MAX_LOGPROBS}]"
    return None


def encode(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER], payload [n]) int64 tensors of a plan."""
    payload = list(plan.cancel)
    for a in plan.admit:
        payload += _admission_values(a)
    payload += [len(plan.prefill), *[v for work in plan.prefill for v in work], len(plan.decode), *plan.decode,
                len(plan.preempted), *plan.preempted]
    for rid in [*(r for r, _, _ in plan.prefill), *plan.decode]:
        payload += [len(plan.tables[rid]), *plan.tables[rid]]
    header = [MAGIC, plan.step, int(plan.stop), len(plan.cancel), len(plan.admit), len(payload)]
    return torch.tensor(header, dtype=torch.long), torch.tensor(payload, dtype=torch.long)


def decode(header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
    magic, step, stop, cancels, admissions, _ = header.tolist()
    if magic != MAGIC:
        raise RuntimeError(f"step plan header is corrupt (magic {magic:#x}); the ranks are out of step")
    values = payload.tolist()
    plan = StepPlan(step=step, stop=bool(stop), cancel=values[:cancels])
    at = cancels
    for _ in range(admissions):
        rid, max_tokens, seed, temperature, top_k, top_p, ignore_eos, n_stops, n_prompt = values[at:at + 9]
        at += 9
        stops, prompt = values[at:at + n_stops], values[at + n_stops:at + n_stops + n_prompt]
        at += n_stops + n_prompt
        min_tokens, kind, n_bytes = values[at:at + 3]
        words = -(-n_bytes // 8)
        grammar = (GRAMMAR_KINDS[kind - 1], _words_text(values[at + 3:at + 3 + words], n_bytes)) if kind else None
        at += 3 + words
        logprobs, prompt_logprobs = values[at:at + 2]
        at += 2
        top_p = _bits_float(top_p)
        plan.admit.append(Admission(rid, prompt, max_tokens, Sampling(_bits_float(temperature), top_k or None,
                                                                       None if top_p < 0 else top_p, seed), stops,
                                   bool(ignore_eos), min_tokens, grammar, logprobs=_from_optional(logprobs),
                                   prompt_logprobs=_from_optional(prompt_logprobs)))
    n = values[at]
    plan.prefill = [tuple(values[at + 1 + 3 * i:at + 4 + 3 * i]) for i in range(n)]
    at += 1 + 3 * n
    plan.decode = values[at + 1:at + 1 + values[at]]
    at += 1 + values[at]
    plan.preempted = values[at + 1:at + 1 + values[at]]
    at += 1 + values[at]
    for rid in [*(r for r, _, _ in plan.prefill), *plan.decode]:
        plan.tables[rid] = values[at + 1:at + 1 + values[at]]
        at += 1 + values[at]
    return plan


def exchange(comm, plan: StepPlan | None) -> StepPlan:
    """Rank 0 passes its plan, every other rank None; every rank returns rank 0's plan. ``comm``: the world's
    CPU control comm (an ``AxisComm``)."""
    if comm.size == 1:
        return plan
    if comm.rank == 0:
        header, payload = encode(plan)
    else:
        header, payload = torch.zeros(HEADER, dtype=torch.long), None
    comm.broadcast(header, 0, label="serve.plan")
    length = int(header[-1])
    if comm.rank != 0:
        payload = torch.zeros(length, dtype=torch.long)
    comm.broadcast(payload, 0, label="serve.plan")
    return plan if comm.rank == 0 else decode(header, payload)
