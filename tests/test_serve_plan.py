"""The step plan's wire format (serve/plan.py): randomized plans with every field at edge values survive the round
trip and read the same with a reader written here from the format's description (not from plan.py's codecs); every
truncated, overlong, re-versioned or corrupted payload either fails with PlanFormatError or is exactly the encoding
of the plan it reads as; rank 0 cannot send a plan the ranks could not run."""

from __future__ import annotations

import copy
import math
import random
import struct

import pytest
import torch

from torchtsp.serve import plan as wire
from torchtsp.serve.plan import (
    FIELDS,
    GRAMMAR_KINDS,
    INT64,
    Admission,
    PlanFormatError,
    Sampling,
    StepPlan,
    admission_problem,
    decode,
    encode,
    field_value,
)

EDGE_INTS = [0, 1, -1, INT64[0], INT64[1], 2**32, -2**31]
EDGE_FLOATS = [0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308, 2.0**-30]
# Texts of every length mod 8 (the packing's padding), several bytes per character, a NUL at the end (the padding
# is NULs too: only the byte count can tell them apart).
EDGE_TEXTS = ["", "a", "é", "ab\x00", "root ::= \"ü\"", "😀" * 3, "x" * 8, "y" * 17 + "\x00"]


def _random_value(codec_name: str, rng: random.Random):
    """A value of the codec named ``codec_name``, often an edge one: a field declared with a new codec fails here
    until it has a generator."""
    def an_int():
        return rng.choice(EDGE_INTS) if rng.random() < 0.5 else rng.randint(-10**6, 10**6)

    def a_float():
        return rng.choice(EDGE_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e3, 1e3)

    def ints():
        return [an_int() for _ in range(rng.choice([0, 1, 2, 9]))]

    def grammar():
        return (rng.choice(GRAMMAR_KINDS), rng.choice(EDGE_TEXTS))

    makers = {"int": an_int, "float": a_float, "bool": lambda: rng.random() < 0.5, "[int]": ints,
              "optional int": lambda: None if rng.random() < 0.3 else an_int(),
              "optional float": lambda: None if rng.random() < 0.3 else a_float(),
              "{int: float}": lambda: {an_int(): a_float() for _ in range(rng.choice([0, 1, 3]))},
              f"optional (one of {GRAMMAR_KINDS}, text)": lambda: None if rng.random() < 0.3 else grammar()}
    return makers[codec_name]()


def _set(a: Admission, path: str, value) -> None:
    owner, _, name = path.rpartition(".")
    setattr(a.sampling if owner else a, name, value)


def _random_admission(rng: random.Random) -> Admission:
    """Every declared field drawn at random (the declaration is iterated: a new field is covered here too); the
    values need not be a valid request (rank 0's check is admission_problem's, tested below), only of their kind."""
    a = Admission(0, [1], 1)
    for f in FIELDS:
        _set(a, f.path, _random_value(f.codec.name, rng))
    return a


def _random_plan(rng: random.Random, step: int) -> StepPlan:
    """A plan rank 0 could send: distinct requests with work, each with a table per group (the same count of
    groups for all), block ids >= 0 (0 is the null block), empty lists as often as not."""
    ids = rng.sample(range(-5, 10**6), 12) + [INT64[1]]
    rng.shuffle(ids)
    n_prefill, n_decode = rng.choice([0, 1, 3]), rng.choice([0, 1, 4])
    work = ids[:n_prefill + n_decode]
    groups = rng.choice([1, 2, 3])
    plan = StepPlan(step if rng.random() < 0.8 else rng.choice([0, INT64[1]]), stop=rng.random() < 0.3,
                    admit=[_random_admission(rng) for _ in range(rng.choice([0, 1, 2]))],
                    cancel=[rng.choice(ids) for _ in range(rng.choice([0, 2]))],
                    prefill=[(rid, rng.choice([0, 16, INT64[1]]), rng.choice([1, 7, INT64[1]]))
                             for rid in work[:n_prefill]],
                    decode=work[n_prefill:],
                    preempted=ids[len(ids) - rng.choice([0, 1, 2]):],
                    poll=[rng.choice(ids) for _ in range(rng.choice([0, 3]))])
    plan.tables = {rid: [[rng.choice([0, 1, 5, INT64[1]]) for _ in range(rng.choice([0, 1, 3]))]
                         for _ in range(groups)] for rid in work}
    return plan


def _canon(x):
    """A comparable form that keeps what ``==`` forgets: bool vs int (True == 1), a float's bits (nan != nan,
    -0.0 == 0.0), tuple vs list, a dict's order."""
    if isinstance(x, StepPlan | Admission | Sampling):
        return type(x).__name__, [(name, _canon(v)) for name, v in vars(x).items()]
    if isinstance(x, bool | int | str) or x is None:
        return type(x).__name__, x
    if isinstance(x, float):
        return "float", struct.pack("<d", x)
    if isinstance(x, dict):
        return "dict", [(_canon(k), _canon(v)) for k, v in x.items()]
    return type(x).__name__, [_canon(v) for v in x]


# ---------------------------------------------------------------- a reader written from plan.py's docstring


class _Words:
    def __init__(self, words):
        self.words, self.at = list(words), 0

    def next(self, n=1):
        assert self.at + n <= len(self.words), "ran past the payload"
        self.at += n
        return self.words[self.at - n:self.at]

    def one(self):
        return self.next()[0]

    def flag(self):
        v = self.one()
        assert v in (0, 1)
        return v == 1

    def ints(self):
        return self.next(self.one())


def _spec_value(codec_name: str, w: _Words):
    """One admission field as the format describes its codec."""
    if codec_name.startswith("optional "):
        return _spec_value(codec_name.removeprefix("optional "), w) if w.flag() else None
    if codec_name == "int":
        return w.one()
    if codec_name == "bool":
        return w.flag()
    if codec_name == "float":
        return struct.unpack("<d", struct.pack("<q", w.one()))[0]
    if codec_name == "[int]":
        return w.ints()
    if codec_name == "{int: float}":
        return {w.one(): _spec_value("float", w) for _ in range(w.one())}
    if codec_name == f"(one of {GRAMMAR_KINDS}, text)":
        kind, n = GRAMMAR_KINDS[w.one()], w.one()
        data = b"".join(struct.pack("<q", x) for x in w.next(-(-n // 8)))
        return kind, data[:n].decode("utf-8")
    raise AssertionError(f"no reader here for the codec {codec_name!r}: describe it in this test")


def _spec_read(header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
    """The format as plan.py's docstring states it: header [magic, version, layout, step, stop, payload length];
    payload: cancels (count, ids), admissions (count; each: its word count, then FIELDS in order), prefill
    chunks (count; each request, first position, tokens), decodes (count, ids), block tables (count; each:
    request, group count, then each group's table as count, block ids), preempted (count, ids), polls (count,
    ids)."""
    magic, version, layout, step, stop, length = header.tolist()
    assert (magic, version, layout) == (wire.MAGIC, wire.FORMAT_VERSION, wire.LAYOUT) and stop in (0, 1)
    w = _Words(payload.tolist())
    assert len(w.words) == length
    plan = StepPlan(step, stop=stop == 1, cancel=w.ints())
    for _ in range(w.one()):
        n, start = w.one(), w.at
        a = Admission(0, [], 0)
        for f in FIELDS:
            _set(a, f.path, _spec_value(f.codec.name, w))
        assert w.at - start == n
        plan.admit.append(a)
    plan.prefill = [tuple(w.next(3)) for _ in range(w.one())]
    plan.decode = w.ints()
    plan.tables = {w.one(): [w.ints() for _ in range(w.one())] for _ in range(w.one())}
    plan.preempted, plan.poll = w.ints(), w.ints()
    assert w.at == length
    return plan


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("seed", range(4))
def test_randomized_plans_round_trip_and_read_as_the_format_says(seed):
    rng = random.Random(seed)
    for step in range(50):
        plan = _random_plan(rng, step)
        header, payload = encode(plan)
        assert header.dtype == payload.dtype == torch.long and header.numel() == wire.HEADER == 6
        assert _canon(decode(header, payload)) == _canon(plan)
        assert _canon(_spec_read(header, payload)) == _canon(plan)


def test_every_declared_field_and_edge_value_is_drawn():
    """The generator reaches each field with several non-default values and every edge value (else the round
    trip above would prove less than it says)."""
    rng, default = random.Random(0), Admission(0, [1], 1)
    seen = {f.path: set() for f in FIELDS}
    for _ in range(200):
        a = _random_admission(rng)
        for f in FIELDS:
            if _canon(field_value(a, f.path)) != _canon(field_value(default, f.path)):
                seen[f.path].add(repr(_canon(field_value(a, f.path))))
    least = {f.path: 1 if f.codec is wire.BOOL else 2 for f in FIELDS}  # a bool has one value off its default
    assert all(len(seen[p]) >= least[p] for p in seen), {p: len(v) for p, v in seen.items()}
    drawn = " ".join(" ".join(values) for values in seen.values())
    for edge in [*EDGE_INTS, *EDGE_FLOATS, *EDGE_TEXTS]:
        assert repr(_canon(edge)) in drawn, edge


def test_a_valid_request_with_every_field_set_survives():
    """admission_problem's valid request, far from every default, in a plan with every step field set."""
    a = Admission(9, [3, 1, 4], 5, Sampling(0.8, 7, 0.625, 11, 0.05, -1.5, 2.0, 1.25, {5: -1.5, 100: 100.0}),
                  stop_token_ids=[2, 7], ignore_eos=True, min_tokens=2, grammar=("ebnf", 'root ::= "é"'),
                  logprobs=3, prompt_logprobs=0)
    assert admission_problem(a, 101, 48) is None
    defaults = Admission(0, [1], 1)
    assert all(_canon(field_value(a, f.path)) != _canon(field_value(defaults, f.path)) for f in FIELDS)
    plan = StepPlan(7, [a, Admission(4, [1], 1)], cancel=[1, 2], prefill=[(3, 0, 3), (9, 16, 5)], decode=[4, 8],
                    tables={3: [[7], []], 9: [[0, 5, 2, 11, 6], [0, 0, 3, 4, 1]], 4: [[1], [2]], 8: [[], [0]]},
                    preempted=[12], poll=[13, 21])
    assert _canon(decode(*encode(plan))) == _canon(plan)
    assert _canon(decode(*encode(StepPlan(8, stop=True)))) == _canon(StepPlan(8, stop=True))


# ---------------------------------------------------------------- what is refused


def _plan_with_everything() -> StepPlan:
    rng = random.Random(11)
    while True:  # a plan with at least one of everything, so that each part is cut somewhere below
        plan = _random_plan(rng, 3)
        if plan.admit and plan.cancel and plan.prefill and plan.decode and plan.preempted and plan.poll:
            return plan


def test_every_truncation_and_extension_fails_loudly():
    header, payload = encode(_plan_with_everything())
    for cut in range(payload.numel()):
        with pytest.raises(PlanFormatError, match="header says"):
            decode(header, payload[:cut])  # the payload is shorter than the header announces
        agreeing = header.clone()
        agreeing[-1] = cut
        with pytest.raises(PlanFormatError, match="step plan"):
            decode(agreeing, payload[:cut])  # header and payload agree, but the fields need more words
    for extra in ([0], [1, 2, 3]):
        longer = header.clone()
        longer[-1] += len(extra)
        with pytest.raises(PlanFormatError, match="took"):
            decode(longer, torch.cat([payload, torch.tensor(extra)]))  # words nobody reads
    with pytest.raises(PlanFormatError, match="not 6"):
        decode(header[:-1], payload)


@pytest.mark.parametrize("index,words", [(0, "magic"), (1, "format"), (2, "layout"), (4, "flag"), (3, "outside")])
def test_a_header_of_another_format_or_corrupt_fails_loudly(index, words):
    header, payload = encode(_plan_with_everything())
    other = header.clone()
    other[index] = {3: -1, 4: 2}.get(index, int(other[index]) + 1)  # step -1; stop 2 (a flag is 0 or 1)
    with pytest.raises(PlanFormatError, match=words):
        decode(other, payload)


def test_an_admission_whose_count_disagrees_fails_loudly():
    header, payload = encode(StepPlan(3, [Admission(1, [2, 3], 4)]))
    shifted = payload.clone()
    shifted[2] += 1  # cancels' count, admissions' count, then the admission's word count
    with pytest.raises(PlanFormatError, match="announces"):
        decode(header, shifted)


def test_a_corrupted_payload_fails_or_is_exactly_the_plan_it_reads_as():
    """Every word of the payload replaced by nearby and far values: decoding either raises PlanFormatError (never
    another exception) or returns a plan whose encoding is those very words, so that no two payloads read as the
    same plan (a lenient flag, a repeated dict key or a count read loosely would)."""
    header, payload = encode(_plan_with_everything())
    words, caught = payload.tolist(), 0
    for i, w in enumerate(words):
        for v in {w + 1, w - 1, 0, 1, 2, -1, INT64[1], INT64[0]} - {w}:
            if not INT64[0] <= v <= INT64[1]:
                continue
            corrupt = torch.tensor(words[:i] + [v] + words[i + 1:])
            try:
                plan = decode(header, corrupt)
            except PlanFormatError:
                caught += 1
                continue
            again_header, again = encode(plan)
            assert again.tolist() == corrupt.tolist() and torch.equal(again_header, header), (i, w, v)
    assert caught > len(words)  # most corruptions are caught (a changed token id or value cannot be)


def test_a_dict_that_repeats_a_key_fails_loudly():
    header, payload = encode(StepPlan(0, decode=[5, 6], tables={5: [[1]], 6: [[2]]}))
    words = payload.tolist()
    # cancels, admissions, prefills (counts 0), decodes (2: 5, 6), tables (2: 5 -> 1 group [1], 6 -> 1 group [2]),
    # preempted, polls (counts 0)
    assert words == [0, 0, 0, 2, 5, 6, 2, 5, 1, 1, 1, 6, 1, 1, 2, 0, 0]
    words[11] = 5
    with pytest.raises(PlanFormatError, match="repeats a key"):
        decode(header, torch.tensor(words))


@pytest.mark.parametrize("change,words", [
    (lambda p: p.tables.pop(4), "tables are for requests"),  # a request with work and no table
    (lambda p: p.tables.update({99: [[1], [2]]}), "tables are for requests"),  # a table nobody runs
    (lambda p: p.tables.update({4: [[1]]}), "different, or no, block groups"),
    (lambda p: p.tables.update({4: []}), "different, or no, block groups"),
    (lambda p: p.tables.update({4: [[1], [-1]]}), "negative block id"),
    (lambda p: p.prefill.append((3, 5, 1)), "more than one chunk or decode"),
    (lambda p: p.decode.append(3), "more than one chunk or decode"),
    (lambda p: setattr(p, "prefill", [(3, 0, 0)]), "tokens >= 1"),
    (lambda p: setattr(p, "prefill", [(3, -1, 2)]), "first position >= 0"),
    (lambda p: setattr(p, "step", -1), "step -1 is outside"),
    (lambda p: setattr(p, "stop", 1), "stop 1 is not bool"),
    (lambda p: setattr(p, "cancel", (1, 2)), r"cancel \(1, 2\) is not \[int\]"),
    (lambda p: setattr(p, "prefill", [[3, 0, 2]]), "prefill .* is not"),
    (lambda p: p.admit.append("not an admission"), "admit .* is not"),
    (lambda p: setattr(p, "poll", [2**63]), "64-bit"),
])
def test_rank_0_cannot_send_a_plan_the_ranks_cannot_run(change, words):
    plan = StepPlan(2, [Admission(3, [1, 2], 2)], prefill=[(3, 0, 2)], decode=[4],
                    tables={3: [[1], [0]], 4: [[2], [3]]})
    encode(plan)  # as it is, it packs
    bad = copy.deepcopy(plan)
    change(bad)
    with pytest.raises(ValueError, match=words):
        encode(bad)
