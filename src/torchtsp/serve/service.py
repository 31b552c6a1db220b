"""The completion service: everything the endpoints do, without HTTP.

``CompletionService`` takes a request's choices (``choices.ChoiceMaker``: the checks against the model and the
grammar, the request turned into engine requests), admits them to the engine and runs them: each choice's events
as its tokens come, gathered into a whole answer or streamed (the shapes are ``formats``'). The routes in app.py
only parse the body and send the answer; tests drive the service directly with a stand-in engine client.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .choices import Choice, ChoiceMaker, ServerState, _ids_text
from .formats import LogprobFormat, _Chunks, _leading_echo, _message, _prompt_tokens, _request_id, _sse, _usage
from .protocol import APIError, ChatCompletionRequest
from .text import TextStream
from .tools import ToolOutput

DISCONNECT_POLL_S = 0.25


@dataclass
class Event:
    """A choice's progress: a text delta, and its finish reason on the last one."""

    index: int
    delta: str
    finish: str | None
    tokens: int  # completion tokens so far
    logprobs: list = field(default_factory=list)  # (id, logprob or None, top or None) of the tokens it covers
    cached_tokens: int | None = None  # the prompt's tokens the prefix cache held (on the event that says so)


# Engine outcomes that fail the request rather than end it.
_FAILED = {
    "cancelled": (503, "the request was stopped: the server is shutting down", None, "server_shutdown"),
    "too_long": (400, "the prompt and max_tokens do not fit the KV cache; lower max_tokens, or restart the server "
                      "with a larger --kv-cache-mb", "max_tokens", "context_length_exceeded"),
    "rejected": (500, "the engine refused this request's values (a check of the HTTP side let them pass); the "
                      "server is still up", None, "engine_rejected"),
    "bad_grammar": (400, "the engine could not compile this request's grammar for the model's tokenizer", None,
                    "bad_grammar"),
    "grammar_timeout": (400, "the grammar did not compile on the engine in time; simplify it", None, "bad_grammar"),
}


class CompletionService(ChoiceMaker):
    draining = False  # shutting down (drain): nothing new is admitted

    def __init__(self, state: ServerState):
        super().__init__(state)
        self.metrics = state.metrics
        self._token_texts: dict[int, str] = {}

    # -- checks ------------------------------------------------------------------------

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
        decode = tokenizer.decode if tokenizer is not None else _ids_text
        if c.reasoning is not None:  # the markers its parser reads stay in the text, also those that end it
            decode, skip = c.reasoning.parser.decode, skip - c.reasoning.parser.kept_ids
        text = TextStream(decode, c.stop_strings, skip)
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
                elif kind == "cached":
                    await out.put(Event(index, "", None, tokens, cached_tokens=value[0]))
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
        cached = [0] * len(choices)
        async for e in self.events(choices, streams, disconnected):
            texts[e.index] += e.delta
            counts[e.index] = e.tokens
            if e.cached_tokens is not None:
                cached[e.index] = e.cached_tokens
            finish[e.index] = e.finish or finish[e.index]
            entries[e.index] += e.logprobs
        if any(f is None for f in finish):
            return None

        tokens, hits = _prompt_tokens(choices, cached)

        def shape() -> dict:  # on a worker thread: 2 prompts x n 128 x logprobs 20 took seconds on the event loop
            shown = [LogprobFormat(self.token_text, chat, c.tokens_as_ids).shape(es) if c.logprobs is not None
                     else None for c, es in zip(choices, entries)]
            made = [{"index": i, **_message(c, t, f), "logprobs": lp} if chat
                    else {"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                    for i, (c, t, f, lp) in enumerate(zip(choices, texts, finish, shown))]
            return {"id": _request_id(chat), "object": kind, "created": created, "model": self.state.model_name,
                    "choices": made, "usage": _usage(tokens, sum(counts), hits)}

        return await asyncio.to_thread(shape) if any(c.logprobs is not None for c in choices) else shape()

    async def stream(self, choices: list[Choice], streams: list, chat: bool, include_usage: bool, disconnected,
                     continuous_usage: bool = False):
        """Server-sent events: the chunks, an error event if the request fails midway, then [DONE].
        ``continuous_usage``: every choice chunk carries its choice's usage so far (its prompt's tokens and the
        tokens it has generated, as vLLM's continuous_usage_stats); otherwise ``usage`` is null until the last
        chunk (include_usage)."""
        chunks = _Chunks(_request_id(chat), self.state.model_name, chat, include_usage)
        counts, cached = [0] * len(choices), [0] * len(choices)
        formats = [LogprobFormat(self.token_text, chat, c.tokens_as_ids) if c.logprobs is not None else None
                   for c in choices]

        def usage(i: int) -> dict | None:
            return _usage(len(choices[i].prompt), counts[i], cached[i]) if continuous_usage else None

        try:
            for i, c in enumerate(choices):
                if chat:
                    yield chunks.choice(i, "", None, role=True, usage=usage(i))
                elif _leading_echo(c):
                    yield chunks.choice(i, c.echo_text, None, usage=usage(i))
            tools = [ToolOutput(c.tools) if chat and c.tools is not None else None for c in choices]
            splits = [c.reasoning.output() if chat and c.reasoning is not None else None for c in choices]
            async for e in self.events(choices, streams, disconnected):
                counts[e.index] = e.tokens
                if e.cached_tokens is not None:
                    cached[e.index] = e.cached_tokens
                shown = formats[e.index].shape(e.logprobs) if formats[e.index] is not None else None
                reasoning, delta = "", e.delta
                if splits[e.index] is not None:  # the reasoning apart; what may be a marker waits for the next delta
                    reasoning, delta = splits[e.index].add(e.delta, done=e.finish is not None)
                if tools[e.index] is not None:  # content until a call may begin; the calls when the output ends
                    for chunk in chunks.tool_choice(e.index, tools[e.index], delta, e.finish, shown,
                                                    usage(e.index), reasoning):
                        yield chunk
                elif delta or reasoning or e.finish or e.logprobs:
                    yield chunks.choice(e.index, delta, e.finish, logprobs=shown, usage=usage(e.index),
                                        reasoning=reasoning)
            if include_usage:
                tokens, hits = _prompt_tokens(choices, cached)
                yield chunks.usage(_usage(tokens, sum(counts), hits))
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
            ids = await self.render_chat(messages, body.add_generation_prompt, body.tools, body.template_kwargs())
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


