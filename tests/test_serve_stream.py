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
        assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": want, "total_tokens": 3 + want}, chunk
    assert texts == ["abc", "wxyz"]
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}


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
