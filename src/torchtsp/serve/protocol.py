"""The OpenAI-shaped request bodies, their checks, and the error body every failure returns.

Requests are parsed strictly (JSON types as the API documents them: a string is not a number) and unknown
fields are ignored, as OpenAI's API does; fields torchtsp does not implement yet are refused with a 400
naming the field rather than silently ignored. Every check that can refuse a request runs here, in the
HTTP process, so that a bad request never reaches the ranks' collectives: every value that crosses to the
ranks is bounded here (ids inside the vocabulary, top_k at most the vocabulary, seeds in int64, finite
temperatures), so that no request can break the step plan or a rank's sampling.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, ValidationError

from .plan import MAX_BIAS, MAX_LOGIT_BIAS, MAX_PENALTY, REPETITION_PENALTY_RANGE

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_IDS = 256  # every decoded token is compared with each, on every rank
MAX_N = 128  # choices per prompt (OpenAI's cap): each is a sequence of its own in the batch
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's limit; plan.MAX_LOGPROBS, which the ranks check again)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class _Sampled(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens even past EOS
    min_tokens: int = 0  # vLLM's extension: EOS and stop_token_ids cannot end the text before this many tokens
    response_format: dict | None = None
    guided_json: str | dict | None = None  # vLLM's extensions: structured output (structured.py)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # an EBNF grammar (xgrammar's dialect, as vLLM's xgrammar backend)
    repetition_penalty: float | None = None  # vLLM's extensions (transformers' formulas): penalties.py
    min_p: float | None = None
    # vLLM's sampling extensions torchtsp does not implement: declared so that a request setting one is refused,
    # not answered as if it had not (an ignored option changes the text silently).
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs name tokens "token_id:N"

    def refuse_unsupported(self) -> None:
        """400 naming the first field torchtsp does not implement (set to something other than its default)."""
        refused = [("n", not 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {_short(self.n)}"),
                   ("best_of", self.best_of not in (None, 1),
                    "best_of is not supported (n independent choices are: ask for n instead)"),
                   ("bad_words", bool(self.bad_words), "bad_words is not supported"),
                   ("allowed_token_ids", bool(self.allowed_token_ids), "allowed_token_ids is not supported "
                    "(guided_choice or guided_regex constrain the text)"),
                   ("use_beam_search", self.use_beam_search, "beam search is not supported"),
                   ("include_stop_str_in_output", self.include_stop_str_in_output,
                    "include_stop_str_in_output is not supported (stop strings are trimmed)")]
        for field, bad, message in refused:
            if bad:
                raise APIError(400, message, field, "unsupported_parameter")

    def sampling_values(self, vocab_size: int) -> tuple[float, int | None, float | None, int | None]:
        """(temperature, top_k, top_p, seed) checked; OpenAI's defaults (temperature 1, top_p 1)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if not math.isfinite(temperature) or not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2] (0 = greedy), got {temperature}", "temperature")
        top_p = self.top_p
        if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        top_k = self.top_k
        if top_k is not None and top_k == -1:
            top_k = None  # vLLM's spelling of "no top-k"
        if top_k is not None and not 1 <= top_k <= vocab_size:
            raise APIError(400, f"top_k must be -1 (off) or an integer in [1, {vocab_size}] (the vocabulary size), "
                                f"got {_short(top_k)}", "top_k")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise APIError(400, f"seed must be in [0, 2^63 - 1], got {_short(self.seed)}", "seed")
        return temperature, top_k, (None if top_p == 1 else top_p), self.seed

    def penalty_values(self, vocab_size: int) -> dict:
        """min_p, the penalties and logit_bias checked, as ``Sampling``'s keyword arguments (their defaults when
        not given): 400 naming the field for a value out of its range."""
        def number(field: str, default: float, lo: float, hi: float, low_open: bool = False) -> float:
            v = getattr(self, field)
            v = default if v is None else v
            if not (math.isfinite(v) and (lo < v if low_open else lo <= v) and v <= hi):
                raise APIError(400, f"{field} must be in {'(' if low_open else '['}{lo:g}, {hi:g}], got {v}", field)
            return float(v)

        return {"min_p": number("min_p", 0.0, 0.0, 1.0),
                "presence_penalty": number("presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                "frequency_penalty": number("frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                "repetition_penalty": number("repetition_penalty", 1.0, *REPETITION_PENALTY_RANGE),
                "logit_bias": self._logit_bias(vocab_size)}

    def _logit_bias(self, vocab_size: int) -> dict[int, float]:
        """OpenAI's map of token ids (JSON object keys: decimal strings) to a bias in [-100, 100] added to the
        token's logit."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS}", "logit_bias")
        out = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 20 else None
            if token is None or not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias: key {str(key)[:40]!r} is not a token id in the vocabulary [0, "
                                    f"{vocab_size})", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or not -MAX_BIAS <= value <= MAX_BIAS:
                raise APIError(400, f"logit_bias[{token}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got "
                                    f"{_short_value(value)}", "logit_bias")
            out[token] = float(value)
        return out

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        return stops

    def stop_ids(self, vocab_size: int) -> list[int]:
        ids = list(self.stop_token_ids or [])
        if len(ids) > MAX_STOP_IDS:
            raise APIError(400, f"at most {MAX_STOP_IDS} stop_token_ids, got {len(ids)}", "stop_token_ids")
        check_token_ids(ids, vocab_size, "stop_token_ids")
        return ids

    def _top_count(self, field: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{field} must be an integer in [0, {MAX_LOGPROBS}], got {_short_value(value)}", field)
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: continuous_usage_stats, which (as in vLLM) takes include_usage too."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per generated token, per prompt token) or None where not asked: ``logprobs=N``
        asks for both when ``echo`` is set (the prompt's first token has none)."""
        if self.top_logprobs is not None:
            raise APIError(400, "top_logprobs is a chat completions field; completions take logprobs=N (the number "
                                f"of top alternatives, 0..{MAX_LOGPROBS})", "top_logprobs")
        if self.logprobs is None:
            return None, None
        n = self._top_count("logprobs", self.logprobs)
        return n, (n if self.echo else None)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix", "unsupported_parameter")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, rendered back through the chat template
    tool_call_id: str | None = None  # a tool message's answer to that call
    reasoning_content: str | None = None  # an assistant's reasoning, as answered: templates that keep it read it


class ChatCompletionRequest(_Sampled):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call in the answer (null: the default, true)
    functions: list | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template (enable_thinking)
    reasoning_effort: str | None = None  # OpenAI's: reaches the chat template as reasoning_effort (GPT-OSS's reads it)

    def template_kwargs(self) -> dict:
        return template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.functions:  # OpenAI's deprecated form of tools
            raise APIError(400, "functions is not supported: give tools ([{\"type\": \"function\", \"function\": "
                                "{...}}]) and tool_choice", "functions", "unsupported_parameter")
        if not self.messages:
            raise APIError(400, "messages must be a non-empty list", "messages")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per generated token, None) when ``logprobs`` is true, else (None, None)."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise APIError(400, f"logprobs must be true or false in chat completions (top_logprobs gives the number "
                                f"of alternatives, 0..{MAX_LOGPROBS}), got {_short_value(self.logprobs)}", "logprobs")
        top = 0 if self.top_logprobs is None else self._top_count("top_logprobs", self.top_logprobs)
        if not self.logprobs:
            if top:
                raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
            return None, None
        return top, None

    def message_dicts(self) -> list[dict]:
        """Messages as the chat template sees them: content parts of type text joined into one string."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   f"messages.{i}.content")
                content = "".join(part["text"] for part in content)
            for j, call in enumerate(m.tool_calls or ()):
                _check_tool_call(call, f"messages[{i}].tool_calls[{j}]")
            extra = {k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id),
                                       ("reasoning_content", m.reasoning_content)) if v}
            out.append({"role": m.role, "content": content or "", **extra})
        return out


def _check_tool_call(call: dict, where: str) -> None:
    """An assistant's past call, as OpenAI's API takes it: ``{"function": {"name": str, "arguments": str}}``
    (arguments JSON text). Arguments given as an object are taken too, as vLLM and transformers' chat templates
    take them; anything else is a 400 naming the field."""
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise APIError(400, f"{where}.function must be an object {{\"name\": ..., \"arguments\": ...}}, got "
                            f"{_short_value(fn)}", f"{where}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{where}.function.name must be a non-empty string, got {_short_value(fn.get('name'))}",
                       f"{where}.function.name")
    if not isinstance(fn.get("arguments"), str | dict):
        raise APIError(400, f"{where}.function.arguments must be a string (the arguments as JSON text), got "
                            f"{_short_value(fn.get('arguments'))}", f"{where}.function.arguments")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list | None = None  # rendered with the messages, as a chat request with tools renders them
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # as a chat request's
    reasoning_effort: str | None = None

    def template_kwargs(self) -> dict:
        return template_kwargs(self.chat_template_kwargs, self.reasoning_effort)


# Variables a chat template gets from the request's own fields or from the tokenizer, never from
# chat_template_kwargs.
TEMPLATE_OWN_VARIABLES = ("messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token")
REASONING_EFFORTS = ("low", "medium", "high")


def template_kwargs(kwargs: dict | None, reasoning_effort: str | None) -> dict:
    """The chat template's variables beyond the messages and tools: ``chat_template_kwargs`` (vLLM's, e.g.
    ``{"enable_thinking": false}`` for Qwen3) and ``reasoning_effort``; a 400 naming the field otherwise."""
    kwargs = dict(kwargs or {})
    own = [k for k in kwargs if k in TEMPLATE_OWN_VARIABLES]
    if own:
        raise APIError(400, f"chat_template_kwargs may not set {own[0]!r}: the request's own fields and the tokenizer "
                            f"give the template {', '.join(TEMPLATE_OWN_VARIABLES)}", "chat_template_kwargs")
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                                f"{reasoning_effort[:40]!r}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", reasoning_effort)
    return kwargs


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    outside = next((t for t in ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise APIError(400, f"{param}: token id {_short(outside)} is outside the vocabulary [0, {vocab_size})", param)


def _short_value(value) -> str:
    return _short(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)[:40]


def _short(n: int) -> str:
    """An integer for a message: a 10,000-digit one is not echoed whole."""
    text = str(n)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"


# Pydantic's names for the members of a union in an error's location (``prompt.list[int].3``), not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def parse(model: type[BaseModel], body: bytes):
    """The request body as ``model``; 400 in OpenAI's shape for malformed JSON or a wrong type."""
    import json

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply (arrays or objects within each other)", None,
                       "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        if field == "prompt":
            raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                                "token-id lists", "prompt") from None
        where = ".".join(str(part) for part in first["loc"]
                         if not (isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)))
        message = "missing" if first["type"] == "missing" else first["msg"]
        raise APIError(400, f"{where or 'body'}: {message}", field) from None
