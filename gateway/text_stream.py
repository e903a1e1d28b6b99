"""Turning a stream of token ids into a stream of text: incremental detokenization and stop strings.

Detokenization decodes a short window of recent tokens and emits only what the window adds, and waits while
the window ends in a partial UTF-8 sequence (U+FFFD), so a multi-byte character is never split across
messages. Stop strings are searched in all text so far; the last len(longest stop) - 1 characters are held back
until they can no longer start a stop string, so a stop string is never streamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix = self._tok.decode(
            self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tok.decode(self.token_ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (a dangling partial character) once the stream ends."""
        prefix = self._tok.decode(
            self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tok.decode(self.token_ids[self._prefix_offset :], skip_special_tokens=self._skip)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return what is safe to stream now. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        self.text += delta
        start = max(0, self._emitted - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        else:
            end = max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        if self.stopped:
            self.text = self.text[:end]
        return out

    def flush(self) -> str:
        """The held-back tail, once generation ended for another reason."""
        if self.stopped:
            return ""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
