"""Incremental detokenization with stop strings.

Text is released only when it is whole (no dangling UTF-8 byte) and cannot be the start of a stop
string, so a streamed reply never shows text that the final one drops.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""          # decoded so far
        self.emitted = 0        # chars of self.text already released
        self._prefix = 0        # token offsets of the decode window
        self._read = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the newly releasable text ("" if none yet)."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
        new_text = self.tok.decode(self.ids[self._prefix:])
        # Advance only when the window ends on a whole character: it then always starts on a clean
        # UTF-8 boundary, so the streamed text equals decoding all tokens at once.
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def finish(self) -> str:
        """Release everything left (end of generation), a dangling invalid byte sequence included."""
        out = ""
        if not self.stopped:
            prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
            self.text += self.tok.decode(self.ids[self._prefix:])[len(prefix_text):]
            self._prefix = self._read = len(self.ids)
            out = self._release()
        out += self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
