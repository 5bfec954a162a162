"""Watching the decoding (docs/denoise.md), as clients read it: the events of a request's forwards with their
text. The per-request recorder is scheduler/denoise_trace.py; which requests get a message for a forward that
committed nothing is EngineCore's (`_streaming_requests`); the HTTP side's stream is server/denoise.py. Torch-free.
"""

from __future__ import annotations


def commit_event(index: int, forwards: int, committed_ids: int, committed_text: str) -> dict:
    """What a message without a forward committed: blocks that ended without another forward (max_post_steps
    reached, or the request ended), so that the last event's committed text is always the answer's."""
    return {"event": "commit", "index": index, "forward": forwards, "committed_tokens": committed_ids,
            "committed_text": committed_text}


def text_event(raw: dict, tokenizer, committed_ids: int, committed_text: str, index: int = 0) -> dict:
    """A forward event as clients get it: the engine's raw event (ids, states, confidences, replaced ids) with
    each window token's text piece, the replaced tokens' pieces, and the committed prefix so far (its token count
    and its text, as the answer shows it: stop strings and the final EOS cut as in the non-streamed text)."""
    def piece(t: int | None) -> str | None:
        return None if t is None else tokenizer.decode([t], skip_special_tokens=False)

    return {"event": "forward", "index": index, "forward": raw["forward"],
            "window": {**{k: raw[k] for k in ("offset", "tokens", "states", "confidence", "replaced")},
                       "pieces": [piece(t) if s != "mask" else "" for t, s in zip(raw["tokens"], raw["states"])],
                       "replaced_pieces": [piece(t) for t in raw["replaced"]],
                       "block_size": raw["block_size"]},
            "prompt_tokens": raw["prompt_tokens"],
            "committed_tokens": committed_ids, "committed_text": committed_text}
