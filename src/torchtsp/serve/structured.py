"""Structured output with xgrammar (the optional extra ``torchtsp[structured]``): the request's grammar, the
per-rank compiler and matchers, and the token mask applied to one rank's vocabulary slice.

The HTTP process turns ``response_format`` / ``guided_json`` / ``guided_regex`` / ``guided_choice`` into one
(kind, source) pair and checks that xgrammar parses it (a bad schema or regex is a 400 naming its field). The
pair travels in the step plan; every rank compiles it with the same compiler (the served tokenizer's vocabulary,
cached per rank) and keeps its own ``GrammarMatcher`` per sequence, advanced with the chosen tokens, which are
the same on every rank, so every rank computes the same token bitmask. Each rank applies the bitmask to its own
columns of the logits before the token is chosen: the full logits are never gathered for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading

import torch

from .plan import MAX_GRAMMAR_BYTES
from .protocol import APIError

INSTALL = "structured output needs xgrammar: pip install 'torchtsp[structured]'"
# JSON from a schema is compact (xgrammar's any_whitespace=False): with free whitespace between tokens a weak
# model can emit whitespace until max_tokens and never close the object.
COMPILER_THREADS = 2
COMPILE_CACHE_BYTES = 256 << 20  # compiled grammars kept per process: distinct grammars sent in a loop stay bounded
# The HTTP process compiles each grammar against the served vocabulary before admission (so that no grammar it
# accepts is refused by the ranks), on a pool of its own: a slow grammar never waits behind prompt tokenization
# nor holds it up. One that has not compiled by the deadline fails its own request.
CHECK_THREADS = 2
CHECK_DEADLINE_S = 10.0
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_CHOICES = 256


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


def _why(e: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)[:200]


def requested_grammar(body) -> tuple[str, str, str] | None:
    """(kind, source, field) of the structured output a request asks for, unchecked (None: plain text)."""
    asked = [f for f in GUIDED_FIELDS if getattr(body, f, None) not in (None, {"type": "text"})]
    if len(asked) > 1:
        raise APIError(400, f"give at most one of {', '.join(GUIDED_FIELDS)}; got {' and '.join(asked)}", asked[1])
    if not asked:
        return None
    field, value = asked[0], getattr(body, asked[0])
    if field == "guided_regex":
        return "regex", value, field
    if field == "guided_grammar":
        return "ebnf", value, field
    if field == "guided_choice":
        if not value or len(value) > MAX_CHOICES or any(c == "" for c in value):
            raise APIError(400, f"guided_choice must be 1 to {MAX_CHOICES} non-empty strings", field)
        # JSON's string escapes are EBNF's: each choice is one literal.
        return "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value), field
    if field == "guided_json":
        return "json_schema", value if isinstance(value, str) else json.dumps(value), field
    kind = value.get("type")
    if kind == "json_object":
        return "json_object", "", field
    if kind != "json_schema":
        raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}"[:200],
                       field)
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict | bool):
        raise APIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                            "{...}}}", field)
    return "json_schema", json.dumps(schema), field


def check_grammar(kind: str, source: str, field: str) -> None:
    """400 unless xgrammar is installed and parses the grammar (no tokenizer needed: cheap)."""
    xgr = _xgrammar()
    if xgr is None:
        raise APIError(400, INSTALL, field, "unsupported_parameter")
    if len(source.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise APIError(400, f"{field}: the grammar has more than {MAX_GRAMMAR_BYTES} bytes", field)
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(source, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(source)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (C++) or ValueError for bad input
        raise APIError(400, f"{field}: xgrammar cannot use it: {_why(e)}", field) from None


class GrammarCheck:
    """The HTTP process's grammar check: xgrammar parses the grammar, then compiles it with the served tokenizer's
    vocabulary exactly as every rank will (``Grammars``), on a bounded pool of its own with a deadline. A grammar
    that passes compiles on the ranks too; one that fails is a 400 naming its field."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None, deadline_s: float = CHECK_DEADLINE_S):
        self.grammars = Grammars(tokenizer, vocab_size, eos)
        self.deadline_s = deadline_s
        self.pool = concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="grammar-check")

    def _compile(self, kind: str, source: str, field: str) -> None:
        check_grammar(kind, source, field)
        try:
            self.grammars.matcher(kind, source)
        except Exception as e:  # noqa: BLE001 - xgrammar's C++ errors (a token id outside the vocabulary, ...)
            raise APIError(400, f"{field}: the grammar does not compile for this model's vocabulary: {_why(e)}",
                           field) from None

    async def check(self, kind: str, source: str, field: str) -> None:
        future = asyncio.get_running_loop().run_in_executor(self.pool, self._compile, kind, source, field)
        try:
            await asyncio.wait_for(future, self.deadline_s)
        except TimeoutError:
            raise APIError(400, f"{field}: the grammar did not compile within {self.deadline_s:g} s; simplify it",
                           field) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# xgrammar 0.2.9 writes a string with minLength / maxLength as characters of this class, which lets a raw control
# character (U+0000-U+001F) through (JSON wants those escaped: such an output does not parse) and no escape at all
# (no quote nor newline in the string). The grammar's text is rewritten with a character as JSON has it: any but
# those, or an escape (one character, as maxLength counts it); xgrammar's rule for other strings is the same.
LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
JSON_STRING_CHAR = "torchtsp_json_char"
JSON_STRING_CHAR_RULE = (JSON_STRING_CHAR + r' ::= [^\0-\x1f\"\\] | "\\" ([\"\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] '
                         r'[A-Fa-f0-9] [A-Fa-f0-9])')


def json_schema_ebnf(source: str) -> str | None:
    """The EBNF of a JSON schema's grammar where xgrammar's own would let a raw control character into a string;
    None where it would not (the schema compiles as it is)."""
    ebnf = str(_xgrammar().Grammar.from_json_schema(source, any_whitespace=False))
    if LOOSE_STRING_CHAR not in ebnf:
        return None
    return ebnf.replace(LOOSE_STRING_CHAR, JSON_STRING_CHAR) + "\n" + JSON_STRING_CHAR_RULE + "\n"


def tokenizer_info(tokenizer, vocab_size: int, eos: int | None):
    """xgrammar's view of the served tokenizer, over the model's ``vocab_size`` ids (ids past the tokenizer's
    vocabulary are never allowed). A tokenizers-library tokenizer (HFTokenizer) or the byte tokenizer."""
    xgr = _xgrammar()
    stops = [eos] if eos is not None else None
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None:  # the byte tokenizer: ids 0..255 are bytes, the rest are special
        vocab = [bytes([i]) for i in range(min(256, vocab_size))] + [""] * max(0, vocab_size - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = [""] * vocab_size
    for token, i in inner.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    encoding = tokenizer.vocab_encoding()  # what xgrammar's from_huggingface would detect from the same file
    return xgr.TokenizerInfo(vocab, xgr.VocabType[encoding.kind.upper()], vocab_size=vocab_size,
                             stop_token_ids=stops, add_prefix_space=encoding.add_prefix_space)


class Grammars:
    """One rank's grammar compiler (built at the first structured request, with its compile cache) and bitmasks."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos
        self.compiler = None
        self._lock = threading.Lock()  # compiles run on several threads
        # A rank compiles on these threads while its steps go on (batch.py); the HTTP process's check has its own.
        self.pool = concurrent.futures.ThreadPoolExecutor(COMPILER_THREADS, thread_name_prefix="grammar-compile")

    def matcher(self, kind: str, source: str):
        """A fresh GrammarMatcher for one sequence; raises (the same on every rank) when it cannot be built."""
        xgr = _xgrammar()
        if xgr is None:
            raise RuntimeError(INSTALL)
        if self.tokenizer is None:
            raise RuntimeError("structured output needs the model's tokenizer")
        with self._lock:
            if self.compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos)
                self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS,
                                                     cache_limit_bytes=COMPILE_CACHE_BYTES)
        if kind == "json_object":
            compiled = self.compiler.compile_builtin_json_grammar()
        elif kind == "json_schema":
            ebnf = json_schema_ebnf(source)
            compiled = (self.compiler.compile_json_schema(source, any_whitespace=False) if ebnf is None
                        else self.compiler.compile_grammar(ebnf))
        elif kind == "regex":
            compiled = self.compiler.compile_regex(source)
        else:
            compiled = self.compiler.compile_grammar(source)
        return xgr.GrammarMatcher(compiled)

    def bitmask(self, matchers: list) -> torch.Tensor:
        """[len(matchers), ceil(V / 32)] int32: bit t % 32 of word t // 32 allows token t."""
        mask = torch.full((len(matchers), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        return mask


def allowed_counts(bitmask: torch.Tensor, vocab_size: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens each row allows, of which among ``ids``) from a [n, words] bitmask."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    bits = bits.flatten(1)[:, :vocab_size].bool()
    among = bits[:, ids].sum(dim=1) if ids else torch.zeros(len(bitmask), dtype=torch.long)
    return bits.sum(dim=1), among


def mask_vocab_slice(logits: torch.Tensor, bitmask: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """``logits`` [n, cols], columns ``vocab_start``.. of the vocabulary, with -inf where the bitmask [n, words]
    forbids the token; columns past ``vocab_size`` (padding) are -inf too."""
    cols = logits.shape[-1]
    ids = torch.arange(vocab_start, vocab_start + cols, device=logits.device)
    real = ids < vocab_size
    ids = ids.clamp(max=vocab_size - 1)
    words = bitmask.to(logits.device)[:, ids // 32]
    allowed = ((words >> (ids % 32).to(torch.int32)) & 1).bool() & real
    return logits.masked_fill(~allowed, float("-inf"))
