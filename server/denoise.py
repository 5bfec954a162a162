"""The HTTP side of watching the decoding (docs/denoise.md): forward events in each route's stream, step maps in
each route's answer. The events come built (engine/text/denoise_events.py `text_event`, through OutputStream); this
module only places them: a named SSE event on /generate, an extra chunk whose `diffusion` field holds the event
on the OpenAI streams (the SDK keeps unknown fields as attributes; the chunk's delta is empty, so content is
unchanged for a client that ignores it)."""

from __future__ import annotations

import json
from typing import Any

from redraft.engine.text.output_stream import OutputStream


def denoise_sse(event: dict[str, Any]) -> str:
    """/generate's SSE event for one forward, named `denoise` (only a request that asked gets these)."""
    return f"event: denoise\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def chat_event_chunk(envelope: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion.chunk that carries one forward event: its choice's delta is empty."""
    choice = {"index": event["index"], "delta": {}, "logprobs": None, "finish_reason": None}
    return {**envelope, "choices": [choice], "diffusion": event}


def completion_event_chunk(envelope: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """A text_completion chunk that carries one forward event: its choice's text is empty."""
    choice = {"index": event["index"], "text": "", "logprobs": None, "finish_reason": None}
    return {**envelope, "choices": [choice], "diffusion": event}


def step_maps(outs: list[OutputStream]) -> list[dict[str, Any] | None] | None:
    """The OpenAI answer's diffusion.step_maps: one per choice (None where it was not asked for), or None."""
    maps = [o.meta.get("step_maps") for o in outs]
    return maps if any(m is not None for m in maps) else None
