"""A request's checks and its choices: the parsed request (completions or chat) against the model (vocabulary,
context length, the KV cache, the grammar and the tools) turned into ``Choice``s, the engine requests of its prompts
and samples. Work that grows with the request (tokenizing a long prompt, rendering a chat template, compiling a
grammar) runs off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from dataclasses import dataclass

from .client import EngineClient
from .metrics import Metrics
from .plan import Sampling
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, _short, check_token_ids
from .reasoning import ReasoningParser, ReasoningStart
from .structured import GrammarCheck, requested_grammar
from .template import ChatTemplate
from .tools import ToolChoice, template_messages, tool_choice

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (vLLM's too): not the whole context

# A non-streamed answer is held whole, shaped and encoded at once (off the event loop, but in memory): a request
# whose answer could exceed MAX_ANSWER_BYTES is refused before it runs (400 naming n, logprobs or max_tokens), as
# estimated for every choice running to max_tokens with tokens of about 4 characters: each token's text
# (JSON-escaped), and each logprob entry (the chosen token and each alternative) as completions and chat shape it.
# A streamed answer is sent chunk by chunk and is not bounded.
MAX_ANSWER_BYTES = 64 << 20


TEXT_BYTES_PER_TOKEN = 16


LOGPROB_ENTRY_BYTES = {False: 32, True: 80}  # completions ("text": -1.234 in a dict), chat ({token, logprob, bytes})


def _shown_tokens(c: Choice) -> int:
    """Tokens whose text a choice's answer may hold: its max_tokens, and its prompt's when echoed."""
    return c.max_tokens + (len(c.prompt) if c.echo_text else 0)


def _logprob_entries(c: Choice) -> int:
    """Logprob entries (a token's own and its alternatives') a choice's answer may hold."""
    if c.logprobs is None:
        return 0
    prompt = 0 if c.prompt_logprobs is None else len(c.prompt) * (1 + c.prompt_logprobs)
    return c.max_tokens * (1 + c.logprobs) + prompt


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    template: ChatTemplate | None
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    api_key: str | None
    max_queue: int
    metrics: Metrics
    tool_call_parser: str | None = None  # --tool-call-parser: how tool_choice auto reads the model's calls
    reasoning: ReasoningParser | None = None  # --reasoning-parser: the reasoning apart from the content
    max_answer_bytes: int = MAX_ANSWER_BYTES  # a non-streamed answer's estimated size at most


@dataclass
class Choice:
    """One prompt's checked request to the engine."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_strings: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool = False
    echo_text: str = ""
    min_tokens: int = 0
    grammar: tuple[str, str] | None = None  # (kind, source): structured output
    grammar_field: str | None = None  # the request field that asked for it (named by a refusal)
    tools: ToolChoice | None = None  # chat with tools: how the output becomes tool calls
    reasoning: ReasoningStart | None = None  # chat under --reasoning-parser: how its reasoning is told apart
    sample: int = 0  # which of its prompt's n choices
    logprobs: int | None = None  # top alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None = None  # per prompt token (echo with logprobs)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)


def _max_text_chars(tokenizer, max_model_len: int) -> int:
    """Characters past which a text cannot fit the context, so tokenizing it is wasted work (a 10 MB prompt
    takes minutes): no token covers more characters than the longest entry of the vocabulary; twice that
    leaves room for normalizers that drop characters."""
    vocab = getattr(getattr(tokenizer, "tokenizer", None), "get_vocab", None)
    longest = max(map(len, vocab(with_added_tokens=True)), default=1) if vocab is not None else 4
    return 2 * max_model_len * max(longest, 1) + 1024


def _cache_exceeded(cache: int, n: int, max_tokens: int, param: str) -> APIError:
    """A sequence whose prompt and new tokens (all but the last, which is never cached) outgrow the whole KV
    cache could never run, however long it waited."""
    if n > cache:
        return APIError(400, f"the prompt has {n} tokens, more than the server's whole KV cache holds ({cache} "
                             f"tokens); shorten it, or restart the server with a larger --kv-cache-mb", param,
                        "context_length_exceeded")
    need = n + max_tokens - 1
    return APIError(400, f"this request needs {need} tokens of KV cache (a prompt of {n} tokens and max_tokens "
                         f"{max_tokens}), more than the server's whole KV cache holds ({cache} tokens); lower "
                         f"max_tokens to at most {cache + 1 - n}, or restart the server with a larger --kv-cache-mb",
                    "max_tokens", "context_length_exceeded")


def _ids_text(ids) -> str:
    return " ".join(map(str, ids))



class ChoiceMaker:
    """The checks of a request and the choices it makes, against the server's state."""

    def __init__(self, state: ServerState):
        self.state, self.client = state, state.client
        self.max_text_chars = _max_text_chars(state.tokenizer, state.max_model_len)
        self.grammar_check = GrammarCheck(state.tokenizer, state.vocab_size, state.eos_token_id)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.state.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.state.model_name!r}",
                           "model", "model_not_found")

    def check_engine(self) -> None:
        client = self.client
        if client.state == "loading":
            raise APIError(503, "the model is still loading; retry in a moment", None, "engine_loading")
        if client.state != "ready":
            raise APIError(503, f"the engine is not available: {client.error or client.state}", None,
                           "engine_unavailable")

    def check_ids(self, ids: list[int], param: str) -> None:
        check_token_ids(ids, self.state.vocab_size, param)

    def _check_text_chars(self, chars: int, param: str) -> None:
        """400 for ``param``'s text of ``chars`` characters, more than the context can hold whatever it says."""
        if chars > self.max_text_chars:
            raise APIError(400, f"{param} has {chars} characters: more than this model's maximum context length "
                                f"({self.state.max_model_len} tokens) can hold", param, "context_length_exceeded")

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """On a worker thread (``encode_batch``: the tokenizers library lets go of the GIL there, not in
        ``encode``), after refusing a text too long to fit the context whatever it holds."""
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as token ids", "prompt")
        self._check_text_chars(len(text), param)
        return (await asyncio.to_thread(tokenizer.encode_batch, [text]))[0]

    async def decode(self, ids: list[int]) -> str:
        if self.state.tokenizer is None:
            return _ids_text(ids)
        return await asyncio.to_thread(self.state.tokenizer.decode, ids)

    def choice(self, body, prompt: list[int], max_tokens: int | None, param: str = "prompt",
               default_max_tokens: int | None = None) -> Choice:
        """One prompt's checked request. Without ``max_tokens``: ``default_max_tokens`` (completions: OpenAI's 16)
        or, for chat, the rest of the context (as vLLM), never past the context. ``max_tokens`` 0 only with echo:
        the prompt (and its logprobs) alone."""
        if not prompt:
            raise APIError(400, f"{param} is empty; give at least one token", param)
        limit, n = self.state.max_model_len, len(prompt)
        if n >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                f"tokens, which leaves no room for a new one", param, "context_length_exceeded")
        self.check_ids(prompt, param)
        cache = self.kv_capacity()
        if max_tokens is None:  # the room left in the context, and in the whole KV cache (prompt + max_tokens - 1)
            room = limit - n if cache is None else max(1, min(limit - n, cache + 1 - n))
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        echo = getattr(body, "echo", False)
        if max_tokens < (0 if echo else 1):
            raise APIError(400, f"max_tokens must be >= {0 if echo else '1 (0 only with echo)'}, got "
                                f"{max_tokens}", "max_tokens")
        if n + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                f"tokens and max_tokens asks for {max_tokens} ({n + max_tokens} in all)",
                           "max_tokens", "context_length_exceeded")
        if cache is not None and n + max(max_tokens, 1) - 1 > cache:
            raise _cache_exceeded(cache, n, max_tokens, param)
        temperature, top_k, top_p, seed = body.sampling_values(self.state.vocab_size)
        stop_ids = body.stop_ids(self.state.vocab_size)
        seed = secrets.randbelow(2**63) if seed is None else seed
        if not 0 <= body.min_tokens <= max_tokens:
            raise APIError(400, f"min_tokens must be in [0, max_tokens = {max_tokens}], got {_short(body.min_tokens)}",
                           "min_tokens")
        logprobs, prompt_logprobs = body.logprob_counts()
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # the engine runs a prefill for nothing else; its logprobs are not shown
        sampling = Sampling(temperature, top_k, top_p, seed, **body.penalty_values(self.state.vocab_size))
        return Choice(prompt, max_tokens, sampling, body.stop_strings(), stop_ids,
                      body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      tokens_as_ids=body.return_tokens_as_token_ids)

    def kv_capacity(self) -> int | None:
        """Tokens the engine's whole KV cache holds, once its ready message has said (None before)."""
        return getattr(self.client, "info", {}).get("kv_capacity_tokens")

    async def grammar(self, body) -> tuple[str, str, str] | None:
        """(kind, source, field) of the structured output a request asks for, compiled for the served vocabulary
        off the event loop (None: plain text)."""
        asked = requested_grammar(body)
        if asked is None:
            return None
        if self.state.tokenizer is None:
            raise APIError(400, "structured output needs the model's tokenizer; this model has none", asked[2])
        await self.grammar_check.check(*asked)
        return asked

    def samples(self, body, choices: list[Choice], grammar: tuple[str, str, str] | None) -> list[Choice]:
        """Each prompt's ``body.n`` choices, in index order (prompt-major). Choice i of a prompt samples with seed
        (seed + i) mod 2^63, where seed is the request's, or a random one per prompt: n = 1 is the request itself,
        and choice i is what a single request with seed + i gives."""
        if len(choices) * body.n > self.state.max_queue:
            raise APIError(400, f"n ({body.n}) times the prompts ({len(choices)}) is more than the server's queue "
                                f"ever holds ({self.state.max_queue}, --max-queue); ask for fewer", "n")
        made = [dataclasses.replace(c, sampling=dataclasses.replace(c.sampling, seed=(c.sampling.seed + i) % 2**63),
                                    grammar=grammar and grammar[:2], grammar_field=grammar and grammar[2], sample=i)
                for c in choices for i in range(body.n)]
        if not body.stream:
            self.check_answer_size(made, isinstance(body, ChatCompletionRequest), body.n)
        return made

    def check_answer_size(self, choices: list[Choice], chat: bool, n: int) -> None:
        """400 when the whole answer could exceed ``max_answer_bytes`` (see MAX_ANSWER_BYTES), naming what to lower:
        logprobs when the answer fits without them, else n when one choice per prompt fits, else max_tokens."""
        limit = self.state.max_answer_bytes
        text = sum(_shown_tokens(c) for c in choices) * TEXT_BYTES_PER_TOKEN
        entries = sum(_logprob_entries(c) for c in choices) * LOGPROB_ENTRY_BYTES[chat]
        if text + entries <= limit:
            return
        if entries and text <= limit:
            param = "top_logprobs" if chat and any(c.logprobs for c in choices) else "logprobs"
        else:
            param = "n" if n > 1 and (text + entries) / n <= limit else "max_tokens"
        top = max((c.logprobs for c in choices if c.logprobs is not None), default=None)
        with_logprobs = "" if top is None else f" with logprobs and {top} alternatives per token"
        raise APIError(400, f"this answer could reach {(text + entries) / 2**20:.0f} MiB ({len(choices)} choices of up "
                            f"to {max(c.max_tokens for c in choices)} tokens{with_logprobs}), more than the "
                            f"{limit / 2**20:g} MiB a non-streamed answer may have; lower {param}, or stream it "
                            f"(\"stream\": true)", param, "answer_too_large")

    async def completion_choices(self, body: CompletionRequest) -> list[Choice]:
        body.refuse_unsupported()
        self.check_model(body.model)
        grammar = await self.grammar(body)
        p = body.prompt
        if isinstance(p, str):
            prompts = [await self.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            self._check_prompt_count(len(p))
            prompts = [await self.encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            self._check_prompt_count(len(p))
            prompts = list(p)
        else:
            prompts = [list(p)]
        choices = [self.choice(body, ids, body.max_tokens, "prompt", COMPLETION_DEFAULT_MAX_TOKENS) for ids in prompts]
        if body.echo:
            for c in choices:
                c.echo_text = await self.decode(c.prompt)
        return self.samples(body, choices, grammar)

    def _check_prompt_count(self, n: int) -> None:
        if n > self.state.max_queue:  # more than could ever wait (a 429 would be retried forever): 400
            raise APIError(400, f"this request has {n} prompts, more than the server's queue can ever hold (at most "
                                f"{self.state.max_queue}, --max-queue); send them in smaller requests", "prompt",
                           "too_many_prompts")

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None,
                          variables: dict | None = None) -> list[int]:
        text = await self.render_chat_text(messages, add_generation_prompt, tools, variables)
        return await self.encode(text, "messages")

    async def render_chat_text(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None,
                               variables: dict | None = None) -> str:
        """The chat template's text of the messages (``variables``: the request's chat_template_kwargs)."""
        if self.state.template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions, or start the server with "
                                "--chat-template FILE", "messages", "no_chat_template")
        tool_chars = [len(json.dumps(t)) for t in tools or ()]
        for i, n in enumerate(tool_chars):  # the one tool too long to fit is named, not the messages
            self._check_text_chars(n, f"tools[{i}]")
        self._check_text_chars(sum(tool_chars), "tools")
        self._check_text_chars(len(json.dumps(variables or {})), "chat_template_kwargs")
        self._check_text_chars(len(json.dumps(messages)) + sum(tool_chars), "messages")
        return await self.state.template.render_async(template_messages(messages), add_generation_prompt, tools,
                                                      variables)

    async def tool_grammar(self, tools: ToolChoice) -> tuple[str, str, str]:
        """The grammar that forces a call (tool_choice required or named), each tool's schema compiled first so
        that one xgrammar cannot compile is a 400 naming the tool."""
        positions = {t["function"]["name"]: i for i, t in enumerate(tools.tools)}
        for name, schema in tools.schemas():
            where = f"tools[{positions[name]}]"
            try:
                await self.grammar_check.check("json_schema", schema, where)
            except APIError as e:
                raise APIError(400, f"{where}: the parameters of {name!r} cannot constrain the output: "
                                    f"{e.message.removeprefix(f'{where}: ')}", where) from None
        kind, source = tools.grammar()
        await self.grammar_check.check(kind, source, "tool_choice")
        return kind, source, "tool_choice"

    async def chat_choices(self, body: ChatCompletionRequest) -> list[Choice]:
        body.refuse_unsupported()
        self.check_model(body.model)
        tools = tool_choice(body.tools, body.tool_choice, self.state.tool_call_parser,
                            parallel=body.parallel_tool_calls is not False)
        grammar = await self.grammar(body)
        if tools is not None and tools.grammar() is not None:
            if grammar is not None:
                raise APIError(400, f"tool_choice {tools.mode} constrains the output to a call already; drop "
                                    f"{grammar[2]}", grammar[2])
            grammar = await self.tool_grammar(tools)
        text = await self.render_chat_text(body.message_dicts(), body.add_generation_prompt,
                                           list(tools.tools) if tools is not None else None, body.template_kwargs())
        ids = await self.encode(text, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        choice = dataclasses.replace(self.choice(body, ids, max_tokens, "messages"), tools=tools)
        parser = self.state.reasoning
        if parser is not None:
            choice.stop_token_ids += [t for t in parser.stop_ids if t not in choice.stop_token_ids]
            choice.reasoning = parser.start(text, constrained=grammar is not None)
        return self.samples(body, [choice], grammar)
