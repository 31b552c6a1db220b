"""``--reasoning-parser`` (qwen3, deepseek_r1, gpt_oss) and the ``openai`` tool-call parser, without ranks.

The parsers are checked against readers written here from the formats' specs (Qwen3's and DeepSeek-R1's
``<think>``, OpenAI's harmony), on texts written from those specs, whole, cut into two streamed pieces at every
character and streamed one character at a time; against openai-harmony's own parser where its vocabulary loads;
then the completion service is driven with scripted token ids through a real tokenizer (the markers as special
tokens, or spelled out one character per token) and a real chat template, streamed and not; and the start-up
refusals are checked through the command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from helpers import cli_in_process, tiny_hf_llama  # noqa: E402
from torchtsp.serve.reasoning import (  # noqa: E402
    HarmonySplit,
    ThinkSplit,
    harmony_messages,
    reasoning_parser,
)
from torchtsp.serve.tools import parse_openai  # noqa: E402

# -- readers written from the specs ------------------------------------------------------------------------------


def think_reference(text: str, inside: bool) -> tuple[str, str]:
    """Qwen3 / DeepSeek-R1: reasoning opens at a ``<think>`` that starts the output (or in the prompt: ``inside``)
    and runs to the first ``</think>``; the rest is the answer."""
    if text.startswith("<think>"):
        text, inside = text[len("<think>"):], True
    if not inside:
        return "", text
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


HARMONY_SPECIAL = re.compile(r"(<\|(?:start|channel|message|constrain|end|return|call)\|>)")


def harmony_reference(output: str) -> tuple[str, str, list]:
    """(reasoning, content, calls) of a harmony completion after the prompt ``<|start|>assistant``, read token by
    token as the harmony spec writes messages: ``<|start|>`` header ``<|message|>`` body terminator. Analysis
    bodies are reasoning; final bodies and commentary without a recipient (preambles) are content, each kind
    joined by a newline; a message to ``functions.NAME`` ended by ``<|call|>`` is a call of NAME with its JSON
    body."""
    tokens = [t for t in HARMONY_SPECIAL.split("<|start|>assistant" + output) if t]
    messages, i, cut = [], 0, ""
    while i < len(tokens):
        if tokens[i] in ("<|end|>", "<|return|>", "<|call|>"):  # outside any message: ends nothing, is no text
            i += 1
            continue
        assert tokens[i] == "<|start|>", tokens[i:]
        if "<|message|>" not in tokens[i:]:  # a header cut short (max_tokens): what the model wrote of it
            cut = "".join(tokens[i:]).removeprefix("<|start|>assistant" if i == 0 else "")
            break
        m = tokens.index("<|message|>", i)
        ends = [n for n in range(m + 1, len(tokens)) if tokens[n] in ("<|end|>", "<|return|>", "<|call|>")]
        end = ends[0] if ends else len(tokens)
        header = "".join(tokens[i + 1:m])
        channel = re.search(r"<\|channel\|>(\w+)", header)
        recipient = re.search(r"to=([^\s<]+)", header)
        messages.append((channel and channel.group(1), recipient and recipient.group(1), "".join(tokens[m + 1:end]),
                         tokens[end] if ends else None))
        i = end + 1
    reasoning = "\n".join(body for channel, to, body, _ in messages if channel == "analysis" and to is None)
    content = "\n".join(body for channel, to, body, _ in messages if channel in ("final", "commentary") and to is None)
    content += cut
    calls = [(to.removeprefix("functions."), json.loads(body)) for _, to, body, end in messages
             if to is not None and to.startswith("functions.") and end == "<|call|>"]
    return reasoning, content, calls


# -- the parsers against them, cut every way -------------------------------------------------------------------------


def _streamed(make, text: str) -> list[tuple[str, str]]:
    """(reasoning, content) of ``text`` fed whole, cut in two at every character, and one character at a time."""
    outs = []
    whole = make()
    outs.append(whole.add(text, done=True))
    for cut in range(len(text) + 1):
        split = make()
        parts = [split.add(text[:cut]), split.add(text[cut:], done=True)]
        outs.append(("".join(r for r, _ in parts), "".join(c for _, c in parts)))
    split = make()
    parts = [split.add(ch) for ch in text] + [split.add("", done=True)]
    outs.append(("".join(r for r, _ in parts), "".join(c for _, c in parts)))
    return outs


THINK_TEXTS = [
    "<think>\nThe user greets me.\n</think>\n\nHello!",  # Qwen3's shape
    "Hello, no thinking here.",
    "<think>cut off by max_tokens",
    "reasoning from the prompt's <think></think>answer",
    "<think>a</think>b</think>c",  # the first closes; later ones are answer text
    "a </thi b</think>c <think>",  # a prefix of the marker inside the reasoning is text
    "<thinking>not a marker</think>",
    "<think></think>",
    "",
]


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("text", THINK_TEXTS)
def test_think_split_equals_the_spec_whole_and_cut_anywhere(text, inside):
    want = think_reference(text, inside)
    for got in _streamed(lambda: ThinkSplit(inside), text):
        assert got == want, (text, got, want)


HARMONY_TEXTS = [
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
    "2 + 2 = 4.<|return|>",
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Tokyo\"}<|call|>",
    # the recipient in the role's part of the header, the content type without <|constrain|>
    "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.lookup<|channel|>commentary "
    "json<|message|>{\"q\": [1, 2]}<|call|>",
    # a preamble (commentary without recipient) is content, then the call
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking the weather."
    "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",
    # two analysis messages: joined by a newline
    "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
    "<|channel|>analysis<|message|>Still thinking when max_tokens",  # cut in the reasoning
    "<|channel|>final<|message|>Hi <| not a token |> <|en<|return|>",
    "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|><|return|>",
    "<|channel|>final<|message|>cut by max_tokens at <|ret",  # what may have been a marker is text at the end
    "<|channel|>final<|message|>x<|end|><|return|>",  # an EOS after the message's own end
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin",  # a header cut short: content as is
]


@pytest.mark.parametrize("text", HARMONY_TEXTS)
def test_harmony_split_and_the_openai_tool_parser_equal_the_spec_whole_and_cut_anywhere(text):
    reasoning, content, calls = harmony_reference(text)
    for got_reasoning, passed_on in _streamed(lambda: HarmonySplit("<|start|>assistant"), text):
        got_content, got_calls = parse_openai(passed_on)
        assert got_reasoning == reasoning, (text, got_reasoning)
        assert (got_content, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (content, calls), passed_on


@pytest.mark.parametrize("passed_on", [
    "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": <|call|>",  # bad JSON
    "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}",  # cut: no <|call|>
    "<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{\"q\": 1}<|call|>",  # not a function
    "<|start|>assistant<|channel|>commentary to=functions.f code<|message|>print(1)<|call|>",  # not JSON content
    "<|start|>assistant<|channel|>commentary to=functions.f<|message|>[1, 2]<|call|>",  # arguments not an object
])
def test_a_harmony_message_that_is_no_function_call_stays_content(passed_on):
    assert parse_openai("Before. " + passed_on) == ("Before. " + passed_on, [])


def test_harmony_messages_read_each_header_as_the_spec_writes_it():
    text = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>"
            " <|start|>assistant to=functions.x<|channel|>commentary json<|message|>[]<|call|>")
    (h1, b1, t1), (h2, b2, t2) = harmony_messages(text)
    assert (h1.role, h1.channel, h1.recipient, h1.content_type, b1, t1) == (
        "assistant", "commentary", "functions.get_weather", "json", "{}", "<|call|>")
    assert (h2.role, h2.channel, h2.recipient, h2.content_type, b2, t2) == (
        "assistant", "commentary", "functions.x", "json", "[]", "<|call|>")
    assert harmony_messages("text outside <|start|>assistant<|message|>x<|end|>") is None


def _harmony_encoding():
    harmony = pytest.importorskip("openai_harmony")
    try:
        return harmony, harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # noqa: BLE001 - HarmonyError: it downloads its vocabulary on first use
        pytest.skip(f"openai-harmony cannot load its vocabulary here (it downloads it on first use): {e}")


def test_the_harmony_split_reads_what_openai_harmonys_renderer_writes():
    """openai-harmony renders an assistant turn (analysis, then a call) as the model writes it and its own parser
    reads the messages back: ours read the same headers and bodies, and the split gives the analysis as reasoning."""
    harmony, encoding = _harmony_encoding()
    Message, Role = harmony.Message, harmony.Role
    turn = [Message.from_role_and_content(Role.ASSISTANT, "Need Tokyo's weather.").with_channel("analysis"),
            Message.from_role_and_content(Role.ASSISTANT, '{"location": "Tokyo"}').with_channel("commentary")
            .with_recipient("functions.get_weather").with_content_type("<|constrain|>json")]
    tokens = [t for m in turn for t in encoding.render(m)]
    text = encoding.decode(tokens)
    theirs = encoding.parse_messages_from_completion_tokens(tokens, None)
    ours = harmony_messages(text)
    assert [(h.channel, h.recipient, body) for h, body, _ in ours] == [
        (m.channel, m.recipient, m.content[0].text) for m in theirs]
    reasoning, passed_on = HarmonySplit("<|start|>assistant").add(text.removeprefix("<|start|>assistant"), done=True)
    assert reasoning == theirs[0].content[0].text
    if ours[-1][2] == "<|call|>":  # a call as the model ends it: the openai tool parser reads it
        assert [(c.name, json.loads(c.arguments)) for c in parse_openai(passed_on)[1]] == [
            ("get_weather", {"location": "Tokyo"})]


# -- the completion service, with scripted token ids -----------------------------------------------------------------

QWEN3_TEMPLATE = (  # Qwen3's shape, written for these tests: enable_thinking false closes the reasoning in the prompt
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")
QWEN3_THINKING_TEMPLATE = QWEN3_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}",
                                                 "{{ '<|im_start|>assistant\\n<think>\\n' }}")
HARMONY_TEMPLATE = (  # harmony's shape, written for these tests
    "{{ '<|start|>system<|message|>Reasoning: ' + (reasoning_effort or 'medium') + '<|end|>' }}"
    "{% if tools %}{{ '<|start|>developer<|message|># Tools' }}{% for t in tools %}{{ '\\n' }}"
    "{{ t['function'] | tojson }}{% endfor %}{{ '<|end|>' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "{{ '<|start|>assistant<|channel|>commentary to=functions.' + c['function']['name'] + ' <|constrain|>json"
    "<|message|>' }}{{ c['function']['arguments'] | tojson }}{{ '<|call|>' }}{% endfor %}"
    "{% elif m['role'] == 'assistant' %}{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + "
    "'<|end|>' }}"
    "{% elif m['role'] == 'tool' %}{{ '<|start|>functions.tool to=assistant<|channel|>commentary<|message|>' + "
    "m['content'] + '<|end|>' }}"
    "{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
THINK_TOKENS = {"<|im_start|>": True, "<|im_end|>": True, "<think>": True, "</think>": True}
HARMONY_TOKENS = {t: True for t in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                                    "<|return|>", "<|call|>")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    tiny_hf_llama(root / "think", chat_template=QWEN3_TEMPLATE, added_tokens=THINK_TOKENS, eos_token="<|im_end|>")
    tiny_hf_llama(root / "harmony", chat_template=HARMONY_TEMPLATE, added_tokens=HARMONY_TOKENS,
                  eos_token="<|return|>")
    return root


def _ids(tokenizer, text: str, spell: bool) -> list[int]:
    """``text`` as the model would write it: its markers as their special tokens, or every character one token
    (markers spelled out, so that each is cut across tokens at every place)."""
    if not spell:
        return tokenizer.encode(text)
    ids = [tokenizer.encode(ch) for ch in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


class _Scripted:
    """The engine as the service sees it: every request answers ``ids`` one token at a time, then finishes."""

    state, error, waiting, healthy, info = "ready", None, 0, True, {}

    def __init__(self, ids: list[int], finish: str = "stop"):
        self.ids, self.finish, self.stop_ids = ids, finish, []

    def submit(self, prompt, max_tokens, sampling, stop_token_ids, ignore_eos=False, **options):
        self.stop_ids.append(list(stop_token_ids))
        return _Stream([("token", i) for i in self.ids] + [("finished", self.finish)])

    def cancel(self, stream):
        pass


class _Stream:
    def __init__(self, events):
        self.events = events

    async def next(self):
        return self.events.pop(0)


async def _never():
    return False


@contextlib.contextmanager
def _service(folder, parser: str | None, template: str | None = None, tool_parser: str | None = None):
    """A completion service over ``folder``'s tokenizer and chat template (or ``template``), its engine scripted
    (``service.client.ids``), the template's renderer stopped at the end."""
    from torchtsp.data.tokenizers import HFTokenizer, read_chat_template
    from torchtsp.serve.metrics import Metrics
    from torchtsp.serve.service import CompletionService, ServerState
    from torchtsp.serve.template import ChatTemplate

    tokenizer = HFTokenizer(folder)
    source = template or read_chat_template(tokenizer)
    state = ServerState(client=_Scripted([]), tokenizer=tokenizer, template=ChatTemplate(source, processes=1),
                        model_name="m", max_model_len=1024, vocab_size=tokenizer.vocab_size,
                        eos_token_id=tokenizer.eos_id, api_key=None, max_queue=8, metrics=Metrics("m"),
                        tool_call_parser=tool_parser, reasoning=reasoning_parser(parser, source, tokenizer))
    try:
        yield CompletionService(state)
    finally:
        state.template.close()


def _answers(service, request: dict, ids: list[int]) -> tuple[dict, list[dict]]:
    """The non-streamed answer and the streamed chunks of ``request`` (one choice) when the model writes ``ids``."""
    from torchtsp.serve.protocol import ChatCompletionRequest, parse

    service.client.ids = ids

    async def run():
        body = parse(ChatCompletionRequest, json.dumps(request).encode())
        choices = await service.chat_choices(body)
        whole = await service.complete(choices, service.submit(choices), True, _never)
        choices = await service.chat_choices(body)
        chunks = [c async for c in service.stream(choices, service.submit(choices), True, True, _never)]
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert chunks[-1] == "data: [DONE]\n\n"
    return whole, [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def _streamed_fields(chunks: list[dict]) -> dict:
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return {"reasoning_content": "".join(d.get("reasoning_content") or "" for d in deltas),
            "content": "".join(d.get("content") or "" for d in deltas),
            "tool_calls": [t for d in deltas for t in d.get("tool_calls") or []],
            "finish_reason": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]}


ASK = [{"role": "user", "content": "the cat sat on the mat"}]
SPELLINGS = (False, True)  # the markers as their special tokens; every character one token


@pytest.mark.parametrize("parser,template,inside", [
    ("qwen3", QWEN3_TEMPLATE, False), ("qwen3", QWEN3_THINKING_TEMPLATE, True),
    ("deepseek_r1", QWEN3_TEMPLATE, True), ("deepseek_r1", QWEN3_THINKING_TEMPLATE, True)])
def test_think_answers_streamed_and_not_equal_the_spec(folders, parser, template, inside):
    """Qwen3's template opens nothing in the prompt (the output's own <think> opens the reasoning), its thinking
    variant opens <think> there; DeepSeek-R1 reads reasoning up to </think> either way."""
    with _service(folders / "think", parser, template) as service:
        tokenizer = service.state.tokenizer
        for output in ("<think>\nThe cat sat.\n</think>\n\nOn the mat.", "It sat </think> there.", "<think>cut </thi"):
            for spell in SPELLINGS:
                ids = _ids(tokenizer, output, spell) + [tokenizer.eos_id]  # the engine sends the EOS that ends it
                whole, chunks = _answers(service, {"messages": ASK, "stream_options": {"include_usage": True}}, ids)
                reasoning, content = think_reference(output, inside)
                message = whole["choices"][0]["message"]
                assert (message["reasoning_content"], message["content"]) == (reasoning or None, content or None)
                streamed = _streamed_fields(chunks)
                assert (streamed["reasoning_content"], streamed["content"]) == (reasoning, content), (output, spell)
                # every scripted token is counted, in both answers
                assert whole["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"] == len(ids)


def test_enable_thinking_false_in_chat_template_kwargs_gives_no_reasoning(folders):
    output = "Plain answer, no </think> to read."
    with _service(folders / "think", "deepseek_r1") as service:
        ids = service.state.tokenizer.encode(output) + [service.state.tokenizer.eos_id]
        whole, chunks = _answers(service, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, ids)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, output)
    assert _streamed_fields(chunks)["content"] == output


def test_harmony_answers_streamed_and_not_equal_the_spec(folders):
    with _service(folders / "harmony", "gpt_oss") as service:
        tokenizer = service.state.tokenizer
        stops = {tokenizer.tokenizer.token_to_id(t) for t in ("<|return|>", "<|call|>")}
        for output in HARMONY_TEXTS[:1] + HARMONY_TEXTS[4:]:
            for spell in SPELLINGS:
                whole, chunks = _answers(service, {"messages": ASK}, _ids(tokenizer, output, spell))
                reasoning, content, _ = harmony_reference(output)
                message = whole["choices"][0]["message"]
                assert (message["reasoning_content"], message["content"]) == (reasoning or None, content or None)
                streamed = _streamed_fields(chunks)
                assert (streamed["reasoning_content"], streamed["content"]) == (reasoning, content), (output, spell)
                assert stops <= set(service.client.stop_ids[-1]), "harmony's <|return|> and <|call|> end the answer"


FORECAST = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}


def test_a_harmony_call_becomes_openai_tool_calls_streamed_and_not(folders):
    with _service(folders / "harmony", "gpt_oss", tool_parser="openai") as service:
        for output in HARMONY_TEXTS[1:4]:
            for spell in SPELLINGS:
                whole, chunks = _answers(service, {"messages": ASK, "tools": [FORECAST], "tool_choice": "auto"},
                                         _ids(service.state.tokenizer, output, spell))
                reasoning, content, calls = harmony_reference(output)
                choice = whole["choices"][0]
                assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == reasoning
                assert choice["message"]["content"] == (content or None) and len(calls) == 1
                assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
                        choice["message"]["tool_calls"]] == calls
                streamed = _streamed_fields(chunks)
                assert streamed["finish_reason"] == "tool_calls" and streamed["reasoning_content"] == reasoning
                assert streamed["content"] == content and [
                    (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["tool_calls"]
                ] == calls


def test_without_a_parser_the_text_is_untouched(folders):
    """As before: the special markers are skipped from the text like every special token, nothing is split."""
    with _service(folders / "think", None) as service:
        tokenizer = service.state.tokenizer
        ids = tokenizer.encode("<think>\nhm\n</think>\n\nHi") + [tokenizer.eos_id]
        whole, chunks = _answers(service, {"messages": ASK}, ids)
    message = whole["choices"][0]["message"]
    assert message == {"role": "assistant", "content": tokenizer.decode(ids)} and "reasoning_content" not in message
    assert _streamed_fields(chunks)["content"] == tokenizer.decode(ids)


def test_a_constrained_output_is_reasoning_only_where_it_writes_the_markers(folders):
    """A grammar writes the output from its first token: the <think> the prompt opens (deepseek_r1) does not carry
    into it, so a structured answer is content, and one the grammar lets write <think>...</think> is split."""
    pytest.importorskip("xgrammar")
    with _service(folders / "think", "deepseek_r1", QWEN3_THINKING_TEMPLATE) as service:
        tokenizer = service.state.tokenizer
        for output, want in [('{"a": 1}', (None, '{"a": 1}')), ("<think>hm</think>yes", ("hm", "yes"))]:
            whole, chunks = _answers(service, {"messages": ASK, "guided_choice": [output]},
                                     tokenizer.encode(output) + [tokenizer.eos_id])
            message = whole["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == want
            streamed = _streamed_fields(chunks)
            assert (streamed["reasoning_content"] or None, streamed["content"]) == want


BAD_TEMPLATE_VARIABLES = [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
]


def test_template_variables_reach_the_template_and_bad_ones_are_a_400_naming_the_field(folders):
    from torchtsp.serve.protocol import APIError, ChatCompletionRequest, parse

    def choices(service, fields):
        body = parse(ChatCompletionRequest, json.dumps({"messages": ASK, **fields}).encode())
        return asyncio.run(service.chat_choices(body))

    with _service(folders / "harmony", "gpt_oss") as service:
        (choice,) = choices(service, {"reasoning_effort": "high"})
        assert service.state.tokenizer.decode(choice.prompt).startswith("systemReasoning: high")
        for fields, param in BAD_TEMPLATE_VARIABLES:
            with pytest.raises(APIError) as e:
                choices(service, fields)
            assert e.value.status == 400 and e.value.param == param, e.value.message


# -- start-up -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,folder,template,words", [
    ("qwen3", "harmony", None, "never mentions <think>"),
    ("deepseek_r1", "harmony", None, "never mentions <think>"),
    ("gpt_oss", "think", None, "not harmony's"),
    ("gpt_oss", "think", HARMONY_TEMPLATE, "no token <|start|>"),  # a harmony template, but not its tokenizer
])
def test_a_reasoning_parser_that_does_not_match_the_model_refuses_in_one_line(folders, tmp_path, name, folder,
                                                                               template, words):
    extra = []
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        extra = ["--chat-template", tmp_path / "t.jinja"]
    done = cli_in_process("serve", "--hf", folders / folder, "--reasoning-parser", name, *extra)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and words in lines[0] and "--reasoning-parser" in lines[0], \
        done.stderr


def test_an_unknown_reasoning_parser_is_argparses_line_with_the_choices(folders):
    done = cli_in_process("serve", "--hf", folders / "think", "--reasoning-parser", "qwen2")
    assert done.returncode == 2 and "invalid choice: 'qwen2'" in done.stderr
    assert all(name in done.stderr.strip().splitlines()[-1] for name in ("qwen3", "deepseek_r1", "gpt_oss"))


def test_the_openai_tool_parser_needs_the_gpt_oss_reasoning_parser(folders):
    done = cli_in_process("serve", "--hf", folders / "harmony", "--tool-call-parser", "openai")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "add --reasoning-parser gpt_oss" in lines[0], done.stderr


def test_tokenize_takes_the_template_variables_and_history_reasoning_reaches_the_template(folders):
    """/tokenize renders as chat does (chat_template_kwargs too); an assistant's reasoning_content in the messages
    reaches the template as the message's field (Qwen3's template reads it)."""
    from torchtsp.serve.protocol import ChatCompletionRequest, TokenizeRequest, parse

    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.get('reasoning_content', '-') }}|{{ m['content'] }}\n"
                "{% endfor %}{{ 'thinking off' if enable_thinking is false else 'thinking on' }}")
    history = [*ASK, {"role": "assistant", "content": "it sat", "reasoning_content": "cats sit"}, *ASK]
    fields = {"messages": history, "chat_template_kwargs": {"enable_thinking": False}}
    with _service(folders / "think", None, template) as service:
        tokenized = asyncio.run(service.tokenize(parse(TokenizeRequest, json.dumps(fields).encode())))
        (choice,) = asyncio.run(service.chat_choices(parse(ChatCompletionRequest, json.dumps(fields).encode())))
        text = service.state.tokenizer.decode(tokenized["tokens"])
    assert tokenized["tokens"] == choice.prompt
    assert text == ("user:-|the cat sat on the mat\nassistant:cats sit|it sat\nuser:-|the cat sat on the mat\n"
                    "thinking off")
