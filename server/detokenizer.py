"""Incremental detokenization for streaming: text deltas that never break a UTF-8 character and never show
any part of a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from redraft.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what byte-level decoding yields for an incomplete multi-byte character


class IncrementalDetokenizer:
    """Feed the cumulative output ids after each committed block; get the new text to send.

    Until the request finishes, the text is held back where it is not yet certain: a trailing incomplete
    UTF-8 character (its remaining bytes come in the next block) and a tail that could be the beginning of
    a stop string. When it finishes, everything up to the matched stop string (excluded) is released.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.sent_chars = 0

    def text(self, ids: Sequence[int], finished: bool) -> str:
        """The text that is certain so far (all of it once finished)."""
        text = self.tokenizer.decode(list(ids))
        cut = min((text.find(s) for s in self.stop if s in text), default=-1)
        if cut >= 0:
            return text[:cut]
        if finished:
            return text
        while text.endswith(_REPLACEMENT):
            text = text[:-1]
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]

    def delta(self, ids: Sequence[int], finished: bool) -> str:
        safe = self.text(ids, finished)
        out = safe[self.sent_chars :] if len(safe) > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, len(safe))
        return out
