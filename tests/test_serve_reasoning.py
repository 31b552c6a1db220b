"""Reasoning over real HTTP with the official ``openai`` client, on 2-rank TSP servers serving a random tiny Hugging
Face Llama whose tokenizer has the format's markers as special tokens: ``--reasoning-parser qwen3`` under a
Qwen3-style template, and ``--reasoning-parser gpt_oss --tool-call-parser openai`` under a harmony template.

What the model writes is fixed with ``guided_choice`` at temperature 0, and ``logit_bias`` picks how it writes the
markers: as their special tokens (+100), or spelled out in ordinary tokens (-100 on the special ones: the marker is
then cut across several tokens, and streamed pieces). The answers' ``reasoning_content`` and ``content`` are the
texts written from the formats' specs, streamed and not, token for token (the logprobs' tokens); the prompt's
token count is transformers' ``apply_chat_template`` (with ``enable_thinking`` as the request's
``chat_template_kwargs``, and the tools); harmony's call becomes OpenAI ``tool_calls``."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.multirank

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")

from test_reasoning import HARMONY_TEMPLATE, HARMONY_TOKENS, QWEN3_TEMPLATE, THINK_TOKENS  # noqa: E402

ASK = [{"role": "user", "content": "the cat sat on the weather"}]
FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "the weather",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "day": {"type": "integer"}},
                   "required": ["unit", "day"]}}}


def _serve(tmp_path_factory, name, template, tokens, eos, *flags):
    from helpers import tiny_hf_llama
    from test_serve import KEY, Server

    folder = tmp_path_factory.mktemp(name) / "tiny-llama"
    tiny_hf_llama(folder, chat_template=template, max_position_embeddings=1024, added_tokens=tokens, eos_token=eos)
    server = Server(folder, tmp_path_factory.mktemp("logs") / f"{name}.log", "--api-key", KEY, "--max-model-len",
                    "1024", *flags)
    server.wait_ready()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return server, tokenizer, openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    server, tokenizer, client = _serve(tmp_path_factory, "qwen3", QWEN3_TEMPLATE, THINK_TOKENS, "<|im_end|>",
                                       "--reasoning-parser", "qwen3")
    try:
        yield tokenizer, client
    finally:
        server.close()


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    server, tokenizer, client = _serve(tmp_path_factory, "harmony", HARMONY_TEMPLATE, HARMONY_TOKENS, "<|return|>",
                                       "--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai")
    try:
        yield tokenizer, client
    finally:
        server.close()


def _bias(tokenizer, markers, spelled: bool) -> dict:
    return {str(tokenizer.convert_tokens_to_ids(m)): -100 if spelled else 100 for m in markers}


def _prompt_ids(tokenizer, **options) -> list[int]:
    out = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, **options)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _counts(usage) -> tuple[int, int, int]:
    """A usage's token counts (the second request finds the first's prompt in the prefix cache: cached_tokens)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def _both(client, **ask):
    """The non-streamed answer's choice and usage, and the streamed deltas, finish reason, usage and logprobs."""
    whole = client.chat.completions.create(model="tiny-llama", messages=ASK, temperature=0, max_tokens=300,
                                           logprobs=True, **ask)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=ASK, temperature=0, max_tokens=300,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True},
                                                 **ask))
    choices = [c.choices[0] for c in chunks if c.choices]
    streamed = {"reasoning": "".join(getattr(c.delta, "reasoning_content", None) or "" for c in choices),
                "content": "".join(c.delta.content or "" for c in choices),
                "tool_calls": [t for c in choices for t in c.delta.tool_calls or []],
                "finish": choices[-1].finish_reason,
                "tokens": [t.token for c in choices if c.logprobs for t in c.logprobs.content or []],
                "usage": chunks[-1].usage}
    return whole.choices[0], whole.usage, streamed


@pytest.mark.parametrize("spelled", [False, True])
def test_qwen3_reasoning_apart_streamed_and_not_token_for_token(qwen3, spelled):
    tokenizer, client = qwen3
    output = "<think>\nthe cat sat\n</think>\n\non the mat"
    choice, usage, streamed = _both(client, logit_bias=_bias(tokenizer, ("<think>", "</think>"), spelled),
                                    extra_body={"guided_choice": [output]})
    tokens = [t.token for t in choice.logprobs.content]
    # spelled: the marker's text is in the ordinary tokens (cut across them); special: the tokens' text skips it
    assert ("</think>" in "".join(tokens)) == spelled, tokens
    assert (choice.message.reasoning_content, choice.message.content) == ("\nthe cat sat\n", "\n\non the mat")
    assert (streamed["reasoning"], streamed["content"]) == ("\nthe cat sat\n", "\n\non the mat")
    assert streamed["tokens"] == tokens and choice.finish_reason == streamed["finish"] == "stop"
    assert usage.prompt_tokens == len(_prompt_ids(tokenizer))
    assert usage.completion_tokens == len(tokens) and _counts(streamed["usage"]) == _counts(usage)


def test_qwen3_enable_thinking_false_gives_no_reasoning(qwen3):
    tokenizer, client = qwen3
    choice, usage, streamed = _both(client, extra_body={"guided_choice": ["on the mat"],
                                                        "chat_template_kwargs": {"enable_thinking": False}})
    assert (choice.message.reasoning_content, choice.message.content) == (None, "on the mat")
    assert (streamed["reasoning"], streamed["content"]) == ("", "on the mat")
    assert usage.prompt_tokens == len(_prompt_ids(tokenizer, enable_thinking=False))


HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>")


@pytest.mark.parametrize("spelled", [False, True])
def test_gpt_oss_analysis_is_reasoning_and_final_is_content(harmony, spelled):
    tokenizer, client = harmony
    output = "<|channel|>analysis<|message|>the cat sat<|end|><|start|>assistant<|channel|>final<|message|>on the mat"
    choice, usage, streamed = _both(client, logit_bias=_bias(tokenizer, HARMONY_MARKERS, spelled),
                                    extra_body={"guided_choice": [output]})
    assert (choice.message.reasoning_content, choice.message.content) == ("the cat sat", "on the mat")
    assert (streamed["reasoning"], streamed["content"]) == ("the cat sat", "on the mat")
    assert streamed["tokens"] == [t.token for t in choice.logprobs.content] and streamed["finish"] == "stop"
    assert usage.prompt_tokens == len(_prompt_ids(tokenizer))
    assert _counts(streamed["usage"]) == _counts(usage)


@pytest.mark.parametrize("spelled", [False, True])
def test_gpt_oss_tool_call_in_harmony_becomes_openai_tool_calls(harmony, spelled):
    """<|call|> (its special token) ends the answer; spelled out, the grammar's end does, with the EOS."""
    tokenizer, client = harmony
    output = ("<|channel|>analysis<|message|>need the weather<|end|><|start|>assistant<|channel|>commentary "
              "to=functions.forecast <|constrain|>json<|message|>{\"unit\": \"c\", \"day\": 2}<|call|>")
    choice, usage, streamed = _both(client, tools=[FORECAST], tool_choice="auto",
                                    logit_bias=_bias(tokenizer, HARMONY_MARKERS, spelled),
                                    extra_body={"guided_choice": [output]})
    assert choice.finish_reason == streamed["finish"] == "tool_calls"
    assert choice.message.reasoning_content == streamed["reasoning"] == "need the weather"
    assert choice.message.content is None and streamed["content"] == ""
    (call,) = choice.message.tool_calls
    assert call.id and (call.function.name, json.loads(call.function.arguments)) == ("forecast", {"unit": "c",
                                                                                                   "day": 2})
    (delta,) = streamed["tool_calls"]
    assert (delta.function.name, json.loads(delta.function.arguments)) == ("forecast", {"unit": "c", "day": 2})
    want = tokenizer.apply_chat_template(ASK, tools=[FORECAST], add_generation_prompt=True, tokenize=True)
    assert usage.prompt_tokens == len(want["input_ids"] if hasattr(want, "keys") else want)
