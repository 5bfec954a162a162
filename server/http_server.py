"""The HTTP process: FastAPI app with SGLang's native routes, talking to the engine process over ZMQ.

Routes: POST /generate (JSON or SSE, one chunk per committed block), POST /abort_request,
POST /flush_cache, GET /health (pings the engine), GET /live (does not), GET /get_server_info, GET /metrics.
The event loop never waits on the model: requests go to the engine process and their progress comes back
through EngineClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from contextlib import asynccontextmanager, aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.engine.sampling_params import SamplingParams, SamplingParamsError
from redraft.scheduler.messages import Accepted, RequestOutput
from redraft.server.common import APIError, ServerState, engine_error, error_response, run_until_disconnect, sse
from redraft.server.detokenizer import IncrementalDetokenizer
from redraft.server.engine_client import EngineDead, EngineRejected
from redraft.server.metrics import CONTENT_TYPE_LATEST
from redraft.server.middleware import install_middleware
from redraft.server.openai_protocol import reject_lone_surrogates

if TYPE_CHECKING:
    from redraft.server.openai_api import OpenAISettings

log = logging.getLogger("redraft.http")


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:  # lone surrogates would fail the tokenizer or the reply: a 500
        return reject_lone_surrogates(data)


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:  # lone surrogates would fail the tokenizer or the reply: a 500
        return reject_lone_surrogates(data)


def create_app(state: ServerState, openai_settings: OpenAISettings | None = None) -> FastAPI:
    from redraft.server.openai_api import OpenAISettings, register_openai_routes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.client.connect()
        log.info("engine connected: %s", state.client.info.get("model_path"))
        yield
        log.info("shutting down the engine process")
        await state.client.close()

    app = FastAPI(title="redraft", version="0.1.0", lifespan=lifespan)
    app.openapi = lambda: _openapi_with_400(app)
    app.state.redraft = state
    install_middleware(app, state)
    register_openai_routes(app, state, openai_settings or OpenAISettings())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request")
        if err.get("type") == "extra_forbidden":
            msg = f"unsupported field: {param}"
        elif err.get("type") == "json_invalid":  # its loc holds a character position, not a field
            msg, param = "the body is not valid JSON", None
        return error_response(400, f"{msg}" + (f" ({param})" if param and "unsupported" not in msg else ""), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type_, code=getattr(exc, "code", None))

    @app.get("/health")
    async def health():
        try:
            await state.client.ping(timeout=5.0)
        except (EngineDead, asyncio.TimeoutError):
            return error_response(503, "the engine is not responding", "server_error", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/live")
    async def live():
        """Liveness: the HTTP process answers (no engine round trip; /health checks the engine)."""
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        stats = {}
        with contextlib.suppress(EngineDead, asyncio.TimeoutError):
            stats = await state.client.ping(timeout=2.0)
        return {**state.client.info, "model_name": state.model_name, "engine_alive": state.client.alive, **stats}

    @app.get("/metrics")
    async def metrics():
        try:
            state.metrics.set_engine_stats(await state.client.ping(timeout=2.0), state.client.info)
        except (EngineDead, asyncio.TimeoutError):
            state.metrics.set_engine_down()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            result = await state.client.flush_cache()
        except (EngineDead, asyncio.TimeoutError) as exc:
            raise engine_error(exc) from exc
        if not result.ok:
            raise APIError(400, result.message, code="cache_in_use")
        return {"flushed": True}

    @app.post("/abort_request")
    async def abort_request(body: AbortBody):
        await state.client.abort(body.rid)
        return {"rid": body.rid}

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        prompts = _native_prompts(state, body)
        try:
            params = SamplingParams.from_dict(body.sampling_params or {})
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=f"sampling_params.{exc.param}" if exc.param else None) from exc
        for ids in prompts:
            _check_length(state, ids, params.max_new_tokens)
        base_rid = body.rid or uuid.uuid4().hex
        rids = [base_rid] if len(prompts) == 1 else [f"{base_rid}-{i}" for i in range(len(prompts))]
        if body.stream:
            if len(prompts) != 1:
                raise APIError(400, "stream=true takes a single prompt", param="stream")
            stream = _native_stream(state, rids[0], prompts[0], params)
            first = await _first_or_error(stream)
            return StreamingResponse(_prepend(first, stream), media_type="text/event-stream")
        results = await run_until_disconnect(
            request, asyncio.gather(*[_native_once(state, r, ids, params) for r, ids in zip(rids, prompts)])
        )
        return results[0] if len(prompts) == 1 and not isinstance(body.text, list) and not _is_batch_ids(body.input_ids) else results

    return app


def _openapi_with_400(app: FastAPI) -> dict:
    """FastAPI documents validation errors as 422; this server answers them with 400 (OpenAI's choice)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                responses = op.get("responses", {})
                if "422" in responses:
                    responses["400"] = {**responses.pop("422"), "description": "Invalid request"}
        app.openapi_schema = schema
    return app.openapi_schema


def _is_batch_ids(ids: Any) -> bool:
    return bool(ids) and isinstance(ids[0], list)


def _native_prompts(state: ServerState, body: GenerateBody) -> list[list[int]]:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text or input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        prompts = [state.tokenizer.encode(t) for t in texts]
    else:
        prompts = body.input_ids if _is_batch_ids(body.input_ids) else [body.input_ids]  # type: ignore[list-item]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "the prompt is empty", param="text" if body.text is not None else "input_ids")
    return [list(p) for p in prompts]


def _check_length(state: ServerState, ids: list[int], max_new_tokens: int) -> None:
    limit = state.max_model_len
    if limit and len(ids) + max_new_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_new_tokens} tokens ({len(ids)} in the prompt, {max_new_tokens} for the completion).",
            param="max_new_tokens", code="context_length_exceeded",
        )


def _native_payload(state: ServerState, detok: IncrementalDetokenizer, out: RequestOutput) -> dict:
    return {
        "text": detok.text(out.output_ids, out.finished),
        "output_ids": out.output_ids,
        "meta_info": {"id": out.rid, "finish_reason": out.finish_reason, **out.meta},
    }


async def _native_once(state: ServerState, rid: str, ids: list[int], params: SamplingParams) -> dict:
    detok = IncrementalDetokenizer(state.tokenizer, params.stop)
    last = None
    try:
        async with aclosing(state.client.generate(rid, ids, params)) as stream:
            async for out in stream:
                if isinstance(out, RequestOutput):
                    last = out
    except (EngineDead, EngineRejected) as exc:
        raise engine_error(exc) from exc
    assert last is not None and last.finished
    return _native_payload(state, detok, last)


async def _native_stream(state: ServerState, rid: str, ids: list[int], params: SamplingParams) -> AsyncIterator[str]:
    """SSE chunks; the first item is produced only once the engine accepted the request (or refused it)."""
    detok = IncrementalDetokenizer(state.tokenizer, params.stop)
    accepted = False
    async with aclosing(state.client.generate(rid, ids, params)) as stream:
        try:
            async for out in stream:
                if isinstance(out, Accepted):
                    accepted = True
                    yield ""  # the engine has it: errors before this point become HTTP errors
                else:
                    yield sse(_native_payload(state, detok, out))
        except (EngineDead, EngineRejected) as exc:
            if not accepted:
                raise
            err = engine_error(exc)
            yield sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
        yield "data: [DONE]\n\n"


async def _first_or_error(stream: AsyncIterator[str]) -> str:
    try:
        return await stream.__anext__()
    except (EngineDead, EngineRejected, StopAsyncIteration) as exc:
        await stream.aclose()
        raise engine_error(exc) from exc


async def _prepend(first: str, stream: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        if first:
            yield first
        async for chunk in stream:
            yield chunk
    finally:
        await stream.aclose()
