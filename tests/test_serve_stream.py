"""The completion service's answers, driven directly with stand-in engine streams (no ranks, no HTTP): usage in
every chunk (continuous_usage_stats), no task left pending when the client leaves, and big answers shaped off
the event loop within a size bound."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from test_serve_hostile import _FakeClient, _never, _state  # noqa: E402
from torchtsp.serve.protocol import CompletionRequest, parse  # noqa: E402
from torchtsp.serve.service import CompletionService  # noqa: E402


class _Tokens:
    """An engine stream answering ``text``'s bytes one token at a time, then ``finished`` (or never ending)."""

    def __init__(self, text: str, finish: str | None = "length"):
        self.events = [("token", b) for b in text.encode()] + ([("finished", finish)] if finish else [])

    async def next(self):
        if not self.events:
            await asyncio.Event().wait()  # a request still running when the client leaves
        return self.events.pop(0)


class _Client(_FakeClient):
    def __init__(self, texts: list[str], finish: str | None = "length"):
        super().__init__()
        self.texts, self.finish, self.cancelled = list(texts), finish, []

    def submit(self, prompt, max_tokens, sampling, stop_token_ids, ignore_eos=False, **options):
        return _Tokens(self.texts.pop(0), self.finish)

    def cancel(self, stream):
        self.cancelled.append(stream)


def _chunks(raw: dict, texts: list[str]) -> list[dict]:
    """The parsed data events of a streamed completion (the byte tokenizer: one token per character)."""
    service = CompletionService(_state(_Client(texts)))

    async def run():
        body = parse(CompletionRequest, json.dumps(raw).encode())
        choices = await service.completion_choices(body)
        return [c async for c in service.stream(choices, service.submit(choices), False, body.include_usage, _never,
                                                continuous_usage=body.continuous_usage)]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk():
    raw = {"prompt": "hey", "max_tokens": 5, "n": 2, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(raw, ["abc", "wxyz"])
    *choice_chunks, last = chunks
    texts = ["", ""]
    for chunk in choice_chunks:
        (c,) = chunk["choices"]
        texts[c["index"]] += c["text"]
        # what this choice has streamed so far, counted independently: one byte token per character
        want = len(texts[c["index"]])
        assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": want, "total_tokens": 3 + want,
                                  "prompt_tokens_details": {"cached_tokens": 0}}, chunk
    assert texts == ["abc", "wxyz"]
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                                                       "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("options,shown", [({"include_usage": True}, "null"),
                                           ({"continuous_usage_stats": True}, "absent"), (None, "absent")])
def test_without_both_options_choice_chunks_carry_no_usage(options, shown):
    """As vLLM: continuous_usage_stats takes include_usage too; include_usage alone gives null, then the total."""
    raw = {"prompt": "hey", "max_tokens": 5, "stream": True, **({"stream_options": options} if options else {})}
    chunks = _chunks(raw, ["abc"])
    for chunk in chunks:
        if chunk["choices"]:
            assert ("usage" in chunk and chunk["usage"] is None) if shown == "null" else "usage" not in chunk
    assert ("usage" in chunks[-1] and not chunks[-1]["choices"]) == (shown == "null")


# ---------------------------------------------------------------- a client that leaves


@pytest.mark.parametrize("how", ["cancelled", "closed", "disconnected"])
def test_a_client_that_leaves_leaves_no_task_pending(how):
    """The consumer of ``events`` goes away while every choice still runs (starlette cancels a stream's task when
    its client disconnects; a generator can be closed; the poll can see the disconnect): no task of the request
    may stay pending (asyncio logs "Task was destroyed but it is pending!" when one is collected), and every
    engine request is cancelled."""
    client = _Client(["ab", "cd"], finish=None)  # tokens, then nothing: the requests never end by themselves
    service = CompletionService(_state(client))

    async def left():
        return how == "disconnected"

    async def run():
        body = parse(CompletionRequest, json.dumps({"prompt": "hi", "max_tokens": 5, "n": 2}).encode())
        choices = await service.completion_choices(body)
        events = service.events(choices, service.submit(choices), left)

        async def consume():
            async for _ in events:
                pass

        if how == "closed":  # the consumer stops after one event: the generator is closed at its yield
            await events.__anext__()
            await events.aclose()
        else:
            consumer = asyncio.ensure_future(consume())
            await asyncio.sleep(0.05)  # every token delivered; events() waits on its queue
            if how == "cancelled":
                consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        for _ in range(5):  # cancelled tasks finish within a few turns of the loop
            await asyncio.sleep(0)
        return [repr(t) for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

    pending = asyncio.run(run())
    assert pending == [], pending
    assert len(client.cancelled) == 2


# ---------------------------------------------------------------- big answers: bounded, shaped and encoded off the loop


class _LogprobClient(_FakeClient):
    """Each request answers ``max_tokens`` tokens "a".."z" with logprobs (the prompt's too, when asked): the events
    a rank sends, with full-precision floats (the longest JSON numbers)."""

    def submit(self, prompt, max_tokens, sampling, stop_token_ids, ignore_eos=False, **options):
        def entry(t, k):
            return (-1.2345678901234567 - t / 7, [((t + j) % 256, -0.1234567890123456 - j / 3) for j in range(k)])

        def events():  # made as they are read (a rank's come one step at a time), not all at submit
            if options.get("prompt_logprobs") is not None:
                yield "prompt_logprobs", [None, *(entry(t, options["prompt_logprobs"]) for t in prompt[1:])]
            for i in range(max_tokens):
                yield "token", 97 + i % 26, entry(97 + i % 26, options["logprobs"] or 0)
            yield "finished", "length"

        return _Lazy(events())


class _Lazy:
    """Events made on a worker thread, as the engine client's reader thread receives them: the event loop only
    hands them on (making 30k logprob tuples on the loop would stall it in the test's engine, not the server)."""

    def __init__(self, events):
        self.events = events

    async def next(self):
        return await asyncio.to_thread(next, self.events)


def _big_state(client, **changes):
    state = _state(client)
    state.max_model_len, state.max_queue = 8192, 512
    for k, v in changes.items():
        setattr(state, k, v)
    return state


async def _choices_and_answer(service, raw: dict, chat: bool = False) -> tuple[list, dict]:
    from torchtsp.serve.protocol import ChatCompletionRequest

    body = parse(ChatCompletionRequest if chat else CompletionRequest, json.dumps(raw).encode())
    choices = await (service.chat_choices(body) if chat else service.completion_choices(body))
    return choices, await service.complete(choices, service.submit(choices), chat, _never)


@pytest.mark.parametrize("chat", [False, True])
def test_the_answer_encoded_in_pieces_is_what_jsonresponse_sends(chat):
    from starlette.responses import JSONResponse

    from torchtsp.serve.formats import JSON_ROWS, json_bytes
    from torchtsp.serve.template import ChatTemplate

    state = _big_state(_LogprobClient(), template=ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"))
    service = CompletionService(state)
    tokens = 2 * JSON_ROWS + 3  # per-token lists cut into three pieces, the last short
    raw = {"max_tokens": tokens, "n": 2, "logprobs": True, "top_logprobs": 3} if chat else \
        {"max_tokens": tokens, "n": 2, "logprobs": 3, "echo": True}
    content = {"messages": [{"role": "user", "content": "é ✓ \"quoted\""}]} if chat else {"prompt": "é ✓ \"q\""}
    _, answer = asyncio.run(_choices_and_answer(service, {**raw, **content}, chat))
    assert json_bytes(answer) == JSONResponse(answer).body


@pytest.mark.parametrize("extra,limit,param,chat", [
    # 256 choices x 4000 tokens x 21 entries: ~700 MB estimated, the text alone 16 MB (fits the 64 MiB default)
    ({"prompt": ["a", "b"], "n": 128, "max_tokens": 4000, "logprobs": 20}, None, "logprobs", False),
    ({"prompt": ["a", "b"], "n": 128, "max_tokens": 4000}, 1 << 20, "n", False),  # 16 MB of text; 1 choice: 64 KB
    ({"prompt": "a", "max_tokens": 8000}, 64 << 10, "max_tokens", False),  # 128 KB of text, one choice
    ({"messages": [{"role": "user", "content": "a"}], "n": 128, "max_tokens": 4000, "logprobs": True,
      "top_logprobs": 20}, None, "top_logprobs", True),
])
def test_an_answer_that_could_be_too_big_is_400_naming_what_to_lower(extra, limit, param, chat):
    from torchtsp.serve.protocol import APIError, ChatCompletionRequest
    from torchtsp.serve.template import ChatTemplate

    small = {} if limit is None else {"max_answer_bytes": limit}
    state = _big_state(_LogprobClient(), template=ChatTemplate("{{ messages[0].content }}"), **small)
    service = CompletionService(state)
    model = ChatCompletionRequest if chat else CompletionRequest

    async def choices(raw):
        body = parse(model, json.dumps(raw).encode())
        return await (service.chat_choices(body) if chat else service.completion_choices(body))

    with pytest.raises(APIError) as e:
        asyncio.run(choices(extra))
    assert e.value.status == 400 and e.value.param == param and f"lower {param}" in e.value.message, e.value.message
    assert "stream" in e.value.message and len(e.value.message) < 300
    assert asyncio.run(choices({**extra, "stream": True}))  # a stream is sent as it comes: not bounded


def test_the_size_estimate_bounds_a_real_answer():
    """The estimate (``check_answer_size``) against the bytes actually sent, for one-character tokens with
    full-precision logprobs: never under, and not so far over that it refuses what would fit (within 3x)."""
    from torchtsp.serve.formats import json_bytes
    from torchtsp.serve.template import ChatTemplate

    for chat in (False, True):
        service = CompletionService(_big_state(_LogprobClient(), template=ChatTemplate("{{ messages[0].content }}")))
        if chat:
            raw = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 300, "n": 3, "logprobs": True,
                   "top_logprobs": 20}
        else:
            raw = {"prompt": "abcdefgh" * 20, "max_tokens": 300, "n": 3, "logprobs": 20, "echo": True}
        choices, answer = asyncio.run(_choices_and_answer(service, raw, chat))
        sent, estimate = len(json_bytes(answer)), _estimate(choices, chat)
        assert sent <= estimate <= 3 * sent, (chat, sent, estimate)


def _estimate(choices, chat) -> int:
    from torchtsp.serve.choices import LOGPROB_ENTRY_BYTES, TEXT_BYTES_PER_TOKEN, _logprob_entries, _shown_tokens

    return sum(_shown_tokens(c) * TEXT_BYTES_PER_TOKEN + _logprob_entries(c) * LOGPROB_ENTRY_BYTES[chat]
               for c in choices)


def test_a_big_answer_does_not_stall_the_event_loop():
    """A request whose answer is tens of MB (echo of a long prompt, n choices, 20 logprobs) through the app, while
    a trivial coroutine ticks every 5 ms beside it: the longest gap between ticks stays a small part of the
    request's time (shaping the logprobs and encoding the JSON ran on the event loop: one gap as long as both)."""
    httpx = pytest.importorskip("httpx")
    import gc
    import time

    from torchtsp.serve.app import create_app

    app = create_app(_big_state(_LogprobClient()))
    raw = {"prompt": [97 + i % 26 for i in range(1500)], "n": 48, "max_tokens": 2, "logprobs": 20, "echo": True}

    async def run():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        start = time.perf_counter()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            response = await http.post("/v1/completions", json=raw, timeout=120)
        elapsed = time.perf_counter() - start
        done.set()
        await ticker
        return response, elapsed, max(gaps)

    # The collector is off while it runs: a full collection walks every object the process holds (after a thousand
    # tests, millions) holding the GIL, a pause of up to a second whichever thread allocates. That is the runtime's
    # stall, not the server's; what this test measures is where the server's own work runs.
    gc.collect()
    gc.disable()
    try:
        response, elapsed, gap = asyncio.run(run())
    finally:
        gc.enable()
    assert response.status_code == 200, response.text[:300]
    assert len(response.content) > 20 << 20  # a big answer: ...
    assert elapsed > 0.5  # ... that takes long enough for a stall to show
    assert gap < elapsed / 4, (gap, elapsed)
