"""Tool calling over real HTTP with the official ``openai`` client, on a one-rank server (started once for the
module, ``--tool-call-parser hermes``) serving a random tiny Hugging Face Llama whose chat template is a Hermes /
Qwen-style tool-calling template: the rendered prompt equals transformers' ``apply_chat_template`` with the same
tools and messages; ``required`` and named choices always give a call that parses (streamed and not, several
seeds); a full round trip (call, tool result, answer); a tool whose schema cannot constrain the output is a 400
naming it."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.multirank

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")

# A tool-calling template in the Hermes / Qwen2.5 shape (written for this test): tools in a system block, calls as
# <tool_call> JSON, results as <tool_response>.
TEMPLATE = (
    "{% if tools %}system: You may call these tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}tool: <tool_response>{{ m['content'] }}</tool_response>\n"
    "{% elif m.get('tool_calls') %}assistant: {% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
# Bounded arguments (enums, a small integer): a forced call always closes well within max_tokens.
FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "the weather",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                    "day": {"type": "integer", "minimum": 0, "maximum": 6}},
                   "required": ["unit", "day"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [FORECAST, CLOCK]
ASK = [{"role": "user", "content": "the cat sat on the weather"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from helpers import tiny_hf_llama
    from test_serve import KEY, Server

    folder = tmp_path_factory.mktemp("tools") / "tiny-llama"
    tiny_hf_llama(folder, chat_template=TEMPLATE, max_position_embeddings=1024)
    # One rank: what is checked is the HTTP side's (template, parser, the forced call's grammar); structured output
    # on each rank's vocabulary slice is test_serve_sampling.py's, on 2 ranks.
    server = Server(folder, tmp_path_factory.mktemp("logs") / "tools.log", "--api-key", KEY, "--max-model-len",
                    "1024", "--tool-call-parser", "hermes", ranks=1)
    try:
        server.wait_ready()
        yield folder, server, openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    finally:
        server.close()


def _call_args(call) -> dict:
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id
    return args


def _hf_ids(tokenizer, messages) -> list[int]:
    """transformers' rendering of ``messages`` with TOOLS, as token ids."""
    out = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check(name: str, args: dict) -> None:
    if name == "forecast":
        assert set(args) == {"unit", "day"} and args["unit"] in ("c", "f") and 0 <= args["day"] <= 6
    else:
        assert name == "clock" and args == {"zone": args["zone"]} and args["zone"] in ("utc", "local")


def test_the_template_renders_tools_and_tool_messages_as_transformers_does(served):
    import httpx

    folder, server, _ = served
    from test_serve import KEY

    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "forecast", "arguments": '{"unit": "c", "day": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    as_objects = json.loads(json.dumps(messages))
    as_objects[1]["tool_calls"][0]["function"]["arguments"] = {"unit": "c", "day": 2}  # what templates expect
    assert got["tokens"] == _hf_ids(tokenizer, as_objects)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_a_forced_call_always_parses_streamed_and_not(served, choice):
    _, _, client = served
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=seed, max_tokens=64)
        c = answer.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and not c.message.content
        call = c.message.tool_calls[0]
        _check(call.function.name, _call_args(call))
        if isinstance(choice, dict):
            assert call.function.name == "clock"
        # Streamed with the same seed: the same call, sent as OpenAI's tool_calls deltas.
        deltas = list(client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS,
                                                     tool_choice=choice, temperature=1.0, seed=seed, max_tokens=64,
                                                     stream=True))
        calls = [tc for d in deltas if d.choices for tc in (d.choices[0].delta.tool_calls or [])]
        assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].type == "function"
        assert (calls[0].function.name, json.loads(calls[0].function.arguments)) == (call.function.name,
                                                                                      _call_args(call))
        assert [d.choices[0].finish_reason for d in deltas if d.choices][-1] == "tool_calls"
        assert not "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)


def test_a_round_trip_call_result_answer(served):
    """The call the model makes goes back as the assistant's tool_calls with the tool's result; the answer that
    follows is plain content (the random model writes no call), rendered with the whole exchange."""
    folder, _, client = served
    first = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="tiny-llama", messages=messages, tools=TOOLS, tool_choice="auto",
                                            temperature=0, max_tokens=8)
    c = answer.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length") and c.message.content is not None
    # The prompt held the call and its result: its tokens count as transformers renders the same exchange.
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    as_objects = json.loads(json.dumps(messages))
    as_objects[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    want = _hf_ids(tokenizer, as_objects)
    assert answer.usage.prompt_tokens == len(want)
    # Greedy, so the same as transformers' greedy continuation of that prompt.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(want)]), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, len(want):].tolist()
    ends = [t for t in out if t == tokenizer.eos_token_id]
    assert c.message.content == tokenizer.decode(out[:out.index(ends[0])] if ends else out)


def test_a_tool_schema_that_cannot_constrain_the_output_is_a_400_naming_it(served):
    _, _, client = served
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": -3}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=ASK, tools=[FORECAST, broken],
                                       tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools[1]" and "'broken'" in e.value.body["message"], e.value.body


# Strings bounded in length (xgrammar 0.2.9 let raw control characters into those, and the call did not parse).
TICKET = {"type": "function", "function": {"name": "ticket", "parameters": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 4},
                                     "body": {"type": "string", "minLength": 1, "maxLength": 6}},
    "required": ["title", "body"], "additionalProperties": False}}}
# Local references into the schema's $defs and into itself (they did not resolve nested under required's anyOf).
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Cell"}, "via": {"$ref": "#/properties/to"}},
    "required": ["to", "via"], "additionalProperties": False,
    "$defs": {"Cell": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 7}},
                       "required": ["x"], "additionalProperties": False}}}}}
# No root "type": any JSON value was allowed, and one that is not an object is no call.
PING = {"type": "function", "function": {"name": "ping", "parameters": {"description": "takes nothing"}}}


def _forced_calls(client, tools, choice, seeds=range(4), **extra) -> list:
    """The call of each seed's forced answer at temperature 1, streamed and not: always exactly one."""
    calls = []
    for seed in seeds:
        ask = dict(model="tiny-llama", messages=ASK, tools=tools, tool_choice=choice, temperature=1.0, seed=seed,
                   max_tokens=160, **extra)
        c = client.chat.completions.create(**ask).choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        deltas = [d.choices[0] for d in client.chat.completions.create(**ask, stream=True) if d.choices]
        streamed = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
        assert [(s.function.name, json.loads(s.function.arguments)) for s in streamed] == [
            (c.message.tool_calls[0].function.name, _call_args(c.message.tool_calls[0]))]
        calls.append((c.message.tool_calls[0].function.name, _call_args(c.message.tool_calls[0])))
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ticket"}}])
def test_a_forced_call_with_bounded_strings_always_parses_at_temperature_1(served, choice):
    for name, args in _forced_calls(served[2], [TICKET, CLOCK], choice, seeds=range(6)):
        if name == "ticket":
            assert set(args) == {"title", "body"} and len(args["title"]) <= 4 and 1 <= len(args["body"]) <= 6
        else:
            _check(name, args)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}},
                                    {"type": "function", "function": {"name": "ping"}}])
def test_forced_calls_of_schemas_with_defs_and_refs_or_no_root_type(served, choice):
    for name, args in _forced_calls(served[2], [MOVE, PING], choice):
        if name == "move":
            assert set(args) == {"to", "via"} and all(set(v) == {"x"} and 0 <= v["x"] <= 7 for v in args.values())
        else:
            assert name == "ping" and args == {}


@pytest.mark.parametrize("tools,param,words", [
    ([CLOCK, {"type": "function", "function": {"name": "long", "description": "x" * (1 << 20)}}], "tools[1]",
     "characters"),
    ([{"type": "function", "function": {"name": "remote", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "https://example.com/a.json"}}}}}], "tools[0]", "not a local reference"),
])
def test_a_bad_tool_is_a_400_naming_it(served, tools, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        served[2].chat.completions.create(model="tiny-llama", messages=ASK, tools=tools, tool_choice="required",
                                          max_tokens=8)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


@pytest.mark.parametrize("function,param", [
    ("forecast", "function"), (3, "function"), (["forecast"], "function"), ({"arguments": "{}"}, "function.name"),
    ({"name": "forecast", "arguments": 5}, "function.arguments"),
    ({"name": "forecast", "arguments": ["c", 2]}, "function.arguments"),
    ({"name": "forecast"}, "function.arguments"),
])
def test_a_malformed_call_in_the_history_is_a_400_naming_it_in_chat_and_tokenize(served, function, param):
    import httpx

    from test_serve import KEY

    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": function}]}, {"role": "tool", "content": "sunny"}]
    want = f"messages[1].tool_calls[0].{param}"
    with pytest.raises(openai.BadRequestError) as e:
        served[2].chat.completions.create(model="tiny-llama", messages=messages, tools=TOOLS, max_tokens=4)
    assert e.value.body["param"] == want, e.value.body
    got = httpx.post(served[1].url + "/tokenize", json={"messages": messages, "tools": TOOLS},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == want, got.text


def test_a_call_with_arguments_as_an_object_is_taken_as_templates_take_it(served):
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "forecast", "arguments": {"unit": "c", "day": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = served[2].chat.completions.create(model="tiny-llama", messages=messages, tools=TOOLS, max_tokens=2,
                                               temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


TWO_CALLS = ('<tool_call>{"name": "clock", "arguments": {"zone": "utc"}}</tool_call>'
             '<tool_call>{"name": "forecast", "arguments": {"unit": "c", "day": 1}}</tool_call>')


@pytest.mark.parametrize("parallel,names", [(None, ["clock", "forecast"]), (True, ["clock", "forecast"]),
                                            (False, ["clock"])])
def test_parallel_tool_calls_false_answers_one_call_streamed_and_not(served, parallel, names):
    """The model writes two calls (guided_choice makes it, under tool_choice auto and the hermes parser)."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    ask = dict(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=400,
               extra_body={"guided_choice": [TWO_CALLS]}, **extra)
    c = served[2].chat.completions.create(**ask).choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == names
    deltas = [d.choices[0] for d in served[2].chat.completions.create(**ask, stream=True) if d.choices]
    streamed = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in streamed] == list(enumerate(names))
    assert deltas[-1].finish_reason == "tool_calls"
