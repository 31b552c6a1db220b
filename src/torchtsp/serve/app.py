"""The FastAPI application: OpenAI's completions, chat completions and models endpoints, plus health,
metrics, tokenize and detokenize (the vLLM server's conventions for the last two).

The HTTP process owns the tokenizer, the chat template, validation and streaming; the engine only ever
sees checked token ids (client.py). Every error is OpenAI's error body with the HTTP status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .client import EngineClient
from .metrics import Metrics
from .plan import Sampling
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from .text import ChatTemplate, TextStream

PUBLIC = ("/health", "/metrics")  # answered without the API key (no request data in either)
DISCONNECT_POLL_S = 0.25


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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="torchtsp", docs_url=None, redoc_url=None, openapi_url=None)
    client, metrics = state.client, state.metrics
    routes: set[str] = set()  # the app's paths (metrics label unknown paths "other")

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # a bug: still OpenAI's shape, with what happened
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}"[:500]).body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.middleware("http")
    async def count_and_authorize(request: Request, call_next):
        path = request.url.path
        if not routes:
            routes.update(r.path for r in app.routes)
        label = path if path in routes else "other"
        if state.api_key is not None and path not in PUBLIC:
            given = request.headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                metrics.requests.labels(endpoint=label, status="401").inc()
                return JSONResponse(APIError(401, "missing or wrong API key: send the header 'Authorization: "
                                                  "Bearer KEY'", None, "invalid_api_key").body(), status_code=401)
        response = await call_next(request)
        metrics.requests.labels(endpoint=label, status=str(response.status_code)).inc()
        return response

    # -- checks shared by the endpoints ------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")

    def check_engine() -> None:
        if client.state == "loading":
            raise APIError(503, "the model is still loading; retry in a moment", None, "engine_loading")
        if client.state != "ready":
            raise APIError(503, f"the engine is not available: {client.error or client.state}", None,
                           "engine_unavailable")

    def encode(text: str) -> list[int]:
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", "prompt")
        return state.tokenizer.encode(text)

    def check_ids(ids: list[int], param: str) -> None:
        outside = [t for t in ids if not 0 <= t < state.vocab_size]
        if outside:
            raise APIError(400, f"{param}: token id {outside[0]} is outside the vocabulary [0, {state.vocab_size})",
                           param)

    def choice(body, prompt: list[int], max_tokens: int | None, param: str = "prompt") -> Choice:
        if not prompt:
            raise APIError(400, f"{param} is empty; give at least one token", param)
        check_ids(prompt, param)
        limit, n = state.max_model_len, len(prompt)
        if n >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                f"tokens, which leaves no room for a new one", param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - n
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if n + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                f"tokens and max_tokens asks for {max_tokens} ({n + max_tokens} in all)",
                           "max_tokens", "context_length_exceeded")
        temperature, top_k, top_p, seed = body.sampling_values()
        stop_ids = list(body.stop_token_ids or [])
        check_ids(stop_ids, "stop_token_ids")
        seed = secrets.randbelow(2**63) if seed is None else seed
        return Choice(prompt, max_tokens, Sampling(temperature, top_k, top_p, seed), body.stop_strings(), stop_ids,
                      body.ignore_eos)

    def admit(choices: list[Choice]) -> None:
        check_engine()
        if client.waiting + len(choices) > state.max_queue:
            raise APIError(429, f"the server's queue is full ({client.waiting} requests waiting, at most "
                                f"{state.max_queue}); retry later", None, "queue_full")

    # -- running one choice ------------------------------------------------------------

    async def run_choice(c: Choice, stream, out: asyncio.Queue, index: int, arrival: float) -> None:
        """Push (index, text delta, finish reason or None, completion tokens) until the choice ends."""
        skip = set(c.stop_token_ids) | ({state.eos_token_id} if state.eos_token_id is not None and not c.ignore_eos
                                        else set())
        text = TextStream(state.tokenizer.decode if state.tokenizer is not None else _ids_text, c.stop_strings,
                          skip)
        tokens, first_at, ended = 0, None, False
        try:
            while True:
                kind, *value = await stream.next()
                if kind == "token":
                    tokens += 1
                    first_at = first_at or time.monotonic()
                    delta = text.add(value[0])
                    if text.stopped:
                        ended = True
                        client.cancel(stream)
                        await out.put((index, delta, "stop", tokens))
                        return
                    if delta:
                        await out.put((index, delta, None, tokens))
                elif kind == "finished":
                    ended = True
                    if value[0] == "cancelled":
                        raise APIError(503, "the request was stopped: the server is shutting down", None,
                                       "server_shutdown")
                    if value[0] == "too_long":
                        raise APIError(400, "the prompt and max_tokens do not fit a KV cache row; lower "
                                            "max_tokens", "max_tokens", "context_length_exceeded")
                    await out.put((index, text.finish(), value[0], tokens))
                    return
                elif kind == "error":
                    ended = True
                    raise APIError(500, f"the engine failed while running this request: {value[0]}", None,
                                   "engine_failed")
        finally:
            if not ended:
                client.cancel(stream)  # the client went away: free its row and slots at the next step
            now = time.monotonic()
            if first_at is not None:
                metrics.ttft.observe(first_at - arrival)
                if tokens > 1:
                    metrics.tpot.observe((now - first_at) / (tokens - 1))
            metrics.generation_tokens.inc(tokens)
            metrics.prompt_tokens.inc(len(c.prompt))

    async def events(choices: list[Choice], streams: list, request: Request):
        """(index, delta, finish, tokens) of every choice as they come; the choices run concurrently."""
        out: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic()
        tasks = [asyncio.ensure_future(run_choice(c, s, out, i, arrival))
                 for i, (c, s) in enumerate(zip(choices, streams))]
        open_, checked = len(choices), time.monotonic()
        try:
            while open_:
                get = asyncio.ensure_future(out.get())
                done, _ = await asyncio.wait({get, *[t for t in tasks if not t.done()]},
                                             timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    item = get.result()
                    open_ -= item[2] is not None
                    yield item
                else:
                    get.cancel()
                    for t in tasks:
                        if t.done() and t.exception() is not None:
                            raise t.exception()
                if time.monotonic() - checked > DISCONNECT_POLL_S:  # a client that left frees its rows
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
        finally:
            for t in tasks:
                t.cancel()

    async def respond(choices: list[Choice], body, request: Request, chat: bool):
        # Submitted before the first await, in the same turn of the event loop as admit()'s queue check: a
        # burst of requests cannot all pass the check before any of them counts as waiting.
        streams = [client.submit(c.prompt, c.max_tokens, c.sampling, c.stop_token_ids, c.ignore_eos)
                   for c in choices]
        created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        prompt_tokens = sum(len(c.prompt) for c in choices)
        if not body.stream:
            texts = [c.echo_text for c in choices]
            finish, counts = [None] * len(choices), [0] * len(choices)
            async for i, delta, reason, tokens in events(choices, streams, request):
                texts[i] += delta
                counts[i] = tokens
                finish[i] = reason or finish[i]
            if any(f is None for f in finish):  # the client disconnected: nobody reads this
                return Response(status_code=499)
            made = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                     "finish_reason": f} if chat else
                    {"index": i, "text": t, "logprobs": None, "finish_reason": f}
                    for i, (t, f) in enumerate(zip(texts, finish))]
            return {"id": rid, "object": kind, "created": created, "model": state.model_name, "choices": made,
                    "usage": _usage(prompt_tokens, sum(counts))}
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        usage_field = {"usage": None} if body.include_usage else {}

        def chunk(i, delta, reason, role=False):
            if chat:
                part = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                c = {"index": i, "delta": part, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
            return "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created,
                                          "model": state.model_name, "choices": [c], **usage_field}) + "\n\n"

        async def sse():
            counts = [0] * len(choices)
            try:
                for i, c in enumerate(choices):
                    if chat:
                        yield chunk(i, "", None, role=True)
                    elif c.echo_text:
                        yield chunk(i, c.echo_text, None)
                async for i, delta, reason, tokens in events(choices, streams, request):
                    counts[i] = tokens
                    if delta or reason:
                        yield chunk(i, delta, reason)
                if body.include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created,
                                                 "model": state.model_name, "choices": [],
                                                 "usage": _usage(prompt_tokens, sum(counts))}) + "\n\n"
            except APIError as e:  # mid-stream: an error event, then the end of the stream
                yield "data: " + json.dumps(e.body()) + "\n\n"
            except Exception as e:  # noqa: BLE001 - a bug mid-stream: an error event all the same
                yield "data: " + json.dumps(APIError(500, f"internal error: {type(e).__name__}: {e}"[:500]).body()) \
                    + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- endpoints -----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await request.body())
        body.refuse_unsupported()
        check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            prompts = [encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = list(p)
        else:
            prompts = [list(p)]
        choices = [choice(body, ids, body.max_tokens, "prompt") for ids in prompts]
        if body.echo:
            for c in choices:
                c.echo_text = state.tokenizer.decode(c.prompt) if state.tokenizer is not None else _ids_text(c.prompt)
        admit(choices)
        return await respond(choices, body, request, chat=False)

    def render_chat(messages: list[dict], add_generation_prompt: bool) -> list[int]:
        if state.template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions, or start the server with "
                                "--chat-template FILE", "messages", "no_chat_template")
        return encode(state.template.render(messages, add_generation_prompt))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatCompletionRequest, await request.body())
        body.refuse_unsupported()
        check_model(body.model)
        ids = render_chat(body.message_dicts(), body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        choices = [choice(body, ids, max_tokens, "messages")]
        admit(choices)
        return await respond(choices, body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "torchtsp", "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health():
        if client.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": client.state, "error": client.error}, status_code=503)

    @app.get("/metrics")
    async def metrics_text():
        metrics.healthy.set(int(client.healthy))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = parse(TokenizeRequest, await request.body())
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            ids = encode(body.prompt)
        else:
            ids = render_chat([ChatCompletionRequest(messages=body.messages).message_dicts()][0],
                              body.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = parse(DetokenizeRequest, await request.body())
        check_model(body.model)
        check_ids(body.tokens, "tokens")
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return app


def _ids_text(ids) -> str:
    return " ".join(map(str, ids))
