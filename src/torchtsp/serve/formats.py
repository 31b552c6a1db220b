"""The answer shapes of the OpenAI API (vLLM keeps its formats in a module of their own too): whole answers and
streamed chunks of completions and chat, tool calls in a chat message, token logprobs in both APIs, usage, and the
JSON encoding of a large answer in pieces (so that encoding never holds the event loop for long). No engine, no
HTTP: shapes only (of ``choices.Choice``s)."""

from __future__ import annotations

import json
import secrets
import time

from .reasoning import split_reasoning
from .tools import ToolOutput


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


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; ``cached_tokens``: the prompt's tokens found in the prefix cache (not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _prompt_tokens(choices: list, cached: list[int]) -> tuple[int, int]:
    """The prompts' tokens and of them those the prefix cache held (``cached``: per choice), each prompt once
    however many choices it has (n): its first choice's."""
    firsts = [i for i, c in enumerate(choices) if c.sample == 0]
    return sum(len(choices[i].prompt) for i in firsts), sum(cached[i] for i in firsts)


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
               usage: dict | None = None, tool_calls: list | None = None, reasoning: str = "") -> str:
        if self.chat:
            part = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            if reasoning:  # vLLM's delta field for --reasoning-parser
                part["reasoning_content"] = reasoning
            if tool_calls:
                part["tool_calls"] = [call.to_dict(index=k) for k, call in enumerate(tool_calls)]
            c = {"index": i, "delta": part, "logprobs": logprobs, "finish_reason": reason}
        else:
            c = {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        return _sse({**self.head, "choices": [c], **({"usage": usage} if usage is not None else self.usage_field)})

    def usage(self, usage: dict) -> str:
        return _sse({**self.head, "choices": [], "usage": usage})

    def tool_choice(self, i: int, out: ToolOutput, delta: str, reason: str | None, logprobs: dict | None,
                    usage: dict | None, reasoning: str = "") -> list[str]:
        """The chunks of one event of a chat choice with tools (OpenAI's stream shapes): the content that can go
        out; at the end, what was held back, each call (id, type, name and its arguments whole) and the finish.
        ``reasoning``: the event's reasoning (never held: calls are read from the content only)."""
        content, calls = out.add(delta), []
        if reason is not None:
            rest, calls, reason = out.finish(reason)
            content += rest
        made = ([self.choice(i, content, None, logprobs=logprobs, usage=usage, reasoning=reasoning)]
                if content or logprobs or reasoning else [])
        if calls:
            made.append(self.choice(i, "", None, usage=usage, tool_calls=calls))
        if reason is not None:
            made.append(self.choice(i, "", reason, usage=usage))
        return made


def _message(c, text: str, finish: str) -> dict:
    """A chat choice's message and finish reason: under a reasoning parser, its reasoning apart (vLLM's
    ``reasoning_content``, null when there is none, and then a content that is empty is null too); with tools, the
    calls its content holds (finish "tool_calls")."""
    shown = {}
    if c.reasoning is not None:
        reasoning, text = split_reasoning(c.reasoning, text)
        shown = {"reasoning_content": reasoning}
    if c.tools is None:
        content = text if c.reasoning is None else text or None
        return {"message": {"role": "assistant", "content": content, **shown}, "finish_reason": finish}
    out = ToolOutput(c.tools)
    content = out.add(text)
    rest, calls, finish = out.finish(finish)
    message = {"role": "assistant", "content": (content + rest) or None, **shown}
    if calls:
        message["tool_calls"] = [call.to_dict() for call in calls]
    return {"message": message, "finish_reason": finish}


def _leading_echo(c) -> str:
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

