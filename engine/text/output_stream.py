"""One request's output as its consumer sees it, assembled from the engine's incremental RequestOutputs.
Torch-free: the offline Engine and every HTTP route build their answers with it, so ids, text, stop strings,
logprobs and meta_info are put together in one place.
"""

from __future__ import annotations

from typing import Any, Sequence

from redraft.engine.text.denoise_events import commit_event, text_event
from redraft.engine.text.detokenizer import StreamingDetokenizer
from redraft.protocol.messages import AbortReq, RequestOutput


class OutputStream:
    def __init__(self, rid: str, tokenizer: Any, stop: Sequence[str] = (), keep_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.rid = rid
        self.detok = StreamingDetokenizer(tokenizer, stop, keep_stop, skip_special_tokens)
        self.ids: list[int] = []
        self.logprobs: list[float] | None = None
        self.top_logprobs: list[list[tuple[int, float]]] | None = None
        self.finished = False
        self.engine_finish: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        self._abort_sent = False
        self.index = 0  # the choice index forward events carry (n > 1)
        self.new_events: list[dict[str, Any]] = []  # stream_denoise: the events of the latest message
        self.denoise = False  # the request streams its forwards (set by whoever built this, from its params)

    def add(self, out: RequestOutput) -> str:
        """Take one message; return the text it made certain (never part of a stop string)."""
        self.new_events = []
        if self.finished:
            return ""
        new = out.new_ids if self.detok.stop_matched is None else []  # nothing after a stop string counts
        self.ids.extend(new)
        if out.new_logprobs is not None and new:
            self.logprobs = (self.logprobs or []) + out.new_logprobs[: len(new)]
            self.top_logprobs = (self.top_logprobs or []) + (out.new_top_logprobs or [[]] * len(new))[: len(new)]
        shown = new
        matched = (out.finish_reason or {}).get("matched") if out.finished else None
        if (isinstance(matched, int) and not isinstance(matched, bool) and not self.detok.keep_stop and new
                and new[-1] == matched):
            shown = new[:-1]  # as SGLang: the EOS / stop token that ended it stays in ids, not in the text
        delta = self.detok.feed(shown, out.finished)
        self.meta.update(out.meta)
        if out.denoise:
            self.new_events = [text_event(e, self.detok.tokenizer, len(self.ids), self.text, self.index)
                               for e in out.denoise]
        elif self.denoise and (new or out.finished):  # blocks that committed without a forward (at the end)
            self.new_events = [commit_event(self.index, out.meta.get("steps", 0), len(self.ids), self.text)]
        if out.finished:
            self.finished = True
            self.engine_finish = out.finish_reason
        return delta

    def stop_abort(self) -> AbortReq | None:
        """Once a stop string appeared and the engine request still runs: the message that ends it there
        (sent once)."""
        if self.detok.stop_matched is None or self.finished or self._abort_sent:
            return None
        self._abort_sent = True
        return AbortReq(self.rid, finish={"type": "stop", "matched": self.detok.stop_matched},
                        keep_tokens=len(self.ids))

    # ---- the answer -----------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All text decided so far (cut before a matched stop string)."""
        return self.detok.text

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        """The engine's finish, except that a stop string the text matched is the reason it stopped."""
        if self.detok.stop_matched is not None:
            return {"type": "stop", "matched": self.detok.stop_matched}
        return self.engine_finish

    def meta_info(self) -> dict[str, Any]:
        """SGLang-style meta_info: the engine's figures, the finish, and the logprobs in SGLang's shapes
        (output_token_logprobs [[logprob, id, None], ...], output_top_logprobs [[[logprob, id, None], ...], ...];
        the third element is SGLang's token text: /generate fills it when asked, return_text_in_logprobs)."""
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": self.finish_reason, **self.meta}
        meta["id"] = self.rid
        meta["finish_reason"] = self.finish_reason
        if self.finished:
            meta["completion_tokens"] = len(self.ids)
        if self.logprobs is not None:
            meta["output_token_logprobs"] = [[v, t, None] for v, t in zip(self.logprobs, self.ids)]
            meta["output_top_logprobs"] = [[[v, t, None] for t, v in alts] for alts in (self.top_logprobs or [])]
        return meta
