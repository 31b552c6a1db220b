"""Conversations for fine-tuning: the records ``prepare-data --format chat`` reads, how it renders and masks
them, and the dataset it writes.

A record is ``{"messages": [{"role", "content", ...}, ...], "tools": [...]}`` (the OpenAI / Hugging Face form:
system, user, assistant and tool roles, assistant ``tool_calls``), one per ``.jsonl`` line or ``.parquet`` row.
Each conversation is rendered with the tokenizer's own chat template exactly as transformers'
``apply_chat_template(messages, tools=tools, tokenize=True)`` renders and tokenizes it, and its assistant text is
marked: by the template's ``{% generation %}`` blocks where it has them, else by rendering prefixes of the
conversation (the text before assistant message k is messages[:k] rendered with the generation prompt, the text
up to its end is messages[:k+1] rendered without it). A token is a target when any of its characters lies in
the assistant text (transformers' rule for ``return_assistant_tokens_mask``).

The dataset: ``PREFIX.bin/.idx`` hold the tokens, one sequence per conversation (nothing appended beyond what
the template writes); ``PREFIX-mask.bin/.idx`` hold a uint8 sequence of the same length per conversation, 1
where the token is a target (it is predicted from the tokens before it). ``open_chat_dataset`` reads both.
jinja2 is imported only to render, so the trainer reads a dataset without it. Conversation boundaries come from
the records, never from EOS ids: a chat template ends every turn with its end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .documents import JSONL_SUFFIXES, PARQUET_SUFFIXES, encodable, input_files, jsonl_records, parquet_rows
from .indexed import IndexedDataset
from .tokenizers import Tokenizer, read_chat_template

CHAT_FORMAT = "chat"  # the sidecar's "format" of a chat dataset
MASK_SUFFIX = "-mask"
MASK_DTYPE = np.dtype(np.uint8)
ROLES = ("system", "user", "assistant", "tool")
RECORD_FORM = 'a record is {"messages": [{"role": ..., "content": ...}, ...]}'
# Names a message's reasoning goes by; transformers fills the first two from whichever is given.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def mask_prefix(prefix: str | Path) -> str:
    """The prefix of a chat dataset's loss mask, beside its tokens: ``PREFIX-mask``."""
    return str(prefix) + MASK_SUFFIX


def is_chat_sidecar(sidecar: dict | None) -> bool:
    return bool(sidecar) and sidecar.get("format") == CHAT_FORMAT


def open_chat_dataset(prefix: str | Path, mask_at: str | None = None) -> tuple[IndexedDataset, IndexedDataset]:
    """(tokens, mask) of the chat dataset ``prefix``, checked against each other: mask sequence i is uint8, as
    long as token sequence i, and 1 where that token is an assistant target. ``mask_at``: the mask's prefix (the
    one the sidecar names, data/sources.py), default ``PREFIX-mask``. A mask that does not fit the tokens is a
    one-line error."""
    prefix = str(prefix)
    mask_at = mask_prefix(prefix) if mask_at is None else mask_at
    tokens = IndexedDataset(prefix)
    if not Path(mask_at + ".idx").is_file():
        raise FileNotFoundError(f"{mask_at}.idx does not exist: {prefix} is not a chat dataset (prepare it with "
                                f"torchtsp prepare-data --format chat)")
    mask = IndexedDataset(mask_at)
    if mask.dtype != MASK_DTYPE:
        raise ValueError(f"{mask.idx_path} holds {mask.dtype}, not a uint8 loss mask; prepare the dataset again")
    if mask.n_sequences != tokens.n_sequences:
        raise ValueError(f"{mask.idx_path} holds {mask.n_sequences} conversations but {tokens.idx_path} holds "
                         f"{tokens.n_sequences}; the mask belongs to another dataset: prepare it again")
    differ = np.flatnonzero(np.asarray(mask.lengths) != np.asarray(tokens.lengths))
    if len(differ):
        i = int(differ[0])
        raise ValueError(f"{mask.idx_path}: conversation {i} has {int(mask.lengths[i])} mask values but "
                         f"{int(tokens.lengths[i])} tokens; the mask belongs to another dataset: prepare it again")
    return tokens, mask


def _text_parts(content) -> bool:
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content)


def _checked_message(message, number: int, where: str) -> dict:
    """``message`` as transformers hands it to the template (keys holding null dropped, reasoning under its
    usual names), or a one-line error."""
    if not isinstance(message, dict):
        raise ValueError(f"{where}: message {number} is {type(message).__name__}, not an object; {RECORD_FORM}")
    message = {key: value for key, value in message.items() if value is not None}
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: message {number} has role {json.dumps(role)[:40]}; the roles are "
                         f"{', '.join(ROLES)}")
    content = message.get("content")
    tool_call_only = content is None and role == "assistant" and message.get("tool_calls")
    if not (isinstance(content, str) or _text_parts(content) or tool_call_only):
        got = "no content" if content is None else f"content of type {type(content).__name__}"
        raise ValueError(f"{where}: message {number} ({role}) has {got}; content is a string or a list of text "
                         f'parts [{{"type": "text", "text": ...}}]')
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def checked_conversation(record, where: str) -> tuple[list[dict], list | None]:
    """(messages, tools) of one record, or a one-line error naming ``where``."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        what = "is empty" if messages == [] else "is not a list" if messages is not None else "is missing"
        raise ValueError(f"{where}: the record's \"messages\" {what}; {RECORD_FORM}")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: \"tools\" is {type(tools).__name__}, not a list of tool schemas")
    return [_checked_message(m, i, where) for i, m in enumerate(messages, 1)], tools


def _from_json(value, where: str, column: str):
    """A parquet cell: a column of lists of structs arrives as lists of dicts, a string column holds JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError(f"{where}: column {column!r} holds a string that is not JSON") from None


def iter_conversations(paths) -> Iterator[tuple[str, list[dict], list | None]]:
    """(where, messages, tools) of every record of ``paths``, in order; ``where`` is ``FILE:LINE`` (1-based) or
    ``FILE: row N`` (0-based, as parquet counts)."""
    for path in input_files(paths):
        suffix = path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            for number, record in jsonl_records(path):
                yield (where := f"{path}:{number}"), *checked_conversation(record, where)
        elif suffix in PARQUET_SUFFIXES:
            for row, cells in parquet_rows(path, ["messages"], "a chat dataset's messages are its 'messages' column",
                                           optional=("tools",)):
                where = f"{path}: row {row}"
                record = {name: _from_json(value, where, name) for name, value in cells.items()}
                yield where, *checked_conversation(record, where)
        else:
            raise ValueError(f"{path}: --format chat reads conversations from .jsonl and .parquet files, not "
                             f"{suffix or 'extensionless'} files")


def target_mask(offsets, spans) -> np.ndarray:
    """1 for each token (given by its character span) that shares a character with one of ``spans``; a
    zero-width token counts when it lies strictly inside one (transformers' ``return_assistant_tokens_mask``)."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (starts < end) & (ends > start)
    return mask.astype(MASK_DTYPE)


class ChatEncoder:
    """Renders, tokenizes and masks conversations with a tokenizer folder's own chat template."""

    def __init__(self, tokenizer: Tokenizer):
        source = read_chat_template(tokenizer)
        if not source or not hasattr(tokenizer, "encode_with_offsets"):
            raise ValueError(f"{tokenizer.name} has no chat template (chat_template.jinja, or chat_template in "
                             f"tokenizer_config.json); --format chat renders each conversation with the model's own "
                             f"template: give the tokenizer folder of a chat model")
        try:
            import jinja2  # noqa: F401
        except ImportError:
            raise OSError("prepare-data --format chat renders chat templates with jinja2: "
                          "pip install 'torchtsp[serve]'") from None
        from ..serve.template import InlineChatTemplate

        self.tokenizer = tokenizer
        try:
            self.template = InlineChatTemplate(source, tokenizer.special_tokens)
        except ValueError as e:
            raise ValueError(f"{tokenizer.name}: {e}") from None

    def encode(self, messages: list[dict], tools: list | None, where: str) -> tuple[list[int], np.ndarray]:
        """(token ids, target mask) of one conversation; a template that fails or does not render the
        conversation's prefixes as prefixes of the whole is a one-line error naming ``where``."""
        try:
            if self.template.marks_generation:
                spans: list[tuple[int, int]] = []
                text = self.template.render(messages, tools, generation_spans=spans)
            else:
                text = self.template.render(messages, tools)
                spans = self._assistant_spans(messages, tools, text)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        ids, offsets = self.tokenizer.encode_with_offsets(encodable(text, where))
        return ids, target_mask(offsets, spans)

    def _assistant_spans(self, messages: list[dict], tools, whole: str) -> list[tuple[int, int]]:
        spans = []
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(self._prefix(messages[:k], tools, whole, True))
                end = len(self._prefix(messages[:k + 1], tools, whole, False))
                spans.append((start, max(start, end)))
        return spans

    def _prefix(self, messages: list[dict], tools, whole: str, add_generation_prompt: bool) -> str:
        text = self.template.render(messages, tools, add_generation_prompt)
        if not whole.startswith(text):
            prompt = " and the generation prompt" if add_generation_prompt else ""
            raise ValueError(f"the chat template renders messages 1-{len(messages)}{prompt} as text that does not "
                             f"begin the whole conversation's (it rewrites earlier turns), so the assistant's text "
                             f"cannot be found by prefixes; use a template that marks it with "
                             f"{{% generation %}}...{{% endgeneration %}}")
        return text
