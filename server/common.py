"""What every route module shares: the server state, the OpenAI error shape, SSE framing, and the way a
request is cancelled (and its engine request aborted) when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from redraft.engine.tokenizer import Tokenizer
from redraft.server.engine_client import EngineClient, EngineRejected
from redraft.server.metrics import ServerMetrics


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


class ServerState:
    """What the routes share: the engine client, the tokenizer, metrics and limits."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, model_name: str, model_path: str = "",
                 api_keys: tuple[str, ...] = (), max_body_bytes: int = 8 * 2**20,
                 domains: tuple[str, ...] | str | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_path
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(model_name, domains)  # domains: the `domain` label's values (else "other")
        self.metrics.attach(client)

    @property
    def model_names(self) -> list[str]:
        """The served name first; the checkpoint path is accepted too."""
        return [self.model_name] + ([self.model_path] if self.model_path and self.model_path != self.model_name else [])

    @property
    def max_model_len(self) -> int:
        return int(self.client.info.get("max_model_len", 0))

    @property
    def vocab_size(self) -> int:
        return int(self.client.info.get("vocab_size", self.tokenizer.vocab_size))


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineRejected):
        type_ = "server_error" if exc.status >= 500 else "invalid_request_error"
        return APIError(exc.status, exc.message, type_, code=exc.code)
    return APIError(503, "the engine is not available", "server_error", code="engine_unavailable")


async def run_until_disconnect(request: Request, coro) -> Any:
    """Await `coro`, cancelling it (which aborts the engine request) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise APIError(499, "client closed the request", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
