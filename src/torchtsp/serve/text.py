"""Text on the HTTP side: incremental detokenization with stop strings (chat templates: template.py).

``TextStream`` turns a request's new ids into text deltas. The ids so far are decoded together (byte-level
tokens join into whole UTF-8 characters, words keep their spaces) and only the new part is released; an
unfinished character (U+FFFD at the end) and the last ``len(longest stop) - 1`` characters wait, since
they may still become a stop string. A stop string ends the text before it (it is not part of the
output), so streamed deltas always concatenate to the non-streamed text.
"""

from __future__ import annotations


def marker_tail(text: str, markers) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers`` (the longest proper
    prefix of one that ``text`` ends with; 0 when none): a stream holds them back until the next text tells
    whether the marker follows. A marker cut across two tokens is found whole that way."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


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
