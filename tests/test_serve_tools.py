"""Tool calling over real HTTP with the official ``openai`` client, on one 2-rank TSP server (started once for the
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
    server = Server(folder, tmp_path_factory.mktemp("logs") / "tools.log", "--api-key", KEY, "--max-model-len",
                    "1024", "--tool-call-parser", "hermes")
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
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "string", "minLength": -3}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=ASK, tools=[FORECAST, broken],
                                       tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools" and "'broken'" in e.value.body["message"], e.value.body
