"""Reasoning on /v1/chat/completions: the model's reasoning apart from its answer, as vLLM's ``--reasoning-parser``.

A chat answer carries the reasoning in ``message.reasoning_content`` (``delta.reasoning_content`` when streamed)
and the rest in ``content``; what becomes tool calls is read from the content as before (tools.py). Each parser
reads the text as its model family writes it:

- ``qwen3``: ``<think>...</think>`` at the start of the output. A template that opens ``<think>`` in the prompt
  (Qwen3's thinking models) starts the output inside the reasoning; one that closes it there (``enable_thinking:
  false``) or an output that does not begin with ``<think>`` gives no reasoning.
- ``deepseek_r1``: the output is reasoning until ``</think>`` (DeepSeek-R1's template opens ``<think>`` in the
  prompt; an echoed ``<think>`` at the start is dropped), unless the prompt closed it already.
- ``gpt_oss``: OpenAI's harmony format. The output is messages ``<|start|>ROLE<|channel|>CHANNEL<|message|>BODY``
  ended by ``<|end|>``, ``<|return|>`` or ``<|call|>`` (the first one's ``<|start|>assistant`` is in the prompt).
  The ``analysis`` channel is reasoning; ``final`` and ``commentary`` without a recipient (a preamble) are content;
  a message with a recipient (``to=functions.NAME``) is a tool call, passed on in its harmony form for the
  ``openai`` tool-call parser (tools.py) to read. Bodies of one kind are joined by a newline (vLLM's
  ``parse_chat_output``). ``<|return|>`` and ``<|call|>`` end the answer.

Nothing is stripped: reasoning and content are the text between the markers as the model wrote it, so a stream's
deltas always add up to the whole answer's fields; a marker cut across two tokens (``</think>`` when it is no
single token) is held back until it is whole. A grammar (structured output, a forced tool call) constrains the
whole output from its first token, the reasoning included (vLLM starts it after the reasoning; here the engine has
one grammar per answer): a ``<think>`` left open by the prompt does not carry into a constrained output, whose
reasoning is only what it writes between the markers itself. With no parser the text is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .text import marker_tail

REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")

THINK, END_THINK = "<think>", "</think>"

# Harmony's special tokens (openai-harmony's grammar: a header, <|message|>, a body, one terminator).
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
HARMONY_TOKENS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
TERMINATORS = (END, RETURN, CALL)
HEADER_STARTS = (START, CHANNEL)  # a body also ends where a new header begins (no terminator: a cut message)
HARMONY_STOPS = (RETURN, CALL)  # end the answer: the final message is done, or a tool call waits for its result


@dataclass(frozen=True)
class HarmonyHeader:
    """A harmony message's header: ``ROLE [to=RECIPIENT]<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>]TYPE``."""

    role: str | None
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def kind(self) -> str:
        """What the body is to the answer: "call" (it has a recipient), "reasoning" (analysis) or "content"."""
        if self.recipient is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


def harmony_header(text: str) -> HarmonyHeader:
    """The header of the text before ``<|message|>`` (a leading ``<|start|>`` or not). The recipient may stand
    before the channel or after it, as harmony allows."""
    before, has_channel, after = text.removeprefix(START).partition(CHANNEL)
    role_words = before.split()
    channel_words = after.replace(CONSTRAIN, " ").split() if has_channel else []
    words = role_words + channel_words[1:]
    recipient = next((w[len("to="):] for w in words if w.startswith("to=")), None)
    role = next((w for w in role_words if not w.startswith("to=")), None)
    content_type = next((w for w in channel_words[1:] if not w.startswith("to=")), None)
    return HarmonyHeader(role, channel_words[0] if channel_words else None, recipient or None, content_type)


def harmony_messages(text: str) -> list[tuple[HarmonyHeader, str, str]] | None:
    """(header, body, terminator) of each message ``text`` is made of, one after another (whitespace between them);
    None when anything else is in it, or a message is not terminated."""
    out, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return out
        if not text.startswith(HEADER_STARTS, at):
            return None
        message = text.find(MESSAGE, at)
        if message < 0:
            return None
        body_at = message + len(MESSAGE)
        ends = [(text.find(t, body_at), t) for t in (*TERMINATORS, *HEADER_STARTS) if t in text[body_at:]]
        if not ends:
            return None
        end, terminator = min(ends)
        if terminator not in TERMINATORS:
            return None
        out.append((harmony_header(text[at:message]), text[body_at:end], terminator))
        at = end + len(terminator)


class ThinkSplit:
    """``<think>...</think>`` (qwen3, deepseek_r1) as the output streams. ``inside``: the prompt left the
    reasoning open, so the output starts in it; an echoed ``<think>`` at the very start is dropped either way."""

    def __init__(self, inside: bool):
        self.inside, self.state, self.held = inside, "start", ""

    def add(self, delta: str, done: bool = False) -> tuple[str, str]:
        """(reasoning, content) that can go out after ``delta``; ``done``: the output ended, nothing is held."""
        text, reasoning, content = self.held + delta, "", ""
        while True:
            if self.state == "start":
                if text.startswith(THINK):
                    text, self.state = text[len(THINK):], "reasoning"
                elif THINK.startswith(text) and not done:  # not yet told (the empty text too)
                    break
                else:
                    self.state = "reasoning" if self.inside else "content"
            elif self.state == "reasoning":
                at = text.find(END_THINK)
                if at >= 0:
                    reasoning += text[:at]
                    text, self.state = text[at + len(END_THINK):], "content"
                    continue
                keep = 0 if done else marker_tail(text, (END_THINK,))
                reasoning, text = reasoning + text[:len(text) - keep], text[len(text) - keep:]
                break
            else:
                content, text = content + text, ""
                break
        self.held = text
        return reasoning, content


class HarmonySplit:
    """Harmony messages as the output streams. The prompt's last message, when it is still open (the generation
    prompt ``<|start|>assistant``), is read first so that the output continues it. Reasoning and content bodies go
    out as they come (a newline before the body of each message after the first of its kind); a call message goes
    out whole, in its harmony form, into the content, once its terminator (or the output's end) is read. Text
    outside any message is content; a terminator there is dropped."""

    def __init__(self, prompt_tail: str = ""):
        self.state, self.held, self.header = "outside", "", ""
        self.kind, self.call, self.seen = "content", "", set()
        self.add(prompt_tail)  # the open message of the prompt, if any: read, not answered
        self.seen.clear()
        self.from_prompt = len(self.header)  # of the open header: the prompt's part, never answered as text

    def add(self, delta: str, done: bool = False) -> tuple[str, str]:
        text, out = self.held + delta, {"reasoning": "", "content": ""}
        while True:
            if self.state == "header":
                at = text.find(MESSAGE)
                if at < 0:
                    if done:  # a header cut short: the model's part of it is content, as it wrote it
                        out["content"] += self.header[self.from_prompt:] + text
                        self.header, text = "", ""
                    else:
                        keep = marker_tail(text, (MESSAGE,))
                        self.header, text = self.header + text[:len(text) - keep], text[len(text) - keep:]
                    break
                self.header += text[:at]
                text = text[at + len(MESSAGE):]
                self._begin(out)
                continue
            stops = TERMINATORS + HEADER_STARTS
            found = [(text.find(m), m) for m in stops if m in text]
            at, marker = min(found) if found else (-1, "")
            cut = at if at >= 0 else len(text) - (0 if done else marker_tail(text, stops))
            self._body(out, text[:cut])
            text = text[cut:]
            if at < 0:
                if done:
                    self._close(out, "")
                break
            if marker in TERMINATORS:  # outside any message one ends nothing and is no text (an EOS after a call)
                self._close(out, marker)
                text = text[len(marker):]
                self.state = "outside"
            else:  # a new header: the message before it (if any) ends unterminated
                self._close(out, "")
                self.header, text, self.state = marker, text[len(marker):], "header"
        self.held = text
        return out["reasoning"], out["content"]

    def _begin(self, out: dict) -> None:
        """``<|message|>`` read: the body's kind is the header's."""
        self.kind = harmony_header(self.header).kind
        self.state, self.from_prompt = "body", 0
        if self.kind == "call":
            self.call = self.header + MESSAGE
        elif self.kind in self.seen:
            out[self.kind] += "\n"
        self.seen.add(self.kind)

    def _body(self, out: dict, text: str) -> None:
        if self.state == "body" and self.kind == "call":
            self.call += text
        else:  # a body, or text outside any message: content
            out[self.kind if self.state == "body" else "content"] += text

    def _close(self, out: dict, terminator: str) -> None:
        if self.state == "body" and self.kind == "call":
            out["content"] += self.call + terminator
            self.call = ""
        self.header, self.from_prompt = "", 0


@dataclass(frozen=True)
class ReasoningParser:
    """The server's ``--reasoning-parser``, checked against its chat template and tokenizer at start-up."""

    name: str
    decode: Callable[[list[int]], str]  # a chat answer's text: the special tokens this parser reads kept in it
    kept_ids: frozenset = frozenset()  # those tokens: not skipped from the text, even when they end it
    stop_ids: tuple[int, ...] = ()  # tokens that end every chat answer (harmony's <|return|>, <|call|>)

    def start(self, prompt: str, constrained: bool = False) -> ReasoningStart:
        """How a chat answer to ``prompt`` (the rendered text) begins. ``constrained``: a grammar writes the output
        from its first token (structured output, a forced call), so a ``<think>`` the prompt left open does not carry
        into it: its reasoning is only what it writes between the markers itself."""
        if self.name == "gpt_oss":
            at = prompt.rfind(START)
            return ReasoningStart(self, prompt[at:] if at >= 0 else "")
        if constrained:
            return ReasoningStart(self, "")
        stripped = prompt.rstrip()
        if self.name == "qwen3":
            return ReasoningStart(self, THINK if stripped.endswith(THINK) else "")
        return ReasoningStart(self, "" if stripped.endswith(END_THINK) else THINK)


@dataclass(frozen=True)
class ReasoningStart:
    """One chat answer's parser and what its prompt left open (``primer``: the open ``<think>``, or harmony's
    open message)."""

    parser: ReasoningParser
    primer: str

    def output(self) -> ThinkSplit | HarmonySplit:
        if self.parser.name == "gpt_oss":
            return HarmonySplit(self.primer)
        return ThinkSplit(inside=self.primer == THINK)


def split_reasoning(start: ReasoningStart | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None when there is none, content) of a whole answer's text."""
    if start is None:
        return None, text
    reasoning, content = start.output().add(text, done=True)
    return reasoning or None, content


def _template_refusal(name: str, source: str | None) -> str | None:
    """Why ``name`` cannot read what this chat template makes the model write (None: it can)."""
    if source is None:
        return "the model has no chat template"
    if name in ("qwen3", "deepseek_r1") and THINK not in source and END_THINK not in source:
        return "its chat template never mentions <think> or </think>"
    if name == "gpt_oss" and not all(t in source for t in (START, CHANNEL, MESSAGE)):
        return "its chat template is not harmony's (no <|start|>, <|channel|> and <|message|>)"
    return None


def reasoning_parser(name: str | None, template_source: str | None, tokenizer) -> ReasoningParser | None:
    """The checked ``--reasoning-parser`` (None: none asked); ValueError in one line when the model's chat template
    or tokenizer does not write what it reads."""
    if name is None:
        return None
    if tokenizer is None:
        raise ValueError(f"--reasoning-parser {name} reads the model's text, but this model has no tokenizer; give "
                         f"--tokenizer DIR")
    why = _template_refusal(name, template_source)
    if why is not None:
        raise ValueError(f"--reasoning-parser {name} does not match this model: {why}; give the parser of the "
                         f"model's family ({', '.join(REASONING_PARSERS)}), --chat-template FILE with its template, "
                         f"or no --reasoning-parser")
    inner = getattr(tokenizer, "tokenizer", None)  # the tokenizers library's object (None: the byte tokenizer)
    if inner is None:
        if name == "gpt_oss":
            raise ValueError("--reasoning-parser gpt_oss needs the model's harmony tokenizer (tokenizer.json with "
                             "<|start|>, <|channel|>, <|message|>, <|end|>, <|return|> and <|call|> as tokens)")
        return ReasoningParser(name, tokenizer.decode)
    markers = HARMONY_TOKENS if name == "gpt_oss" else (THINK, END_THINK)
    ids = {m: inner.token_to_id(m) for m in markers}
    if name == "gpt_oss":
        missing = [m for m in HARMONY_TOKENS if m != CONSTRAIN and ids[m] is None]
        if missing:
            raise ValueError(f"--reasoning-parser gpt_oss: the tokenizer has no token {', '.join(missing)}; give the "
                             f"model's harmony tokenizer (--tokenizer DIR)")
    kept = frozenset(i for i in ids.values() if i is not None)
    special = {i for i, t in inner.get_added_tokens_decoder().items() if t.special} - kept

    def decode(token_ids: list[int]) -> str:
        return inner.decode([int(i) for i in token_ids if int(i) not in special], skip_special_tokens=False)

    stops = tuple(ids[m] for m in HARMONY_STOPS) if name == "gpt_oss" else ()
    return ReasoningParser(name, decode, kept, stops)
