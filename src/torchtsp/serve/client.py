"""The HTTP process's end of the channel to rank 0: requests in, tokens and engine figures out.

One authenticated local connection (``multiprocessing.connection``, a random key per server): the HTTP
event loop sends requests and cancellations, a reader thread receives every step's tokens and hands them
to the waiting request's asyncio queue. The engine is "loading" until rank 0 reports ready, "ready" while
it steps, and "failed" (for good) when a rank dies, hangs past the collective timeout, or raises: every
request still in flight then gets an error at once.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from multiprocessing.connection import Listener

FAILURE_REPORT_S = 3.0  # how long a lost connection to rank 0 waits for the pool's account of the failure


class RequestStream:
    """Events of one engine request: ("cached", tokens) (its prompt's tokens the prefix cache held, when it is first
    scheduled), ("admitted",), ("prompt_logprobs", entries) (echo), ("token", id, logprobs)
    (logprobs: None or (logprob, [(id, logprob)] top first)), ("finished", reason), ("error", message)."""

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop):
        self.request_id, self.loop = request_id, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the HTTP server's loop is closed: nobody is left to read this request
            pass

    async def next(self) -> tuple:
        return await self.queue.get()


class EngineClient:
    def __init__(self, heartbeat_timeout_s: float):
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.address = self._listener.address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state, self.error = "loading", None
        self.info: dict = {}
        self.figures = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.last_step_at = 0.0
        self._streams: dict[int, RequestStream] = {}
        self._waiting: set[int] = set()  # submitted, not yet in the running batch
        self._ids = itertools.count(1)
        self._conn = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self.on_step = None  # called with each step's message (metrics)
        self.on_ready = None  # called once with the ready message (the cache's capacity: metrics, the start-up line)
        self._reader = threading.Thread(target=self._read, name="torchtsp-serve-engine", daemon=True)
        self._reader.start()

    # -- state --------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.state == "ready" and time.monotonic() - self.last_step_at < self.heartbeat_timeout_s

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def fail(self, message: str) -> None:
        """The engine is gone: every request in flight fails now, and so will every later one."""
        with self._lock:
            if self.state == "failed":
                return
            self.state, self.error = "failed", message
            streams, self._streams = list(self._streams.values()), {}
            self._waiting.clear()
        for s in streams:
            s.push(("error", message))
        try:
            self._listener.close()  # unblocks accept() when rank 0 never connected
        except OSError:
            pass

    # -- the reader thread -----------------------------------------------------------

    def _read(self) -> None:
        try:
            self._conn = self._listener.accept()
            while True:
                kind, body = self._conn.recv()
                if kind == "ready":
                    self.info, self.state, self.last_step_at = body, "ready", time.monotonic()
                    if self.on_ready is not None:
                        self.on_ready(body)
                elif kind == "step":
                    self._dispatch(body)
        except (EOFError, OSError) as e:
            # Rank 0 went away: the launcher's pool names which rank failed and why, a moment later.
            deadline = time.monotonic() + FAILURE_REPORT_S
            while self.state == "ready" and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.state != "stopped":
                self.fail(self.error or f"the engine's connection closed ({type(e).__name__})")
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            # Stopped on purpose (SIGTERM): the requests left end as the shutdown's, not as an engine failure.
            end = ("finished", "cancelled") if self.state == "stopped" else ("error", "the server is shutting down")
            for s in streams:
                s.push(end)

    def _dispatch(self, body: dict) -> None:
        self.last_step_at = time.monotonic()
        self.figures = {k: body[k] for k in ("running", "waiting", "kv_usage")}
        with self._lock:
            for rid, tokens in body.get("cached_tokens", ()):
                if (s := self._streams.get(rid)) is not None:
                    s.push(("cached", tokens))
            for rid in body["admitted"]:
                self._waiting.discard(rid)
                if (s := self._streams.get(rid)) is not None:
                    s.push(("admitted",))
            for rid, entries in body.get("prompt_logprobs", ()):
                if (s := self._streams.get(rid)) is not None:
                    s.push(("prompt_logprobs", entries))
            logprobs: dict[int, list] = {}  # a step can choose two tokens of a request: its prefill's, a decode's
            for rid, lp, top in body.get("logprobs", ()):
                logprobs.setdefault(rid, []).append((lp, top))
            for rid, token in body["tokens"]:
                if (s := self._streams.get(rid)) is not None:
                    s.push(("token", token, logprobs[rid].pop(0) if logprobs.get(rid) else None))
            for rid, reason in body["finished"]:
                self._waiting.discard(rid)
                if (s := self._streams.pop(rid, None)) is not None:
                    s.push(("finished", reason))
        if self.on_step is not None:
            self.on_step(body)

    # -- requests ----------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def submit(self, prompt: list[int], max_tokens: int, sampling, stop_token_ids: list[int],
               ignore_eos: bool = False, min_tokens: int = 0, grammar: tuple[str, str] | None = None,
               logprobs: int | None = None, prompt_logprobs: int | None = None) -> RequestStream:
        from .plan import Admission

        stream = RequestStream(next(self._ids), asyncio.get_running_loop())
        with self._lock:
            if self.state != "ready":
                stream.push(("error", self.error or "the engine is not ready"))
                return stream
            self._streams[stream.request_id] = stream
            self._waiting.add(stream.request_id)
        try:
            self._send(("submit", Admission(stream.request_id, prompt, max_tokens, sampling, stop_token_ids,
                                           ignore_eos, min_tokens, grammar, logprobs=logprobs,
                                           prompt_logprobs=prompt_logprobs)))
        except OSError as e:
            self.fail(f"the engine's connection failed ({e})")
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """The request leaves at the next step boundary (its slots are freed on every rank)."""
        with self._lock:
            live = self._streams.get(stream.request_id) is stream
        if live and self.state == "ready":
            try:
                self._send(("cancel", stream.request_id))
            except OSError:
                pass

    def drain(self) -> None:
        """Rank 0 admits nothing more: the requests waiting end now, as "cancelled" (the shutdown's 503)."""
        if self.state == "ready":
            try:
                self._send(("drain",))
            except OSError:
                pass

    def stop(self) -> None:
        """Ask the ranks to stop after their current step."""
        if self.state == "ready":
            self.state = "stopped"
            try:
                self._send(("stop",))
            except OSError:
                pass
