"""Streaming detokenization: one `StreamingDetokenizer` per output stream, fed the token ids of each committed
block. Torch-free: the HTTP process and the offline Engine both use it, and it is the only place where stop
strings are matched.

Each feed decodes only the new tokens (plus the previous block as context, so tokenizers whose decoding
depends on the neighbouring token stay exact): the cost of a block does not grow with the output's length.
Released text never breaks a UTF-8 character (a character whose bytes are split across blocks waits for the
next block) and never shows any part of a stop string (a tail that could begin one waits until decided).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"  # what byte-level decoding yields for an incomplete multi-byte character


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class StreamingDetokenizer:
    def __init__(self, tokenizer: _Decoder, stop: Sequence[str] = (), keep_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.keep_stop = keep_stop  # SGLang's no_stop_trim: the matched stop string stays in the text
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.stop_matched: str | None = None  # the stop string that ended the text, once one appeared
        self._confirmed = ""  # text of ids[:_read]: whole characters, final
        self._tail = ""  # text of ids[_read:] so far (an incomplete last character left out)
        self._prefix = 0  # decoding context starts here: the token before _read's block
        self._read = 0
        self._searched = 0  # no stop string starts before this character (minus the longest stop's length)
        self._sent = 0  # characters released by feed()

    @property
    def text(self) -> str:
        """The text decided so far (cut before the stop string once one matched)."""
        return self._confirmed + self._tail

    @property
    def released(self) -> str:
        """The text feed() has returned so far."""
        return self.text[: self._sent]

    def feed(self, new_ids: Sequence[int], finished: bool = False) -> str:
        """Add one committed block's ids (or several); return the newly certain text."""
        if self.stop_matched is None:
            self.ids.extend(new_ids)
            self._decode(finished)
            self._match_stop()
        text = self.text
        end = len(text) if finished or self.stop_matched is not None else len(text) - self._held_back(text)
        delta = text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    # ---- internals ------------------------------------------------------------------------------------
    def _decode(self, finished: bool) -> None:
        skip = self.skip_special_tokens
        base = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=skip)
        tail = full[len(base) :] if full.startswith(base) else full  # prefix-stable for every sane decoder
        if finished or not tail.endswith(_REPLACEMENT):
            self._confirmed += tail
            self._tail = ""
            self._prefix, self._read = self._read, len(self.ids)
        else:  # the last character's bytes continue in the next block: keep the ids, show what is whole
            self._tail = tail.rstrip(_REPLACEMENT)

    def _match_stop(self) -> None:
        if not self.stop:
            return
        text = self.text
        longest = max(len(s) for s in self.stop)
        start = max(0, self._searched - longest + 1)
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        self._searched = len(text)
        if hits:
            cut, matched = min(hits)
            self.stop_matched = matched
            cut += len(matched) if self.keep_stop else 0
            self._confirmed, self._tail = text[:cut], ""

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` that could be the beginning of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold
