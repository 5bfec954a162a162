"""Reading a streamed (server-sent events) answer the way redraft's native and OpenAI routes send it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


class StreamError(Exception):
    """The server answered with an error: a non-200 status, or an `error` event inside the stream."""


async def sse_events(client: Any, url: str, body: dict, headers: dict) -> AsyncIterator[dict]:
    """POST `body` to `url` with an httpx.AsyncClient and yield every `data:` event as a dict, until `[DONE]` or
    the end of the stream. Raises StreamError (a message fit for a benchmark report) and json/httpx errors."""
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")
            raise StreamError(f"HTTP {resp.status_code}: {text[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"stream error: {(event['error'] or {}).get('message')}")
            yield event
