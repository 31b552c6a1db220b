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
    ([{"type": "function"}], "required", None, "tools", "tools[0] must be"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "required", None, "tools", "64 letters"),
    ([WEATHER, WEATHER], "required", None, "tools", "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", None, "tools", "schema"),
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
