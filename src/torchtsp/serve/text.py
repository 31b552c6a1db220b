"""Text on the HTTP side: incremental detokenization with stop strings, and chat templates.

``TextStream`` turns a request's new ids into text deltas. The ids so far are decoded together (byte-level
tokens join into whole UTF-8 characters, words keep their spaces) and only the new part is released; an
unfinished character (U+FFFD at the end) and the last ``len(longest stop) - 1`` characters wait, since
they may still become a stop string. A stop string ends the text before it (it is not part of the
output), so streamed deltas always concatenate to the non-streamed text.

Chat templates are the Hugging Face convention: jinja2 source in ``tokenizer_config.json``'s
``chat_template``, rendered with ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``,
in jinja2's immutable sandbox (a template is data from the checkpoint: it may not touch Python objects).
"""

from __future__ import annotations

from .protocol import APIError


class TextStream:
    def __init__(self, decode, stop_strings: list[str], skip_ids: set[int]):
        self.decode, self.stops, self.skip = decode, stop_strings, skip_ids
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was found: the text is final

    def add(self, token: int) -> str:
        """The new text to release after ``token`` (maybe empty)."""
        if self.stopped or token in self.skip:
            return ""
        self.ids.append(token)
        full = self.decode(self.ids)
        for stop in self.stops:
            at = full.find(stop, max(0, len(self.text) - len(stop) + 1))
            if at >= 0:
                self.stopped = True
                full = full[:at]
        if not self.stopped:
            full = full.rstrip("\ufffd")
            full = full[: max(len(self.text), len(full) - self.hold)]
        return self._release(full)

    def finish(self) -> str:
        """The text still held back, at the end of the sequence."""
        if self.stopped:
            return ""
        return self._release(self.decode(self.ids))

    def _release(self, full: str) -> str:
        if not full.startswith(self.text):  # a decoder that rewrote earlier text: keep what was sent
            return ""
        delta, self.text = full[len(self.text):], full
        return delta


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None
