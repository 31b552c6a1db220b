"""The completion service: everything the endpoints do, without HTTP.

``CompletionService`` checks a parsed request against the model (vocabulary, context length, queue),
turns it into engine requests, and yields their text as it comes. The routes in app.py only parse the
body and shape the answer; tests drive the service directly with a stand-in engine client.

Work that grows with the request (tokenizing a long prompt, rendering a chat template) runs off the event
loop, so /health and the streams of other requests keep answering meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field

from .client import EngineClient
from .metrics import Metrics
from .plan import Sampling
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, _short, check_token_ids
from .structured import GrammarCheck, requested_grammar
from .template import ChatTemplate
from .text import TextStream
from .tools import ToolChoice, ToolOutput, template_messages, tool_choice

DISCONNECT_POLL_S = 0.25


COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (vLLM's too): not the whole context

# A non-streamed answer is held whole, shaped and encoded at once (off the event loop, but in memory): a request
# whose answer could exceed MAX_ANSWER_BYTES is refused before it runs (400 naming n, logprobs or max_tokens), as
# estimated for every choice running to max_tokens with tokens of about 4 characters: each token's text
# (JSON-escaped), and each logprob entry (the chosen token and each alternative) as completions and chat shape it.
# A streamed answer is sent chunk by chunk and is not bounded.
MAX_ANSWER_BYTES = 64 << 20
TEXT_BYTES_PER_TOKEN = 16
LOGPROB_ENTRY_BYTES = {False: 32, True: 80}  # completions ("text": -1.234 in a dict), chat ({token, logprob, bytes})


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    template: ChatTemplate | None
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    api_key: str | None
    max_queue: int
    metrics: Metrics
    tool_call_parser: str | None = None  # --tool-call-parser: how tool_choice auto reads the model's calls
    max_answer_bytes: int = MAX_ANSWER_BYTES  # a non-streamed answer's estimated size at most


@dataclass
class Choice:
    """One prompt's checked request to the engine."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_strings: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool = False
    echo_text: str = ""
    min_tokens: int = 0
    grammar: tuple[str, str] | None = None  # (kind, source): structured output
    grammar_field: str | None = None  # the request field that asked for it (named by a refusal)
    tools: ToolChoice | None = None  # chat with tools: how the output becomes tool calls
    sample: int = 0  # which of its prompt's n choices
    logprobs: int | None = None  # top alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None = None  # per prompt token (echo with logprobs)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)


@dataclass
class Event:
    """A choice's progress: a text delta, and its finish reason on the last one."""

    index: int
    delta: str
    finish: str | None
    tokens: int  # completion tokens so far
    logprobs: list = field(default_factory=list)  # (id, logprob or None, top or None) of the tokens it covers


def _shown_tokens(c: Choice) -> int:
    """Tokens whose text a choice's answer may hold: its max_tokens, and its prompt's when echoed."""
    return c.max_tokens + (len(c.prompt) if c.echo_text else 0)


def _logprob_entries(c: Choice) -> int:
    """Logprob entries (a token's own and its alternatives') a choice's answer may hold."""
    if c.logprobs is None:
        return 0
    prompt = 0 if c.prompt_logprobs is None else len(c.prompt) * (1 + c.prompt_logprobs)
    return c.max_tokens * (1 + c.logprobs) + prompt


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


JSON_ROWS = 256  # per-token rows encoded by one json.dumps call


def _json_pieces(value, depth: int = 0):
    """The JSON text of an answer in pieces. json.dumps runs in C and keeps the GIL for the whole call, so a
    worker thread encoding 60 MB at once would still stall the event loop for a second: the answer, its choices,
    each choice and its logprobs are walked here, and their per-token lists encoded JSON_ROWS rows at a time
    (between two pieces the loop gets the GIL back)."""
    if isinstance(value, dict) and depth <= 3:  # the answer, a choice, its logprobs (or message)
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ("," if i else "") + _dumps(k) + ":"
            yield from _json_pieces(v, depth + 1)
        yield "}"
    elif isinstance(value, list) and depth <= 1:  # the choices
        yield "["
        for i, v in enumerate(value):
            yield from ([","] if i else [])
            yield from _json_pieces(v, depth + 1)
        yield "]"
    elif isinstance(value, list) and value and depth <= 4:  # per-token rows
        yield "["
        for i in range(0, len(value), JSON_ROWS):
            yield ("," if i else "") + _dumps(value[i:i + JSON_ROWS])[1:-1]
        yield "]"
    else:
        yield _dumps(value)


def json_bytes(answer: dict) -> bytes:
    """An answer as FastAPI's JSONResponse encodes it (compact, UTF-8, no NaN), in pieces: for a worker thread."""
    return "".join(_json_pieces(answer)).encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _max_text_chars(tokenizer, max_model_len: int) -> int:
    """Characters past which a text cannot fit the context, so tokenizing it is wasted work (a 10 MB prompt
    takes minutes): no token covers more characters than the longest entry of the vocabulary; twice that
    leaves room for normalizers that drop characters."""
    vocab = getattr(getattr(tokenizer, "tokenizer", None), "get_vocab", None)
    longest = max(map(len, vocab(with_added_tokens=True)), default=1) if vocab is not None else 4
    return 2 * max_model_len * max(longest, 1) + 1024


def _prompt_tokens(choices: list[Choice]) -> int:
    """The prompts' tokens, each prompt once however many choices it has (n)."""
    return sum(len(c.prompt) for c in choices if c.sample == 0)


def _cache_exceeded(cache: int, n: int, max_tokens: int, param: str) -> APIError:
    """A sequence whose prompt and new tokens (all but the last, which is never cached) outgrow the whole KV
    cache could never run, however long it waited."""
    if n > cache:
        return APIError(400, f"the prompt has {n} tokens, more than the server's whole KV cache holds ({cache} "
                             f"tokens); shorten it, or restart the server with a larger --kv-cache-mb", param,
                        "context_length_exceeded")
    need = n + max_tokens - 1
    return APIError(400, f"this request needs {need} tokens of KV cache (a prompt of {n} tokens and max_tokens "
                         f"{max_tokens}), more than the server's whole KV cache holds ({cache} tokens); lower "
                         f"max_tokens to at most {cache + 1 - n}, or restart the server with a larger --kv-cache-mb",
                    "max_tokens", "context_length_exceeded")


def _ids_text(ids) -> str:
    return " ".join(map(str, ids))


# Engine outcomes that fail the request rather than end it.
_FAILED = {
    "cancelled": (503, "the request was stopped: the server is shutting down", None, "server_shutdown"),
    "too_long": (400, "the prompt and max_tokens do not fit the KV cache; lower max_tokens, or restart the server "
                      "with a larger --kv-cache-mb", "max_tokens", "context_length_exceeded"),
    "rejected": (500, "the engine refused this request's values (a check of the HTTP side let them pass); the "
                      "server is still up", None, "engine_rejected"),
    "bad_grammar": (400, "the engine could not compile this request's grammar for the model's tokenizer", None,
                    "bad_grammar"),
    "error": (500, "the engine failed while running this request's step", None, "engine_failed"),
    "grammar_timeout": (400, "the grammar did not compile on the engine in time; simplify it", None, "bad_grammar"),
}


class CompletionService:
    draining = False  # shutting down (drain): nothing new is admitted

    def __init__(self, state: ServerState):
        self.state, self.client, self.metrics = state, state.client, state.metrics
        self.max_text_chars = _max_text_chars(state.tokenizer, state.max_model_len)
        self._token_texts: dict[int, str] = {}
        self.grammar_check = GrammarCheck(state.tokenizer, state.vocab_size, state.eos_token_id)

    # -- checks ------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.state.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.state.model_name!r}",
                           "model", "model_not_found")

    def check_engine(self) -> None:
        client = self.client
        if client.state == "loading":
            raise APIError(503, "the model is still loading; retry in a moment", None, "engine_loading")
        if client.state != "ready":
            raise APIError(503, f"the engine is not available: {client.error or client.state}", None,
                           "engine_unavailable")

    def check_ids(self, ids: list[int], param: str) -> None:
        check_token_ids(ids, self.state.vocab_size, param)

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """On a worker thread (``encode_batch``: the tokenizers library lets go of the GIL there, not in
        ``encode``), after refusing a text too long to fit the context whatever it holds."""
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", "prompt")
        if len(text) > self.max_text_chars:
            raise APIError(400, f"{param} has {len(text)} characters: more than this model's maximum context "
                                f"length ({self.state.max_model_len} tokens) can hold", param,
                           "context_length_exceeded")
        return (await asyncio.to_thread(tokenizer.encode_batch, [text]))[0]

    async def decode(self, ids: list[int]) -> str:
        if self.state.tokenizer is None:
            return _ids_text(ids)
        return await asyncio.to_thread(self.state.tokenizer.decode, ids)

    def choice(self, body, prompt: list[int], max_tokens: int | None, param: str = "prompt",
               default_max_tokens: int | None = None) -> Choice:
        """One prompt's checked request. Without ``max_tokens``: ``default_max_tokens`` (completions: OpenAI's 16)
        or, for chat, the rest of the context (as vLLM), never past the context. ``max_tokens`` 0 only with echo:
        the prompt (and its logprobs) alone."""
        if not prompt:
            raise APIError(400, f"{param} is empty; give at least one token", param)
        limit, n = self.state.max_model_len, len(prompt)
        if n >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                f"tokens, which leaves no room for a new one", param, "context_length_exceeded")
        self.check_ids(prompt, param)
        cache = self.kv_capacity()
        if max_tokens is None:  # the room left in the context, and in the whole KV cache (prompt + max_tokens - 1)
            room = limit - n if cache is None else max(1, min(limit - n, cache + 1 - n))
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        echo = getattr(body, "echo", False)
        if max_tokens < (0 if echo else 1):
            raise APIError(400, f"max_tokens must be >= {0 if echo else '1 (0 only with echo)'}, got "
                                f"{max_tokens}", "max_tokens")
        if n + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                f"tokens and max_tokens asks for {max_tokens} ({n + max_tokens} in all)",
                           "max_tokens", "context_length_exceeded")
        if cache is not None and n + max(max_tokens, 1) - 1 > cache:
            raise _cache_exceeded(cache, n, max_tokens, param)
        temperature, top_k, top_p, seed = body.sampling_values(self.state.vocab_size)
        stop_ids = body.stop_ids(self.state.vocab_size)
        seed = secrets.randbelow(2**63) if seed is None else seed
        if not 0 <= body.min_tokens <= max_tokens:
            raise APIError(400, f"min_tokens must be in [0, max_tokens = {max_tokens}], got {_short(body.min_tokens)}",
                           "min_tokens")
        logprobs, prompt_logprobs = body.logprob_counts()
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # the engine runs a prefill for nothing else; its logprobs are not shown
        sampling = Sampling(temperature, top_k, top_p, seed, **body.penalty_values(self.state.vocab_size))
        return Choice(prompt, max_tokens, sampling, body.stop_strings(), stop_ids,
                      body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      tokens_as_ids=body.return_tokens_as_token_ids)

    def kv_capacity(self) -> int | None:
        """Tokens the engine's whole KV cache holds, once its ready message has said (None before)."""
        return getattr(self.client, "info", {}).get("kv_capacity_tokens")

    async def grammar(self, body) -> tuple[str, str, str] | None:
        """(kind, source, field) of the structured output a request asks for, compiled for the served vocabulary
        off the event loop (None: plain text)."""
        asked = requested_grammar(body)
        if asked is None:
            return None
        if self.state.tokenizer is None:
            raise APIError(400, "structured output needs the model's tokenizer; this model has none", asked[2])
        await self.grammar_check.check(*asked)
        return asked

    def samples(self, body, choices: list[Choice], grammar: tuple[str, str, str] | None) -> list[Choice]:
        """Each prompt's ``body.n`` choices, in index order (prompt-major). Choice i of a prompt samples with seed
        (seed + i) mod 2^63, where seed is the request's, or a random one per prompt: n = 1 is the request itself,
        and choice i is what a single request with seed + i gives."""
        if len(choices) * body.n > self.state.max_queue:
            raise APIError(400, f"n ({body.n}) times the prompts ({len(choices)}) is more than the server's queue "
                                f"ever holds ({self.state.max_queue}, --max-queue); ask for fewer", "n")
        made = [dataclasses.replace(c, sampling=dataclasses.replace(c.sampling, seed=(c.sampling.seed + i) % 2**63),
                                    grammar=grammar and grammar[:2], grammar_field=grammar and grammar[2], sample=i)
                for c in choices for i in range(body.n)]
        if not body.stream:
            self.check_answer_size(made, isinstance(body, ChatCompletionRequest), body.n)
        return made

    def check_answer_size(self, choices: list[Choice], chat: bool, n: int) -> None:
        """400 when the whole answer could exceed ``max_answer_bytes`` (see MAX_ANSWER_BYTES), naming what to lower:
        logprobs when the answer fits without them, else n when one choice per prompt fits, else max_tokens."""
        limit = self.state.max_answer_bytes
        text = sum(_shown_tokens(c) for c in choices) * TEXT_BYTES_PER_TOKEN
        entries = sum(_logprob_entries(c) for c in choices) * LOGPROB_ENTRY_BYTES[chat]
        if text + entries <= limit:
            return
        if entries and text <= limit:
            param = "top_logprobs" if chat and any(c.logprobs for c in choices) else "logprobs"
        else:
            param = "n" if n > 1 and (text + entries) / n <= limit else "max_tokens"
        top = max((c.logprobs for c in choices if c.logprobs is not None), default=None)
        with_logprobs = "" if top is None else f" with logprobs and {top} alternatives per token"
        raise APIError(400, f"this answer could reach {(text + entries) / 2**20:.0f} MiB ({len(choices)} choices of up "
                            f"to {max(c.max_tokens for c in choices)} tokens{with_logprobs}), more than the "
                            f"{limit / 2**20:g} MiB a non-streamed answer may have; lower {param}, or stream it "
                            f"(\"stream\": true)", param, "answer_too_large")

    def admit(self, choices: list[Choice]) -> None:
        self.check_engine()
        if self.draining:
            raise APIError(*_FAILED["cancelled"])
        self._check_prompt_count(len(choices))
        waiting = self.client.waiting
        if waiting + len(choices) > self.state.max_queue:
            raise APIError(429, f"the server's queue is full ({waiting} requests waiting, at most "
                                f"{self.state.max_queue}); retry later", None, "queue_full")

    def drain(self) -> None:
        """The server is stopping: refuse new requests (503) and have the engine end the waiting ones."""
        self.draining = True
        self.client.drain()

    # -- requests to choices -------------------------------------------------------------

    async def completion_choices(self, body: CompletionRequest) -> list[Choice]:
        body.refuse_unsupported()
        self.check_model(body.model)
        grammar = await self.grammar(body)
        p = body.prompt
        if isinstance(p, str):
            prompts = [await self.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            self._check_prompt_count(len(p))
            prompts = [await self.encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            self._check_prompt_count(len(p))
            prompts = list(p)
        else:
            prompts = [list(p)]
        choices = [self.choice(body, ids, body.max_tokens, "prompt", COMPLETION_DEFAULT_MAX_TOKENS) for ids in prompts]
        if body.echo:
            for c in choices:
                c.echo_text = await self.decode(c.prompt)
        return self.samples(body, choices, grammar)

    def _check_prompt_count(self, n: int) -> None:
        if n > self.state.max_queue:  # more than could ever wait (a 429 would be retried forever): 400
            raise APIError(400, f"this request has {n} prompts, more than the server's queue can ever hold (at most "
                                f"{self.state.max_queue}, --max-queue); send them in smaller requests", "prompt",
                           "too_many_prompts")

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None
                          ) -> list[int]:
        if self.state.template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions, or start the server with "
                                "--chat-template FILE", "messages", "no_chat_template")
        chars = len(json.dumps(messages)) + len(json.dumps(tools or []))
        if chars > self.max_text_chars:
            raise APIError(400, f"messages have {chars} characters: more than this model's maximum context length "
                                f"({self.state.max_model_len} tokens) can hold", "messages", "context_length_exceeded")
        text = await self.state.template.render_async(template_messages(messages), add_generation_prompt, tools)
        return await self.encode(text, "messages")

    async def tool_grammar(self, tools: ToolChoice) -> tuple[str, str, str]:
        """The grammar that forces a call (tool_choice required or named), each tool's schema compiled first so
        that one xgrammar cannot compile is a 400 naming the tool."""
        for name, schema in tools.schemas():
            try:
                await self.grammar_check.check("json_schema", schema, "tools")
            except APIError as e:
                raise APIError(400, f"tools: the parameters of {name!r} cannot constrain the output: "
                                    f"{e.message.removeprefix('tools: ')}", "tools") from None
        kind, source = tools.grammar()
        await self.grammar_check.check(kind, source, "tool_choice")
        return kind, source, "tool_choice"

    async def chat_choices(self, body: ChatCompletionRequest) -> list[Choice]:
        body.refuse_unsupported()
        self.check_model(body.model)
        tools = tool_choice(body.tools, body.tool_choice, self.state.tool_call_parser)
        grammar = await self.grammar(body)
        if tools is not None and tools.grammar() is not None:
            if grammar is not None:
                raise APIError(400, f"tool_choice {tools.mode} constrains the output to a call already; drop "
                                    f"{grammar[2]}", grammar[2])
            grammar = await self.tool_grammar(tools)
        ids = await self.render_chat(body.message_dicts(), body.add_generation_prompt,
                                     list(tools.tools) if tools is not None else None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        choice = dataclasses.replace(self.choice(body, ids, max_tokens, "messages"), tools=tools)
        return self.samples(body, [choice], grammar)

    # -- running choices ---------------------------------------------------------------

    def submit(self, choices: list[Choice]) -> list:
        """Admit and submit in one turn of the event loop (no await between them): a burst of requests cannot
        all pass the queue check before any of them counts as waiting."""
        self.admit(choices)
        return [self.client.submit(c.prompt, c.max_tokens, c.sampling, c.stop_token_ids, c.ignore_eos,
                                   min_tokens=c.min_tokens, grammar=c.grammar, logprobs=c.logprobs,
                                   prompt_logprobs=c.prompt_logprobs)
                for c in choices]

    async def run_choice(self, c: Choice, stream, out: asyncio.Queue, index: int, arrival: float) -> None:
        """Put the choice's events on ``out`` until it ends."""
        eos = self.state.eos_token_id
        skip = set(c.stop_token_ids) | ({eos} if eos is not None and not c.ignore_eos else set())
        tokenizer = self.state.tokenizer
        text = TextStream(tokenizer.decode if tokenizer is not None else _ids_text, c.stop_strings, skip)
        tokens, first_at, last_at, reason = 0, None, None, None  # reason None: not ended (the client left)
        pending: list = []  # logprobs of tokens not yet in an event
        try:
            while True:
                kind, *value = await stream.next()
                if kind == "token":
                    tokens, now = tokens + 1, time.monotonic()
                    if last_at is not None:
                        self.metrics.itl.observe(now - last_at)
                    first_at, last_at = first_at or now, now
                    delta = text.add(value[0])
                    if c.logprobs is not None and len(value) > 1 and value[1] is not None:
                        pending.append((value[0], *value[1]))
                    if text.stopped:
                        reason = "stop"
                        self.client.cancel(stream)
                        await out.put(Event(index, delta, "stop", tokens, pending))
                        return
                    if delta or pending:
                        await out.put(Event(index, delta, None, tokens, pending))
                        pending = []
                elif kind == "prompt_logprobs":
                    if c.logprobs is not None:  # echo with logprobs: the prompt's text comes with them
                        entries = [(t, None, None) if e is None else (t, *e) for t, e in zip(c.prompt, value[0])]
                        await out.put(Event(index, c.echo_text, None, 0, entries))
                elif kind == "finished":
                    reason = value[0]
                    if value[0] in ("bad_grammar", "grammar_timeout"):
                        status, message, _, code = _FAILED[value[0]]
                        raise APIError(status, f"{c.grammar_field}: {message}", c.grammar_field, code)
                    if value[0] in _FAILED:
                        raise APIError(*_FAILED[value[0]])
                    await out.put(Event(index, text.finish(), value[0], tokens, pending))
                    return
                elif kind == "error":
                    reason = "error"
                    raise APIError(500, f"the engine failed while running this request: {value[0]}", None,
                                   "engine_failed")
        finally:
            if reason is None:
                self.client.cancel(stream)  # the client went away: free its blocks at the next step
            self._observe(c, tokens, first_at, arrival, reason or "abort")

    def _observe(self, c: Choice, tokens: int, first_at: float | None, arrival: float, reason: str) -> None:
        metrics, now = self.metrics, time.monotonic()
        if first_at is not None:
            metrics.ttft.observe(first_at - arrival)
            if tokens > 1:
                metrics.tpot.observe((now - first_at) / (tokens - 1))
        metrics.e2e.observe(now - arrival)
        metrics.generation_tokens.inc(tokens)
        metrics.prompt_tokens.inc(len(c.prompt))
        metrics.finished(reason)

    async def events(self, choices: list[Choice], streams: list, disconnected):
        """Every choice's events as they come (the choices run concurrently); ends early when the awaitable
        ``disconnected()`` says the client left."""
        out: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic()
        tasks = [asyncio.ensure_future(self.run_choice(c, s, out, i, arrival))
                 for i, (c, s) in enumerate(zip(choices, streams))]
        open_, checked, get = len(choices), time.monotonic(), None
        try:
            while open_:
                get = asyncio.ensure_future(out.get())
                done, _ = await asyncio.wait({get, *[t for t in tasks if not t.done()]},
                                             timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    event = get.result()
                    open_ -= event.finish is not None
                    yield event
                else:
                    get.cancel()
                    for t in tasks:
                        if t.done() and t.exception() is not None:
                            raise t.exception()
                if time.monotonic() - checked > DISCONNECT_POLL_S:  # a client that left frees its rows
                    checked = time.monotonic()
                    if await disconnected():
                        return
        finally:
            # Cancelled while waiting (starlette cancels a stream whose client left), ``get`` would stay pending
            # for good: "Task was destroyed but it is pending!" in the log when it is collected.
            for t in [*tasks, *([get] if get is not None else [])]:
                t.cancel()

    # -- answers -----------------------------------------------------------------------

    async def complete(self, choices: list[Choice], streams: list, chat: bool, disconnected) -> dict | None:
        """The whole answer (None when the client left before the end: nobody reads it)."""
        created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
        texts = [_leading_echo(c) for c in choices]
        finish, counts, entries = [None] * len(choices), [0] * len(choices), [[] for _ in choices]
        async for e in self.events(choices, streams, disconnected):
            texts[e.index] += e.delta
            counts[e.index] = e.tokens
            finish[e.index] = e.finish or finish[e.index]
            entries[e.index] += e.logprobs
        if any(f is None for f in finish):
            return None

        def shape() -> dict:  # on a worker thread: 2 prompts x n 128 x logprobs 20 took seconds on the event loop
            shown = [LogprobFormat(self.token_text, chat, c.tokens_as_ids).shape(es) if c.logprobs is not None
                     else None for c, es in zip(choices, entries)]
            made = [{"index": i, **_message(c, t, f), "logprobs": lp} if chat
                    else {"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                    for i, (c, t, f, lp) in enumerate(zip(choices, texts, finish, shown))]
            return {"id": _request_id(chat), "object": kind, "created": created, "model": self.state.model_name,
                    "choices": made, "usage": _usage(_prompt_tokens(choices), sum(counts))}

        return await asyncio.to_thread(shape) if any(c.logprobs is not None for c in choices) else shape()

    async def stream(self, choices: list[Choice], streams: list, chat: bool, include_usage: bool, disconnected,
                     continuous_usage: bool = False):
        """Server-sent events: the chunks, an error event if the request fails midway, then [DONE].
        ``continuous_usage``: every choice chunk carries its choice's usage so far (its prompt's tokens and the
        tokens it has generated, as vLLM's continuous_usage_stats); otherwise ``usage`` is null until the last
        chunk (include_usage)."""
        chunks = _Chunks(_request_id(chat), self.state.model_name, chat, include_usage)
        counts = [0] * len(choices)
        formats = [LogprobFormat(self.token_text, chat, c.tokens_as_ids) if c.logprobs is not None else None
                   for c in choices]

        def usage(i: int) -> dict | None:
            return _usage(len(choices[i].prompt), counts[i]) if continuous_usage else None

        try:
            for i, c in enumerate(choices):
                if chat:
                    yield chunks.choice(i, "", None, role=True, usage=usage(i))
                elif _leading_echo(c):
                    yield chunks.choice(i, c.echo_text, None, usage=usage(i))
            tools = [ToolOutput(c.tools) if chat and c.tools is not None else None for c in choices]
            async for e in self.events(choices, streams, disconnected):
                counts[e.index] = e.tokens
                shown = formats[e.index].shape(e.logprobs) if formats[e.index] is not None else None
                if tools[e.index] is not None:  # content until a call may begin; the calls when the output ends
                    for chunk in chunks.tool_choice(e.index, tools[e.index], e.delta, e.finish, shown,
                                                    usage(e.index)):
                        yield chunk
                elif e.delta or e.finish or e.logprobs:
                    yield chunks.choice(e.index, e.delta, e.finish, logprobs=shown, usage=usage(e.index))
            if include_usage:
                yield chunks.usage(_usage(_prompt_tokens(choices), sum(counts)))
        except APIError as e:  # mid-stream: an error event, then the end of the stream
            yield _sse(e.body())
        except Exception as e:  # noqa: BLE001 - a bug mid-stream: an error event all the same
            yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}"[:500]).body())
        yield "data: [DONE]\n\n"

    # -- tokenize / detokenize -------------------------------------------------------------

    async def tokenize(self, body) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            ids = await self.encode(body.prompt)
        else:
            messages = ChatCompletionRequest(messages=body.messages).message_dicts()
            ids = await self.render_chat(messages, body.add_generation_prompt, body.tools)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.state.max_model_len}

    def model_card(self, model_id: str | None = None) -> dict:
        """The served model as ``/v1/models`` lists it (404 for another id)."""
        self.check_model(model_id)
        layout = getattr(self.state.client, "info", {}).get("kv_layout")  # the engine's, once it is ready
        return {"id": self.state.model_name, "object": "model", "created": 0, "owned_by": "torchtsp",
                "max_model_len": self.state.max_model_len, **({"kv_layout": layout} if layout else {})}

    def tokenizer_info(self) -> dict:
        """What a client needs to tokenize as the server does (lm-evaluation-harness reads it with /tokenize)."""
        tokenizer = self.state.tokenizer
        ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "eos_token_id": self.state.eos_token_id,
               "pad_token_id": getattr(tokenizer, "pad_id", None)}
        text = {f"{k.removesuffix('_id')}": (None if v is None or tokenizer is None else self._token_text(v))
                for k, v in ids.items()}
        template = self.state.template
        return {"tokenizer_class": "PreTrainedTokenizerFast" if tokenizer is not None else None,
                "vocab_size": self.state.vocab_size, "model_max_length": self.state.max_model_len, **ids, **text,
                "chat_template": getattr(template, "source", None)}

    def token_text(self, token_id: int) -> str:
        """One token's text as the logprobs show it (special tokens: empty, as the text skips them)."""
        cache = self._token_texts
        if token_id not in cache:
            tokenizer = self.state.tokenizer
            cache[token_id] = tokenizer.decode([token_id]) if tokenizer is not None else _ids_text([token_id])
        return cache[token_id]

    def _token_text(self, token_id: int) -> str | None:
        inner = getattr(self.state.tokenizer, "tokenizer", None)  # the tokenizers library's object
        return inner.id_to_token(token_id) if inner is not None else None

    async def detokenize(self, body) -> dict:
        self.check_model(body.model)
        if len(body.tokens) > self.state.max_model_len:
            raise APIError(400, f"at most {self.state.max_model_len} tokens (the model's maximum context length), got "
                                f"{len(body.tokens)}", "tokens")
        self.check_ids(body.tokens, "tokens")
        if self.state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        return {"prompt": await self.decode(body.tokens)}


def _request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def _sse(payload: dict) -> str:
    return "data: " + json.dumps(payload) + "\n\n"


class _Chunks:
    """The chunks of one streamed answer (OpenAI's shapes for completions and chat)."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool):
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.chat, self.usage_field = chat, {"usage": None} if include_usage else {}

    def choice(self, i: int, delta: str, reason: str | None, role: bool = False, logprobs: dict | None = None,
               usage: dict | None = None, tool_calls: list | None = None) -> str:
        if self.chat:
            part = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            if tool_calls:
                part["tool_calls"] = [call.to_dict(index=k) for k, call in enumerate(tool_calls)]
            c = {"index": i, "delta": part, "logprobs": logprobs, "finish_reason": reason}
        else:
            c = {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        return _sse({**self.head, "choices": [c], **({"usage": usage} if usage is not None else self.usage_field)})

    def usage(self, usage: dict) -> str:
        return _sse({**self.head, "choices": [], "usage": usage})

    def tool_choice(self, i: int, out: ToolOutput, delta: str, reason: str | None, logprobs: dict | None,
                    usage: dict | None) -> list[str]:
        """The chunks of one event of a chat choice with tools (OpenAI's stream shapes): the content that can go
        out; at the end, what was held back, each call (id, type, name and its arguments whole) and the finish."""
        content, calls = out.add(delta), []
        if reason is not None:
            rest, calls, reason = out.finish(reason)
            content += rest
        made = [self.choice(i, content, None, logprobs=logprobs, usage=usage)] if content or logprobs else []
        if calls:
            made.append(self.choice(i, "", None, usage=usage, tool_calls=calls))
        if reason is not None:
            made.append(self.choice(i, "", reason, usage=usage))
        return made


def _message(c: Choice, text: str, finish: str) -> dict:
    """A chat choice's message and finish reason: with tools, the calls its text holds (finish "tool_calls")."""
    if c.tools is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
    out = ToolOutput(c.tools)
    content = out.add(text)
    rest, calls, finish = out.finish(finish)
    message = {"role": "assistant", "content": (content + rest) or None}
    if calls:
        message["tool_calls"] = [call.to_dict() for call in calls]
    return {"message": message, "finish_reason": finish}


def _leading_echo(c: Choice) -> str:
    """The echoed prompt sent before any token; with logprobs it comes with them, once the prefill ends."""
    return c.echo_text if c.logprobs is None else ""


LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity; a vocabulary padding column's logprob shows as this (vLLM's)


def _finite(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR)


class LogprobFormat:
    """Token logprobs in OpenAI's shapes. Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token
    text -> logprob, the top N and the chosen token, as the legacy API and vLLM give them; tokens of the same
    text share one key) and ``text_offset`` (each token's start in the choice's text, counted across the chunks
    of a stream). Chat: ``content`` entries with token, logprob, bytes and the top N. ``as_ids``: tokens are
    named "token_id:N" (offsets and bytes still count their text)."""

    def __init__(self, token_text, chat: bool, as_ids: bool = False):
        self.token_text, self.chat, self.as_ids, self.offset = token_text, chat, as_ids, 0

    def _name(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.token_text(token)

    def shape(self, entries: list) -> dict:
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, lp, top in entries]}
        offsets = []
        for t, _, _ in entries:
            offsets.append(self.offset)
            self.offset += len(self.token_text(t))
        return {"tokens": [self._name(t) for t, _, _ in entries],
                "token_logprobs": [None if lp is None else _finite(lp) for _, lp, _ in entries],
                "top_logprobs": [None if top is None else self._top_dict(t, lp, top) for t, lp, top in entries],
                "text_offset": offsets}

    def _top_dict(self, token: int, lp: float, top: list) -> dict:
        shown: dict = {}
        for t, v in [*top, (token, lp)]:  # best first: tokens of one text keep the best one's logprob
            shown.setdefault(self._name(t), _finite(v))
        return shown

    def _chat_entry(self, token: int, lp: float, top: list) -> dict:
        def one(t, v):
            return {"token": self._name(t), "logprob": _finite(v), "bytes": list(self.token_text(t).encode("utf-8"))}

        return {**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
