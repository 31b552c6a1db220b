"""Tool calling's pieces without a server: each parser against hand-written model outputs (well-formed, several
calls, content before them, and malformed ones that must stay content), where a stream holds text back, the checks
of ``tools`` / ``tool_choice``, the grammars that force a call (compiled by xgrammar, and every string they accept
parses as a call), and the messages a chat template receives."""

from __future__ import annotations

import json

import pytest

from torchtsp.serve.protocol import APIError
from torchtsp.serve.tools import PARSERS, ToolCall, check_parser, held_from, template_messages, tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "time_now", "parameters": {"type": "object", "properties": {}}}}


def call(name, **args) -> ToolCall:
    return ToolCall(name, json.dumps(args))


# (parser, model output, expected content, expected calls)
PARSED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>', "",
     [call("get_weather", city="Paris", unit="c")]),
    ("hermes", 'Let me look.\n<tool_call>{"name": "time_now", "arguments": {}}</tool_call>\n'
               '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
     "Let me look.", [call("time_now"), call("get_weather", city="Oslo")]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}', "",
     [call("get_weather", city="Rome", unit="f")]),
    ("llama3_json", '<|python_tag|>{"name": "time_now", "parameters": {}}; {"name": "time_now", "arguments": {}}', "",
     [call("time_now"), call("time_now")]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima", "unit": "c"}}]', "Sure.",
     [call("get_weather", city="Lima", unit="c")]),
    ("mistral", '[TOOL_CALLS]time_now[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Kyiv"}', "",
     [call("time_now"), call("get_weather", city="Kyiv")]),
]

# Text that looks like a call but is not one: it stays content, whole.
MALFORMED = [
    ("hermes", "The weather is fine."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>'),  # JSON cut short
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {}}'),  # never closed (max_tokens)
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call> and then some words'),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}} {"name": "b"}</tool_call>'),  # two objects in one block
    ("hermes", '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>'),  # arguments not an object
    ("llama3_json", "I would call get_weather for you."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("llama3_json", '{"city": "Paris"}'),  # a JSON object, not a call
    ("llama3_json", '{"name": "a", "parameters": {}} trailing words'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}'),
    ("mistral", '[TOOL_CALLS]{"name": "a"}'),
    ("mistral", "[TOOL_CALLS]time_now{}"),  # no [ARGS]
]


@pytest.mark.parametrize("parser,text,content,calls", PARSED)
def test_each_parser_reads_its_format(parser, text, content, calls):
    got_content, got_calls = PARSERS[parser](text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == [(c.name, json.loads(c.arguments))
                                                                      for c in calls]


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_what_does_not_parse_stays_content(parser, text):
    assert PARSERS[parser](text) == (text, [])


def test_an_unknown_parser_is_a_startup_error():
    check_parser("hermes")
    with pytest.raises(ValueError, match="unknown --tool-call-parser 'qwen'; choose one of: hermes"):
        check_parser("qwen")


@pytest.mark.parametrize("parser,text,held", [
    ("hermes", "Hello there", 11), ("hermes", "Hello <tool", 6), ("hermes", "Hi <tool_call>{", 3),
    ("hermes", "a < b", 5), ("llama3_json", "  {", 2), ("llama3_json", "Sure", 4), ("llama3_json", "<|py", 0),
    ("mistral", "ok [TOOL", 3), ("mistral", "ok", 2),
])
def test_a_stream_holds_back_only_where_a_call_may_begin(parser, text, held):
    assert held_from(parser, text) == held


@pytest.mark.parametrize("tools,choice,parser,param,words", [
    (None, "required", "hermes", "tool_choice", "needs tools"),
    ([WEATHER], "sometimes", "hermes", "tool_choice", "one of none, auto, required"),
    ([WEATHER], "auto", None, "tool_choice", "--tool-call-parser"),
    ([WEATHER], None, None, "tool_choice", "--tool-call-parser"),  # auto is the default with tools
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "hermes", "tool_choice", "get_weather"),
    ([{"type": "function"}], "required", None, "tools[0]", "tools[0] must be"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "required", None, "tools[0]", "64 letters"),
    ([WEATHER, WEATHER], "required", None, "tools[1]", "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", None, "tools[0]", "schema"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "required", None,
     "tools[1]", "of type object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "https://example.com/a.json"}}}}}], "auto", "hermes", "tools[0]", "not a local reference"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "a.json#/x"}}}], "required", None,
     "tools[0]", "not a local reference"),
    ([], "auto", "hermes", "tool_choice", "needs tools"),
])
def test_bad_tools_and_tool_choice_are_400_naming_the_field(tools, choice, parser, param, words):
    with pytest.raises(APIError) as e:
        tool_choice(tools, choice, parser)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_always_parses(choice):
    """The grammar of required / a named function compiles, and strings it accepts parse as the call (xgrammar's
    matcher fed a valid call byte by byte accepts it; one with a wrong name or argument is refused)."""
    xgr = pytest.importorskip("xgrammar")
    tools = tool_choice([WEATHER, CLOCK], choice, None)
    kind, source = tools.grammar()
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
    args = {"city": "Paris", "unit": "c"}
    good = json.dumps(args if tools.mode == "named" else {"name": "get_weather", "arguments": args})  # ", " ": "
    bad = good.replace('"c"', '"k"')
    assert xgr.testing._is_grammar_accept_string(grammar, good)
    assert not xgr.testing._is_grammar_accept_string(grammar, bad)
    content, calls = tools.calls(good)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args)]
    if tools.mode == "required":
        other = json.dumps({"name": "time_now", "arguments": {}})
        assert xgr.testing._is_grammar_accept_string(grammar, other)


def test_templates_get_the_arguments_as_objects():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[0] == messages[0] and out[2] == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is untouched


@pytest.mark.parametrize("deltas,content,names,reason", [
    (["Hi ", "there <tool", "_call>", '{"name": "time_now", "arguments": {}}', "</tool_call>"], "Hi there",
     ["time_now"], "tool_calls"),
    (["a < b ", "is true"], "a < b is true", [], "stop"),
    (["<tool_call>", '{"name": "time_now"'], "<tool_call>{\"name\": \"time_now\"", [], "length"),  # cut short
])
def test_a_streamed_output_sends_content_and_holds_back_the_calls(deltas, content, names, reason):
    from torchtsp.serve.tools import ToolOutput

    out = ToolOutput(tool_choice([WEATHER, CLOCK], "auto", "hermes"))
    sent = "".join(out.add(d) for d in deltas)
    rest, calls, why = out.finish("length" if reason == "length" else "stop")
    assert "<tool_call" not in sent or not names  # a call's text never goes out as content
    assert (sent + rest).rstrip() == content and [c.name for c in calls] == names and why == reason


# Strings bounded in length: xgrammar 0.2.9 wrote their characters as a class that let raw control characters in.
TICKET = {"type": "function", "function": {"name": "ticket", "parameters": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 6},
                                     "body": {"type": "string", "minLength": 1, "maxLength": 10}},
    "required": ["title", "body"], "additionalProperties": False}}}
NAMED_TICKET = {"type": "function", "function": {"name": "ticket"}}


def _byte_grammar(tools):
    """The forced call's grammar as a rank compiles it (``Grammars``), over the byte tokenizer's vocabulary (bytes
    0..255, 256 the end), and a test of whether it accepts a text whole."""
    from torchtsp.data.tokenizers import ByteTokenizer
    from torchtsp.serve.structured import Grammars

    grammars = Grammars(ByteTokenizer(), 257, 256)
    kind, source = tools.grammar()

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(kind, source)
        return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(256)

    return grammars, (kind, source), accepts


@pytest.mark.parametrize("choice", ["required", NAMED_TICKET])
def test_a_forced_call_grammar_escapes_control_characters_and_whatever_it_accepts_is_the_call(choice):
    pytest.importorskip("xgrammar")
    import random

    tools = tool_choice([TICKET, CLOCK], choice, None)
    grammars, grammar, accepts = _byte_grammar(tools)

    def as_output(args: str) -> str:
        return args if tools.mode == "named" else f'{{"name": "ticket", "arguments": {args}}}'

    assert accepts(as_output('{"title": "&", "body": "falcson"}'))
    assert not accepts(as_output('{"title": "&", "body": "fal\x05cson"}'))  # raw: not JSON
    assert not accepts(as_output('{"title": "a\tb", "body": "x"}'))
    escaped = as_output('{"title": "\\"a\\"", "body": "fal\\u0005c\\n"}')  # an escape is one character
    assert accepts(escaped)
    assert tools.calls(escaped)[1] == [ToolCall("ticket", json.dumps({"title": '"a"', "body": "fal\x05c\n"},
                                                                     ensure_ascii=False))]
    # Random outputs of the grammar (ASCII), a control byte taken whenever one is allowed: each is a call, in its
    # schema.
    rng = random.Random(0)
    for _ in range(12):
        matcher, out = grammars.matcher(*grammar), bytearray()
        while not matcher.is_terminated():
            mask = grammars.bitmask([matcher])[0]
            allowed = [t for t in [*range(128), 256] if mask[t // 32] >> (t % 32) & 1]
            token = rng.choice([t for t in allowed if t < 0x20] or allowed)
            assert matcher.accept_token(token)
            out += bytes([token]) if token < 256 else b""
        text = out.decode()
        content, calls = tools.calls(text)
        assert content == "" and len(calls) == 1, text
        args = json.loads(calls[0].arguments)
        if calls[0].name == "ticket":
            assert set(args) == {"title", "body"} and len(args["title"]) <= 6 and 1 <= len(args["body"]) <= 10
        else:
            assert calls[0].name == "time_now" and args == {}


def test_a_raw_control_character_in_a_call_is_read_and_written_back_as_json():
    content, calls = PARSERS["hermes"]('<tool_call>{"name": "a", "arguments": {"t": "x\x05y"}}</tool_call>')
    assert content == "" and calls == [ToolCall("a", '{"t": "x\\u0005y"}')]


DEFS_TOOL = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}, "via": {"$ref": "#/properties/to"}},
    "required": ["to"], "additionalProperties": False,
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                        "additionalProperties": False}}}}}
UNTYPED_TOOL = {"type": "function", "function": {"name": "note", "parameters": {"description": "no root type"}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_local_refs_resolve_in_a_forced_call_and_a_schema_without_a_root_type_is_an_object(choice):
    xgr = pytest.importorskip("xgrammar")
    tools = tool_choice([DEFS_TOOL, UNTYPED_TOOL], choice, None)
    grammar = xgr.Grammar.from_json_schema(tools.grammar()[1], any_whitespace=False)

    def accepts(name: str, args: str) -> bool:
        text = args if tools.mode == "named" else f'{{"name": "{name}", "arguments": {args}}}'
        return xgr.testing._is_grammar_accept_string(grammar, text)

    assert accepts("move", '{"to": {"x": 1}, "via": {"x": 2}}')
    assert not accepts("move", '{"to": {"y": 1}}') and not accepts("move", '{"to": {"x": 1}, "via": 3}')
    if tools.mode == "required":
        assert accepts("note", "{}") and not accepts("note", '"a string"') and not accepts("note", "1")


@pytest.mark.parametrize("parallel,names", [(True, ["time_now", "get_weather"]), (False, ["time_now"])])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, names):
    from torchtsp.serve.tools import ToolOutput

    text = ('<tool_call>{"name": "time_now", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>')
    choice = tool_choice([WEATHER, CLOCK], "auto", "hermes", parallel=parallel)
    assert [c.name for c in choice.calls(text)[1]] == names
    out = ToolOutput(choice)  # streamed: the same calls at the end
    assert out.add(text) == "" and [c.name for c in out.finish("stop")[1]] == names
