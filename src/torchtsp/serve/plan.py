"""The step plan: what rank 0's scheduler tells every rank before each engine step, and how it travels.

A plan is a few integers (requests that join, with their prompts, sampling values and seeds; requests that
leave; the step's prefill chunks and decodes with their block tables; whether to stop), so it travels as
int64 tensors over the CPU control group, not as a pickle: a fixed-size header broadcast every step (the
ranks stay in lockstep even when it says "nothing to do"), then one payload tensor of the announced
length. Floats travel as their IEEE-754 bits, so every rank sees exactly the sampling values the HTTP process
checked.

Every field is declared once: those of a request that joins (``Admission`` and its ``Sampling``) in
``FIELDS``, those of the step (``StepPlan``) in ``PLAN``. A declaration names the field, how it travels (a
codec: int, bool, float bits, optional, list, text, an admission, ...) and the bound a value must keep;
encoding, decoding and the checks are all derived from the two lists, so a field cannot be written on one
side and read differently on the other. A field of the dataclasses missing from its list stops the import.

The bytes, as the declarations make them (``HEADER`` words, then the payload):

- header: magic, format version, layout checksum (of both declarations: names and codecs), the step's header
  fields (``PLAN``'s ``header=True`` ones, one word each: step, stop), the payload's length in words;
- payload: the other ``PLAN`` fields in order. A list is its item count, then each item; a dict its entry
  count, then key and value per entry; an optional value a 0 (None) or a 1 and the value; a text its UTF-8
  byte count, then the bytes 8 to a word; an admission its word count, then ``FIELDS`` in order.

Every length is checked (a count larger than the words left, an admission whose fields take other than its
count, a payload that ends early or runs long, a flag other than 0 or 1) and the decoded plan is checked
against the same bounds rank 0's plan passed: a corrupt or truncated payload fails loudly instead of being
mis-read.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MAGIC = 0x7E5A
# 2: fields declared once, each admission length-prefixed, penalties; 3: grammar polls; 4: a block table per group;
# 5: the step's fields declared once too (PLAN): counts in the payload, block tables keyed by request, strict flags
FORMAT_VERSION = 5
PREAMBLE = 3  # the header's first words: magic, format version, layout checksum (its last word: the payload's length)
MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's limit)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request: each is applied on every rank at every step
MAX_PENALTY = 2.0  # presence and frequency penalties in [-2, 2] (OpenAI's range)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits are divided or multiplied by it: far from 0 and inf in float32
MAX_BIAS = 100.0  # logit_bias values in [-100, 100] (OpenAI's range)


class PlanFormatError(RuntimeError):
    """A plan that cannot be read as written: the ranks disagree on the format, or the payload is corrupt."""


@dataclass
class Sampling:
    """Per request: temperature 0 is greedy; the seed drives its own noise, whatever else is in the batch.
    Penalties (batch.py applies them on each rank's vocabulary slice, greedy rows included): ``logit_bias``
    (token id -> added to its logit), ``repetition_penalty`` (transformers': over prompt and generated tokens),
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's: over generated tokens); ``min_p`` (drop tokens
    less likely than min_p times the likeliest; sampling only: it never changes the argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def penalized(self) -> bool:
        """Whether any per-slice penalty changes the logits."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0


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
    (request ids): the work of the step; ``tables``: every request with work's block table in each block group
    (blocks.py: one group per attention type; a model without sliding layers has one);
    ``preempted``: requests whose blocks rank 0 took back (they recompute from position 0 later); ``poll``:
    requests whose grammars the ranks are compiling, off the step loop: after the step every rank reports how
    each one stands (rank 0 schedules one only once it compiled everywhere)."""

    step: int
    admit: list[Admission] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    stop: bool = False
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    tables: dict[int, list[list[int]]] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)
    poll: list[int] = field(default_factory=list)


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
MAX_GRAMMAR_BYTES = 1 << 16
INT64 = (-2**63, 2**63 - 1)


# ---------------------------------------------------------------- codecs: one value <-> int64 words


class _Reader:
    """The payload's words, read in order; reading past the end is a format error, not a short list."""

    def __init__(self, words: list[int]):
        self.words, self.at = words, 0

    def take(self, n: int) -> list[int]:
        if n < 0 or self.at + n > len(self.words):
            raise PlanFormatError(f"the step plan's payload ends early (word {self.at} + {n} of {len(self.words)}); "
                                  f"the ranks disagree on its format")
        self.at += n
        return self.words[self.at - n:self.at]

    def one(self) -> int:
        return self.take(1)[0]

    def count(self, per_word: int = 1) -> int:
        """A length word: at least 0 and at most what the words left hold (``per_word`` items each)."""
        n = self.one()
        if not 0 <= n <= per_word * (len(self.words) - self.at):
            raise PlanFormatError(f"a length in the step plan's payload is {n} with {len(self.words) - self.at} "
                                  f"words left; the ranks disagree on its format")
        return n


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(n)))[0]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class Codec:
    """How one kind of value travels: ``put`` (value -> words), ``get`` (reader -> value), ``accepts`` (whether a
    value is of the kind: a wrong type is refused by rank 0's check, never packed as something else), ``width``
    (the words every value takes, where that is fixed: a header field's codec must have one)."""

    name: str
    put: Callable[[object], list[int]]
    get: Callable[[_Reader], object]
    accepts: Callable[[object], bool]
    width: int | None = None


def _flag(r: _Reader) -> bool:
    """A 0 or a 1: any other word is a payload read at the wrong place, not a true."""
    v = r.one()
    if v not in (0, 1):
        raise PlanFormatError(f"a flag in the step plan is {v}, not 0 or 1; the ranks disagree on its format")
    return bool(v)


INT = Codec("int", lambda v: [v], lambda r: r.one(), _is_int, width=1)
BOOL = Codec("bool", lambda v: [int(v)], _flag, lambda v: isinstance(v, bool), width=1)
FLOAT = Codec("float", lambda v: [_float_bits(v)], lambda r: _bits_float(r.one()), _is_number, width=1)


def _text_words(text: str) -> list[int]:
    """UTF-8 bytes packed 8 to an int64 (little-endian, zero padded), after their count."""
    data = text.encode("utf-8")
    n = len(data)
    data += bytes(-n % 8)
    return [n, *(struct.unpack("<q", data[i:i + 8])[0] for i in range(0, len(data), 8))]


def _words_text(r: _Reader) -> str:
    n = r.count(per_word=8)
    data = b"".join(struct.pack("<q", w) for w in r.take(-(-n // 8)))
    if any(data[n:]):
        raise PlanFormatError("a text in the step plan has bytes past its length; the ranks disagree on its format")
    try:
        return data[:n].decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanFormatError(f"a text in the step plan is not UTF-8 ({e}); the ranks disagree on its format") from None


TEXT = Codec("text", _text_words, _words_text, lambda v: isinstance(v, str))


def listof(c: Codec) -> Codec:
    """A list as its item count, then each item's words (a list of ints is read in one slice: prompts are long)."""
    def get(r: _Reader) -> list:
        return r.take(r.count()) if c is INT else [c.get(r) for _ in range(r.count())]

    return Codec(f"[{c.name}]", lambda v: [len(v), *(w for x in v for w in c.put(x))], get,
                 lambda v: isinstance(v, list) and all(map(c.accepts, v)))


INTS = listof(INT)


def optional(c: Codec) -> Codec:
    """None travels as [0], a value as [1, its words]."""
    return Codec(f"optional {c.name}", lambda v: [0] if v is None else [1, *c.put(v)],
                 lambda r: c.get(r) if _flag(r) else None, lambda v: v is None or c.accepts(v))


def choice(options: tuple[str, ...]) -> Codec:
    """One of ``options``, as its index."""
    def get(r: _Reader) -> str:
        i = r.one()
        if not 0 <= i < len(options):
            raise PlanFormatError(f"choice {i} of {options} in the step plan; the ranks disagree on its format")
        return options[i]

    return Codec(f"one of {options}", lambda v: [options.index(v)], get, lambda v: v in options, width=1)


def tuple_of(*cs: Codec) -> Codec:
    """A tuple of fixed length, each item with its own codec, one after the other."""
    widths = [c.width for c in cs]
    return Codec(f"({', '.join(c.name for c in cs)})", lambda v: [w for c, x in zip(cs, v) for w in c.put(x)],
                 lambda r: tuple(c.get(r) for c in cs),
                 lambda v: isinstance(v, tuple) and len(v) == len(cs) and all(c.accepts(x) for c, x in zip(cs, v)),
                 width=None if None in widths else sum(widths))


def mapping(k: Codec, v: Codec) -> Codec:
    """A dict as its entry count, then key and value words per entry (in the dict's order)."""
    entry = tuple_of(k, v)

    def get(r: _Reader) -> dict:
        n = r.count()
        d = dict(entry.get(r) for _ in range(n))
        if len(d) != n:
            raise PlanFormatError(f"a dict in the step plan repeats a key ({n} entries, {len(d)} keys); the ranks "
                                  f"disagree on its format")
        return d

    return Codec(f"{{{k.name}: {v.name}}}", lambda d: [len(d), *(w for kv in d.items() for w in entry.put(kv))],
                 get, lambda d: isinstance(d, dict) and all(k.accepts(x) and v.accepts(y) for x, y in d.items()))


# ---------------------------------------------------------------- the declaration


@dataclass(frozen=True)
class Limits:
    """What rank 0 checks a request's values against: the model's vocabulary and context length."""

    vocab_size: int
    max_model_len: int


# A bound: (field name, value, the whole it belongs to, limits) -> why the value is refused, or None. The whole is
# the Admission (with the model's Limits) for a FIELDS entry, the StepPlan (limits None) for a PLAN entry.
Bound = Callable[[str, object, object, "Limits | None"], "str | None"]


def _range(lo: float, hi: float, low_open: bool = False) -> Bound:
    """Finite numbers in [lo, hi] ((lo, hi] when ``low_open``); None (an optional field left out) passes."""
    def bound(name, v, a, lim):
        if v is None or (math.isfinite(v) and (lo < v if low_open else lo <= v) and v <= hi):
            return None
        return f"{name} {v} is outside {'(' if low_open else '['}{lo}, {hi}]"
    return bound


def _in_vocab(name, ids, a, lim):
    outside = next((t for t in ids if not 0 <= t < lim.vocab_size), None)
    return None if outside is None else f"{name}: token id {outside} is outside the vocabulary [0, {lim.vocab_size})"


def _prompt(name, ids, a, lim):
    return "the prompt is empty" if not ids else _in_vocab(name, ids, a, lim)


def _max_tokens(name, n, a, lim):
    least = 0 if a.prompt_logprobs is not None else 1  # 0: echo's prefill only
    if n < least or len(a.prompt) + n > lim.max_model_len:
        return f"the prompt ({len(a.prompt)} tokens) and max_tokens ({n}) do not fit [1, {lim.max_model_len}]"
    return None


def _top_k(name, k, a, lim):
    return None if k is None or 1 <= k <= lim.vocab_size else f"top_k {k} is outside [1, {lim.vocab_size}]"


def _min_tokens(name, n, a, lim):
    return None if 0 <= n <= a.max_tokens else f"min_tokens {n} is outside [0, max_tokens {a.max_tokens}]"


def _logit_bias(name, bias, a, lim):
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}"
    return _in_vocab(name, list(bias), a, lim) or next(
        (f"logit_bias[{t}] {b} is outside [-{MAX_BIAS}, {MAX_BIAS}]" for t, b in bias.items()
         if not (math.isfinite(b) and abs(b) <= MAX_BIAS)), None)


def _grammar(name, g, a, lim):
    if g is not None and len(g[1].encode("utf-8")) > MAX_GRAMMAR_BYTES:
        return f"the grammar's source has more than {MAX_GRAMMAR_BYTES} bytes"
    return None


def _any(name, v, a, lim):
    return None


@dataclass(frozen=True)
class Wire:
    """One declared field: its path (``sampling.top_p`` for a ``Sampling`` field of an admission), codec and bound;
    ``header``: a step field that travels in the fixed-size header (a codec of fixed width), not the payload."""

    path: str
    codec: Codec
    bound: Bound = _any
    header: bool = False


# The admission's fields in the order they travel. Add a field here and to its dataclass; nothing else.
FIELDS = (
    Wire("request_id", INT),
    Wire("prompt", INTS, _prompt),
    Wire("max_tokens", INT, _max_tokens),
    Wire("sampling.temperature", FLOAT, _range(0.0, math.inf)),
    Wire("sampling.top_k", optional(INT), _top_k),
    Wire("sampling.top_p", optional(FLOAT), _range(0.0, 1.0, low_open=True)),
    Wire("sampling.seed", INT, _range(0, INT64[1])),
    Wire("sampling.min_p", FLOAT, _range(0.0, 1.0)),
    Wire("sampling.presence_penalty", FLOAT, _range(-MAX_PENALTY, MAX_PENALTY)),
    Wire("sampling.frequency_penalty", FLOAT, _range(-MAX_PENALTY, MAX_PENALTY)),
    Wire("sampling.repetition_penalty", FLOAT, _range(*REPETITION_PENALTY_RANGE)),
    Wire("sampling.logit_bias", mapping(INT, FLOAT), _logit_bias),
    Wire("stop_token_ids", INTS, _in_vocab),
    Wire("ignore_eos", BOOL),
    Wire("min_tokens", INT, _min_tokens),
    Wire("grammar", optional(tuple_of(choice(GRAMMAR_KINDS), TEXT)), _grammar),
    Wire("logprobs", optional(INT), _range(0, MAX_LOGPROBS)),
    Wire("prompt_logprobs", optional(INT), _range(0, MAX_LOGPROBS)),
)


def field_value(a: Admission, path: str):
    obj, _, name = path.rpartition(".")
    return getattr(a.sampling if obj else a, name)


def _admission_words(a: Admission) -> list[int]:
    """The admission's words, after their count (a reader that disagrees on a field's width stops at the end of
    this admission, not somewhere in the next one)."""
    words = [w for f in FIELDS for w in f.codec.put(field_value(a, f.path))]
    return [len(words), *words]


def _read_admission(r: _Reader) -> Admission:
    n, start = r.one(), r.at
    values = {f.path: f.codec.get(r) for f in FIELDS}
    if r.at - start != n:
        raise PlanFormatError(f"an admission in the step plan announces {n} words and its fields took "
                              f"{r.at - start}; the ranks disagree on its format")
    sampling = Sampling(**{p.removeprefix("sampling."): v for p, v in values.items() if p.startswith("sampling.")})
    return Admission(sampling=sampling, **{p: v for p, v in values.items() if not p.startswith("sampling.")})


# An admission inside a plan: its values are checked by admission_problem (rank 0, against the model's limits)
# before it is planned, so the plan's own check asks only that it is one.
ADMISSION = Codec("admission", _admission_words, _read_admission, lambda v: isinstance(v, Admission))


def _work(plan: StepPlan) -> list[int]:
    """The requests with work this step, in the order they run: prefill chunks, then decodes."""
    return [*(rid for rid, _, _ in plan.prefill), *plan.decode]


def _chunks(name, chunks, plan, lim):
    bad = next(((rid, first, n) for rid, first, n in chunks if first < 0 or n < 1), None)
    return None if bad is None else f"{name}: chunk {bad} is not (request, first position >= 0, tokens >= 1)"


def _once(name, ids, plan, lim):
    work = _work(plan)
    return None if len(set(work)) == len(work) else f"{name}: a request has more than one chunk or decode: {work}"


def _tables(name, tables, plan, lim):
    """A table for each request with work and for no other, every one of them with as many groups (the model's),
    block ids >= 0 (NULL_BLOCK, 0, stands for a block that left a sliding window)."""
    if sorted(tables) != sorted(_work(plan)):
        return f"{name} are for requests {sorted(tables)}, the step's work is for {sorted(_work(plan))}"
    if len({len(groups) for groups in tables.values()}) > 1 or any(not groups for groups in tables.values()):
        return f"{name}: the requests have different, or no, block groups: {[len(g) for g in tables.values()]}"
    bad = next((rid for rid, groups in tables.items() if any(b < 0 for table in groups for b in table)), None)
    return None if bad is None else f"{name}: request {bad}'s table has a negative block id"


# The step's fields in the order they travel (the header's first). Add a field here and to StepPlan; nothing else.
PLAN = (
    Wire("step", INT, _range(0, INT64[1]), header=True),
    Wire("stop", BOOL, header=True),
    Wire("cancel", INTS),
    Wire("admit", listof(ADMISSION)),
    Wire("prefill", listof(tuple_of(INT, INT, INT)), _chunks),
    Wire("decode", INTS, _once),
    Wire("tables", mapping(INT, listof(INTS)), _tables),
    Wire("preempted", INTS),
    Wire("poll", INTS),
)
HEADER_FIELDS = tuple(w for w in PLAN if w.header)
PAYLOAD_FIELDS = tuple(w for w in PLAN if not w.header)


def _declared() -> None:
    """Every field of Admission and Sampling is in FIELDS, every field of StepPlan in PLAN, once each, and the
    header's fields have fixed widths (checked at import: a missing field would not travel)."""
    for declared, fields in (
            (FIELDS, [f.name for f in dataclasses.fields(Admission) if f.name != "sampling"]
             + [f"sampling.{f.name}" for f in dataclasses.fields(Sampling)]),
            (PLAN, [f.name for f in dataclasses.fields(StepPlan)])):
        paths = [w.path for w in declared]
        if sorted(paths) != sorted(fields):
            raise RuntimeError(f"plan.{'FIELDS' if declared is FIELDS else 'PLAN'} does not declare each field once: "
                               f"missing {sorted(set(fields) - set(paths))}, extra {sorted(set(paths) - set(fields))}")
    wide = [w.path for w in HEADER_FIELDS if w.codec.width is None]
    if wide or [w.header for w in PLAN] != sorted((w.header for w in PLAN), reverse=True):
        raise RuntimeError(f"plan.PLAN: header fields come first and have fixed widths ({wide} do not)")


_declared()
HEADER = PREAMBLE + sum(w.codec.width for w in HEADER_FIELDS) + 1
LAYOUT = zlib.crc32(";".join(f"{w.path}:{w.codec.name}" + ":header" * w.header
                             for w in (*FIELDS, *PLAN)).encode()) & 0x7FFFFFFF


def admission_problem(a: Admission, vocab_size: int, max_model_len: int) -> str | None:
    """Why a request would break the step plan or a rank's step (None: it would not). The HTTP side refuses
    all of these first; rank 0 checks again before planning, so that a request that slipped through fails
    alone instead of failing every rank."""
    if not isinstance(a, Admission) or not isinstance(a.sampling, Sampling):
        return f"not an admission: {type(a).__name__}"
    wrong = next((f for f in FIELDS if not f.codec.accepts(field_value(a, f.path))), None)
    if wrong is not None:
        return f"{wrong.path} {field_value(a, wrong.path)!r:.40} is not {wrong.codec.name}"
    if not all(INT64[0] <= v <= INT64[1] for v in _admission_words(a)):
        return "a value does not fit a signed 64-bit integer"
    limits = Limits(vocab_size, max_model_len)
    for f in FIELDS:
        problem = f.bound(f.path.removeprefix("sampling."), field_value(a, f.path), a, limits)
        if problem is not None:
            return problem
    return None


def plan_problem(plan: StepPlan) -> str | None:
    """Why ``plan`` is not a step plan the ranks can run (None: it is): a field of the wrong kind, or outside
    its bound. Rank 0's plan is checked before it is sent, and every decoded plan again."""
    if not isinstance(plan, StepPlan):
        return f"not a step plan: {type(plan).__name__}"
    wrong = next((f for f in PLAN if not f.codec.accepts(getattr(plan, f.path))), None)
    if wrong is not None:
        return f"{wrong.path} {getattr(plan, wrong.path)!r:.60} is not {wrong.codec.name}"
    return next((problem for f in PLAN if (problem := f.bound(f.path, getattr(plan, f.path), plan, None))), None)


# ---------------------------------------------------------------- the plan


def encode(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER], payload [n]) int64 tensors of a plan; ValueError (rank 0's scheduler is wrong) for a plan
    that ``plan_problem`` refuses or whose values do not fit int64."""
    problem = plan_problem(plan)
    if problem is not None:
        raise ValueError(f"rank 0 planned a step the ranks cannot run ({problem}); this is a bug in torchtsp")
    payload = [w for f in PAYLOAD_FIELDS for w in f.codec.put(getattr(plan, f.path))]
    header = [MAGIC, FORMAT_VERSION, LAYOUT, *(w for f in HEADER_FIELDS for w in f.codec.put(getattr(plan, f.path))),
              len(payload)]
    try:
        return torch.tensor(header, dtype=torch.long), torch.tensor(payload, dtype=torch.long)
    except (RuntimeError, ValueError) as e:  # torch's "Overflow when unpacking long"
        raise ValueError(f"a value of step plan {plan.step} does not fit a signed 64-bit integer ({e})") from None


def decode(header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
    """The plan ``encode`` wrote; PlanFormatError if the header is not this format's, if a length disagrees
    (anywhere: each admission's and list's length is checked, and the payload must end where its last field
    does) or if the plan read is not one rank 0 could have sent (``plan_problem``)."""
    if header.numel() != HEADER:
        raise PlanFormatError(f"the step plan's header has {header.numel()} words, not {HEADER}; the ranks run "
                              f"different versions of torchtsp")
    words = header.tolist()
    (magic, version, layout), length = words[:PREAMBLE], words[-1]
    if magic != MAGIC:
        raise PlanFormatError(f"step plan header is corrupt (magic {magic:#x}); the ranks are out of step")
    if (version, layout) != (FORMAT_VERSION, LAYOUT):
        raise PlanFormatError(f"the step plan is format {version} (layout {layout:#x}), this rank reads format "
                              f"{FORMAT_VERSION} (layout {LAYOUT:#x}); the ranks run different versions of torchtsp")
    if payload.numel() != length:
        raise PlanFormatError(f"the step plan's payload has {payload.numel()} words, its header says {length}")
    head = _Reader(words[PREAMBLE:-1])
    values = {f.path: f.codec.get(head) for f in HEADER_FIELDS}
    r = _Reader(payload.tolist())
    values.update({f.path: f.codec.get(r) for f in PAYLOAD_FIELDS})
    if r.at != length:
        raise PlanFormatError(f"the step plan's payload has {length} words and its fields took {r.at}; the ranks "
                              f"disagree on its format")
    plan = StepPlan(**values)
    problem = plan_problem(plan)
    if problem is not None:
        raise PlanFormatError(f"the step plan read is not one rank 0 sends ({problem}); the ranks disagree on its "
                              f"format")
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
