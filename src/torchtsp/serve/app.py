"""The FastAPI application: OpenAI's completions, chat completions and models endpoints, plus health,
metrics, tokenize and detokenize (the vLLM server's conventions for the last two).

The routes live here at module level and reach the server's ``CompletionService`` (service.py) through a
dependency on ``app.state``; they only read the body and shape the answer. The HTTP process owns the
tokenizer, the chat template, validation and streaming; the engine only ever sees checked token ids
(client.py). Every error is OpenAI's error body with the HTTP status, and one line in the server's log at
most: a request can fail only itself.
"""

from __future__ import annotations

import asyncio
import hmac
import sys
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .formats import json_bytes
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse
from .service import CompletionService, ServerState

PUBLIC = ("/health", "/metrics")  # answered without the API key (no request data in either)
MAX_BODY_BYTES = 32 << 20  # far more than any context's prompt; the body is held in memory whole

router = APIRouter()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="torchtsp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = CompletionService(state)
    app.include_router(router)
    app.state.paths = {r.path for r in router.routes}  # metrics label unknown paths "other"
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(_CountAndAuthorize)
    return app


def get_service(request: Request) -> CompletionService:
    return request.app.state.service


Service = Annotated[CompletionService, Depends(get_service)]


async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
    return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


def _internal_error(e: Exception) -> JSONResponse:
    """A bug: still OpenAI's shape, with what happened; one line in the log, not a traceback."""
    message = f"internal error: {type(e).__name__}: {e}"[:500]
    print(f"torchtsp: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return JSONResponse(APIError(500, message).body(), status_code=500)


async def _unexpected(request: Request, e: Exception):
    return _internal_error(e)


class _CountAndAuthorize:
    """The API key check and the request counter, as a plain ASGI middleware: starlette's BaseHTTPMiddleware
    hands the route a wrapped receive that never reports ``http.disconnect``, so a non-streaming request whose
    client left was generated to its end for nobody (``request.is_disconnected()`` stayed False)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        app, path = scope["app"], scope["path"]
        state = app.state.service.state
        count = state.metrics.http_request
        label = path if path in app.state.paths else "other"
        if state.api_key is not None and path not in PUBLIC and not _authorized(scope, state.api_key):
            count(label, 401)
            await JSONResponse(APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer "
                                             "KEY'", None, "invalid_api_key").body(), status_code=401)(
                scope, receive, send)
            return
        status: list[int] = []

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as e:  # noqa: BLE001 - caught here, starlette would log its traceback and re-raise it
            response = _internal_error(e)
            if not status:  # once the answer has started, the log line is all that is left to do
                status.append(response.status_code)
                await response(scope, receive, send)
        count(label, status[0] if status else 499)


def _authorized(scope, key: str) -> bool:
    given = Headers(scope=scope).get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    return hmac.compare_digest(token.encode(), key.encode())


async def _body(request: Request, model):
    """The body parsed as ``model``, read up to MAX_BODY_BYTES (a bigger one is refused as it arrives)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large(size)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left before sending its whole body: nobody reads the answer
        raise APIError(400, "the client disconnected before the end of the request body", None,
                       "client_disconnected") from None
    return parse(model, b"".join(chunks))


def _too_large(size: int) -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes (at least {size}), the most "
                         f"this server reads", None, "body_too_large")


async def _answer(svc: CompletionService, choices, body, request: Request, chat: bool):
    streams = svc.submit(choices)
    if body.stream:
        return StreamingResponse(svc.stream(choices, streams, chat, body.include_usage, request.is_disconnected,
                                            continuous_usage=body.continuous_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    answer = await svc.complete(choices, streams, chat, request.is_disconnected)
    if answer is None:
        return Response(status_code=499)
    # Encoded on a worker thread: tens of MB of logprobs take seconds, which would stall every other request.
    return Response(await asyncio.to_thread(json_bytes, answer), media_type="application/json")


@router.post("/v1/completions")
async def completions(request: Request, svc: Service):
    body = await _body(request, CompletionRequest)
    return await _answer(svc, await svc.completion_choices(body), body, request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, svc: Service):
    body = await _body(request, ChatCompletionRequest)
    return await _answer(svc, await svc.chat_choices(body), body, request, chat=True)


@router.get("/v1/models")
async def models(svc: Service):
    return {"object": "list", "data": [svc.model_card()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, svc: Service):
    return svc.model_card(model_id)


@router.get("/tokenizer_info")
async def tokenizer_info(svc: Service):
    return svc.tokenizer_info()


@router.get("/health")
async def health(svc: Service):
    if svc.client.healthy:
        return {"status": "ok"}
    return JSONResponse({"status": svc.client.state, "error": svc.client.error}, status_code=503)


@router.get("/metrics")
async def metrics_text(svc: Service):
    svc.metrics.healthy.set(int(svc.client.healthy))
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/tokenize")
async def tokenize(request: Request, svc: Service):
    return await svc.tokenize(await _body(request, TokenizeRequest))


@router.post("/detokenize")
async def detokenize(request: Request, svc: Service):
    return await svc.detokenize(await _body(request, DetokenizeRequest))
