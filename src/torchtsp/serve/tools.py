"""Tool calling on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice``, as vLLM serves them.

The chat template receives the tools (transformers' ``apply_chat_template`` convention), and assistant messages with
``tool_calls`` and ``role: "tool"`` messages render through it. What the model writes becomes tool calls by
``tool_choice``:

- ``none``: the text is the answer's content, never parsed.
- ``auto``: the text is parsed by the parser the server was started with (``--tool-call-parser``), named per model
  family: ``hermes`` (``<tool_call>{json}</tool_call>``: Qwen, Hermes), ``llama3_json`` (a JSON object
  ``{"name", "parameters"}``, after Llama 3.1's ``<|python_tag|>`` if present; several separated by ``;``),
  ``mistral`` (``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``), ``openai`` (GPT-OSS's harmony
  messages to ``functions.NAME``, which ``--reasoning-parser gpt_oss`` passes on in the content: reasoning.py).
  Text that looks like a call but does not parse stays content: a parser never invents a call.
- ``required`` or a named function: the output is constrained with xgrammar to a JSON object matching the tool's
  ``parameters`` schema (required: ``{"name": one of the tools, "arguments": its schema}``), so the call always
  parses.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from .protocol import APIError
from .reasoning import CALL as HARMONY_CALL
from .reasoning import HEADER_STARTS as HARMONY_HEADER_STARTS
from .reasoning import harmony_messages
from .text import marker_tail

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's function-name rule
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)

    def to_dict(self, index: int | None = None) -> dict:
        out = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from a parsed ``{"name": ..., "arguments"/"parameters": {...}}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str = "") -> list | None:
    """The JSON values ``text`` is made of, one after another (whitespace and ``separators`` between them); None
    when anything else is in it."""
    # Not strict: a raw control character in a string (JSON wants it escaped) is read as itself, and the call's
    # arguments are written back as valid JSON; a call that a grammar let through always parses.
    decoder, values, at = json.JSONDecoder(strict=False), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _all_calls(objects) -> list[ToolCall] | None:
    calls = [_call(o) for o in objects] if objects else None
    return calls if calls and all(calls) else None


HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _one_call(text: str) -> ToolCall | None:
    """The call ``text`` holds as its one JSON object, else None."""
    values = _json_values(text)
    return _call(values[0]) if values and len(values) == 1 else None


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after optional content;
    nothing but blocks after the first."""
    start = text.find("<tool_call>")
    tail = text[start:]
    if start < 0 or HERMES_BLOCK.sub("", tail).strip():
        return text, []
    calls = [_one_call(body) for body in HERMES_BLOCK.findall(tail)]
    return (text[:start].rstrip(), calls) if calls and all(calls) else (text, [])


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1's JSON calls: ``{"name": ..., "parameters": {...}}`` (``arguments`` too), optionally after
    ``<|python_tag|>``, several separated by ``;``. The whole output is the calls, or it is content."""
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return text, []
    calls = _all_calls(_json_values(body, separators=";"))
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional content (also the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` form, one per marker)."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    body = text[start + len("[TOOL_CALLS]"):].strip()
    if body.startswith("["):
        values = _json_values(body)
        calls = _all_calls(values[0]) if values and len(values) == 1 and isinstance(values[0], list) else None
    else:
        calls = []
        for part in body.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            values = _json_values(args) if sep else None
            call = _call({"name": name.strip(), "arguments": values[0]}) if values and len(values) == 1 else None
            if call is None:  # one that does not parse: the whole text is content
                calls = None
                break
            calls.append(call)
    return (text[:start].rstrip(), calls) if calls else (text, [])


def parse_openai(text: str) -> tuple[str, list[ToolCall]]:
    """Harmony's calls (GPT-OSS), as ``--reasoning-parser gpt_oss`` passes them on in the content: messages
    ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` after
    optional content; nothing but such messages after the first, each a JSON object to a function, ended by
    ``<|call|>``."""
    starts = [at for at in (text.find(m) for m in HARMONY_HEADER_STARTS) if at >= 0]
    messages = harmony_messages(text[min(starts):]) if starts else None
    if not messages:
        return text, []
    calls = []
    for header, body, terminator in messages:
        recipient, values, call = header.recipient or "", _json_values(body), None
        if terminator == HARMONY_CALL and recipient.startswith("functions.") and values and len(values) == 1 \
                and (header.content_type is None or "json" in header.content_type):
            call = _call({"name": recipient.removeprefix("functions."), "arguments": values[0]})
        if call is None:  # one that is no function call: the whole text is content
            return text, []
        calls.append(call)
    return text[:min(starts)], calls


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral, "openai": parse_openai}
# Where a parser's calls may begin: text from the first of these on is held back from a stream until the output
# ends and is parsed (llama3_json: an output that begins with a JSON object or the python tag).
MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",),
           "openai": HARMONY_HEADER_STARTS}
# A parser that reads what a reasoning parser passes on (the calls in the model's own channels), not raw text.
NEEDS_REASONING_PARSER = {"openai": "gpt_oss"}


def check_parser(name: str | None, reasoning_parser: str | None = None) -> None:
    """A startup error for an unknown ``--tool-call-parser``, or one without the reasoning parser it reads after."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; choose one of: {', '.join(PARSERS)}")
    needed = NEEDS_REASONING_PARSER.get(name)
    if needed is not None and reasoning_parser != needed:
        raise ValueError(f"--tool-call-parser {name} reads the calls that --reasoning-parser {needed} separates from "
                         f"the model's channels; add --reasoning-parser {needed}")


def held_from(parser: str, text: str) -> int:
    """Index in ``text`` (the output so far) from which a stream holds the text back: where a call may begin.
    ``len(text)`` when nothing is held (a prefix of a marker at the end is held too)."""
    if parser == "llama3_json":
        stripped = text.lstrip()
        at = len(text) - len(stripped)
        if not stripped or any(stripped.startswith(m) or m.startswith(stripped) for m in MARKERS[parser]):
            return at
        return len(text)
    starts = [text.find(m) for m in MARKERS[parser] if m in text]
    if starts:
        return min(starts)
    return len(text) - marker_tail(text, MARKERS[parser])  # the end of the text may be the start of a marker


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools and what to do with the model's output."""

    mode: str  # none | auto | required | named
    tools: tuple  # the request's tools, as given ({"type": "function", "function": {...}})
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the server's --tool-call-parser
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def _arguments_schemas(self) -> dict[str, dict]:
        """Each tool the grammar covers (required, named), by name: its arguments' JSON schema."""
        names = [self.name] if self.mode == "named" else list(self.functions) if self.mode == "required" else []
        return {n: arguments_schema(self.functions[n]) for n in names}

    def schemas(self) -> list[tuple[str, str]]:
        """(tool name, its arguments' JSON schema as text) of each tool the grammar covers (required, named)."""
        return [(n, json.dumps(schema)) for n, schema in self._arguments_schemas().items()]

    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the structured output that forces one call (required, named), else None. Required:
        each tool's schema sits in the root's ``$defs`` under the tool's name, its local ``$ref``s rewritten to
        point there (they would not resolve nested in ``anyOf``); a tool's own ``$defs`` come along inside it."""
        schemas = self._arguments_schemas()
        if self.mode == "named":
            return "json_schema", json.dumps(schemas[self.name])
        if self.mode == "required":
            return "json_schema", json.dumps({
                "anyOf": [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                           "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/{n}"}}}
                          for n in schemas],
                "$defs": {n: _with_refs(schema, lambda ref, n=n: f"#/$defs/{n}{ref[1:]}")
                          for n, schema in schemas.items()}})
        return None

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, tool calls) of the model's whole output. A forced call cut short (max_tokens) does not parse:
        it is content, and the answer's finish_reason says "length"."""
        if self.mode in ("named", "required"):
            values = _json_values(text)
            call = None
            if values and len(values) == 1:
                call = _call({"name": self.name, "arguments": values[0]} if self.mode == "named" else values[0])
            return ("", [call]) if call else (text, [])
        if self.mode == "auto":
            content, calls = PARSERS[self.parser](text)
            return content, calls if self.parallel else calls[:1]  # vLLM's way too: the first call is kept
        return text, []

    def held_from(self, text: str) -> int:
        """Where a stream holds the output back (the whole of it when a call is forced)."""
        if self.mode in ("named", "required"):
            return 0
        return held_from(self.parser, text) if self.mode == "auto" else len(text)


class ToolOutput:
    """One choice's output under its tool choice, as it streams: text goes out as content until a call may begin
    (``held_from``); the rest waits for the end, where it becomes calls or, if it does not parse, content."""

    def __init__(self, choice: ToolChoice):
        self.choice, self.text, self.sent = choice, "", 0

    def add(self, delta: str) -> str:
        """The content that can go out now."""
        self.text += delta
        hold = self.choice.held_from(self.text)
        out = self.text[self.sent:hold] if hold > self.sent else ""
        self.sent += len(out)
        return out

    def finish(self, reason: str) -> tuple[str, list[ToolCall], str]:
        """(the content not sent yet, the calls, the finish reason: "tool_calls" when there are calls)."""
        content, calls = self.choice.calls(self.text)
        if calls:
            return content[self.sent:], calls, "tool_calls"
        return self.text[self.sent:], [], reason


def arguments_schema(function: dict) -> dict:
    """A function's arguments' JSON schema: its ``parameters``, always of type object (OpenAI's arguments are an
    object; a schema with no root "type" would let any JSON value through, which is no call)."""
    params = function.get("parameters") or {}
    return params if "type" in params else {**params, "type": "object"}


def _with_refs(node, rewrite: Callable[[str], str]):
    """A JSON schema (or a part of one) with every ``$ref`` string replaced by ``rewrite(ref)``."""
    if isinstance(node, dict):
        return {k: rewrite(v) if k == "$ref" and isinstance(v, str) else _with_refs(v, rewrite)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_with_refs(v, rewrite) for v in node]
    return node


def _check_refs(params: dict, where: str) -> None:
    """400 for a ``$ref`` that is not a pointer within the tool's parameters (``#`` or ``#/...``): xgrammar
    resolves nothing else, and would let any value through where it stands."""
    def check(ref: str) -> str:
        if ref != "#" and not ref.startswith("#/"):
            raise APIError(400, f"{where}: parameters: $ref {ref[:100]!r} is not a local reference; only '#' or "
                                f"'#/...' (a JSON pointer within the parameters, e.g. '#/$defs/Name') resolve",
                           where)
        return ref

    try:
        _with_refs(params, check)
    except RecursionError:
        raise APIError(400, f"{where}: parameters nest too deeply", where) from None


def _checked_tools(tools) -> tuple:
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise APIError(400, f"tools must be a list of 1 to {MAX_TOOLS} tools", "tools")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           where)
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'", where)
        if name in seen:
            raise APIError(400, f"{where}: the function name {name!r} is given twice", where)
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"{where} ({name}): parameters must be a JSON schema object", where)
        if params and params.get("type", "object") != "object":
            raise APIError(400, f"{where} ({name}): parameters must be a JSON schema of type object (the arguments "
                                f"are an object), got type {str(params['type'])[:40]}", where)
        _check_refs(params or {}, where)
        if not isinstance(fn.get("description", ""), str):
            raise APIError(400, f"{where} ({name}): description must be a string", where)
    return tuple(tools)


def tool_choice(tools, choice, parser: str | None, parallel: bool = True) -> ToolChoice | None:
    """The request's checked tools and tool_choice (None: no tools); a 400 naming the field otherwise.
    ``parallel``: the request's parallel_tool_calls (false: one call at most)."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    checked = _checked_tools(tools)
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        names = {t["function"]["name"] for t in checked}
        if name not in names:
            raise APIError(400, f"tool_choice names no function among the tools ({', '.join(sorted(names))}); give "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tool_choice")
        return ToolChoice("named", checked, name=name, parallel=parallel)
    if choice not in TOOL_CHOICES:
        raise APIError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function", "tool_choice")
    if choice == "auto" and parser is None:
        raise APIError(400, "tool_choice auto parses the model's tool calls, but this server was started without "
                            f"--tool-call-parser ({', '.join(PARSERS)}); restart it with one, or use "
                            "tool_choice required or a named function", "tool_choice")
    return ToolChoice(choice, checked, parser=parser if choice == "auto" else None, parallel=parallel)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's ``tool_calls`` arguments as objects (templates write
    them with ``tojson``), not the JSON text the API carries."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = dict(call["function"])  # its shape checked with the request (protocol.py)
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # the template shows it as the text it is
    return {**call, "function": fn}
