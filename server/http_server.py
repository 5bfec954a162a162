"""The HTTP process: FastAPI app with SGLang's native routes, talking to the engine process over ZMQ.

Routes: POST /generate (JSON or SSE, one chunk per committed block), POST /abort_request,
POST /flush_cache, GET /health (pings the engine), GET /live (does not), GET /server_info and /model_info (also
under their older get_ names, in SGLang's shapes), GET /metrics.
The event loop never waits on the model: requests go to the engine process and their progress comes back
through EngineClient.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from importlib.metadata import version as package_version
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.engine.output_stream import OutputStream
from redraft.protocol.sampling_params import SamplingParams, SamplingParamsError
from redraft.server.dials import DIALS, DialError, lift_dials
from redraft.server.common import (RETRY_AFTER, APIError, ChoiceStream, ServerState, check_logit_bias_keys,
                                   check_model, client_rid, engine_error, engine_rid, error_response, run_all,
                                   run_until_disconnect, sse, sse_error, start_streams)
from redraft.server.engine_client import EngineDead
from redraft.server.likelihood_api import all_prompt_logprobs
from redraft.server.openai_api import aborted_error
from redraft.server.metrics import CONTENT_TYPE_LATEST
from redraft.server.middleware import install_middleware
from redraft.server.openai_protocol import MAX_JSON_DEPTH, reject_lone_surrogates, too_deep
from redraft.server.responses_api import register_responses_routes
from redraft.server.structured import check_native_constraint

log = logging.getLogger("redraft.http")
SMG_NO_MODEL = "unknown"  # the `model` smg puts on a /generate that named none


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
    # SGLang's logprob fields: output logprobs (return_logprob), the prompt's from logprob_start_len (-1: none),
    # top_logprobs_num alternatives at each position; entries are [logprob, id, text], text None unless asked
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1)
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False  # the third entry of each logprob tuple: the token's text
    # what SGLang clients and sglang-router add (docs/scaling.md): `model` must name the served model; the
    # logging switches are no-ops; the features redraft lacks are accepted only when off
    model: str | None = None
    metadata: dict[str, str] | None = None  # may carry dials (server/dials.py)
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False

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


class NestingTooDeep(StarletteHTTPException):
    """A body nested deeper than MAX_JSON_DEPTH. An HTTPException, because FastAPI's body parsing passes those
    on (anything else becomes a bare 400); the app's HTTPException handler answers it in OpenAI's shape."""

    code = "nesting_too_deep"

    def __init__(self, path: list[str]):
        shown = ".".join(path[:8]) + (".…" if len(path) > 8 else "")
        super().__init__(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep (at {shown})")
        self.param = ".".join(path[:8]) or None


class DepthCheckedRequest(Request):
    """A request whose JSON body is refused, before any validation or recursion sees it, when it is nested too
    deep: one bounded, iterative scan at the edge (skipped when the body has too few brackets to be that deep)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            value = json.loads(body)
            if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
                path = too_deep(value) if len(body) < 2**20 else await asyncio.to_thread(too_deep, value)
                if path is not None:
                    raise NestingTooDeep(path)
            self._json = value
        return self._json


class DepthCheckedRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(DepthCheckedRequest(request.scope, request.receive))

        return route


def _log_refusal(request: Request, status: int, message: str, param: str | None, code: Any) -> None:
    """Every refusal in the log with the request id (the client's) and the reason."""
    rid = request.scope.get("state", {}).get("request_id", "-")
    level = logging.WARNING if status >= 500 else logging.INFO
    log.log(level, "request %s %s %s refused: %d %s (param %s): %s", rid, request.method, request.url.path, status,
            code, param, message)


def create_app(state: ServerState) -> FastAPI:
    from redraft.server.likelihood_api import register_likelihood_routes
    from redraft.server.openai_api import register_openai_routes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.client.connect()
        log.info("engine connected: %s", state.client.info.get("model_path"))
        yield
        log.info("shutting down the engine process")
        await state.client.close()
        state.close_grammar_sandbox()

    app = FastAPI(title="redraft", version="0.1.0", lifespan=lifespan)
    app.router.route_class = DepthCheckedRoute  # every route below parses its body through the depth check
    app.openapi = lambda: _openapi_with_400(app)
    app.state.redraft = state
    install_middleware(app, state)
    register_openai_routes(app, state)
    register_likelihood_routes(app, state)
    register_responses_routes(app, state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        _log_refusal(request, exc.status, exc.message, exc.param, exc.code)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", []) if x != "body"]
        param = ".".join(loc) or getattr(err.get("ctx", {}).get("error"), "param", None)
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unsupported field: {param}"
        elif err.get("type") == "json_invalid":  # its loc holds a character position, not a field
            msg, param = "the body is not valid JSON", None
        message = f"{msg}" + (f" ({param})" if param and "unsupported" not in msg else "")
        _log_refusal(request, 400, message, param, None)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        param, code = getattr(exc, "param", None), getattr(exc, "code", None)
        message = str(exc.detail)
        if exc.status_code == 404 and request.url.path.startswith("/v1/"):
            message = _unknown_v1_route(app, request.url.path)
        _log_refusal(request, exc.status_code, message, param, code)
        return error_response(exc.status_code, message, type_, param=param, code=code)

    @app.get("/version")
    async def version():
        return {"version": package_version("redraft")}

    @app.get("/health")
    async def health():
        if state.draining:  # load balancers: stop sending here
            return error_response(503, "the server is shutting down", "server_error", code="shutting_down")
        try:
            await state.client.ping(timeout=5.0)
        except (EngineDead, asyncio.TimeoutError):
            return error_response(503, "the engine is not responding", "server_error", code="engine_unavailable",
                                  headers=RETRY_AFTER)
        return Response(status_code=200)

    @app.get("/live")
    async def live():
        """Liveness: the HTTP process answers and its engine is running or being restarted (no engine round trip;
        /health checks the engine). 503 once the engine could not be restarted (the server is exiting)."""
        if state.client.failed:
            return error_response(503, "the engine could not be restarted", "server_error", code="engine_failed")
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        stats = {}
        with contextlib.suppress(EngineDead, asyncio.TimeoutError):
            stats = await state.client.ping(timeout=2.0)
        return {**state.client.info, "model_name": state.model_name, "engine_alive": state.client.alive, **stats}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        """SGLang's shape (sglang-router reads it when a worker registers)."""
        path = state.client.info.get("model_path") or state.model_path
        config: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError, TypeError):
            config = json.loads((Path(path) / "config.json").read_text())
        return {"model_path": path, "tokenizer_path": path, "served_model_name": state.model_name,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": config.get("model_type"), "architectures": config.get("architectures"),
                "max_model_len": state.max_model_len}

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
        """The admin ends a request by the id its client sees (`<X-Request-Id>-<choice>`, a /generate rid): every
        in-flight request of that id, under any API key; or by the engine's scoped id (`<scope>/<id>`, in the
        engine's log). Answers as before whether or not one was running (aborting is idempotent)."""
        targets = {r for r in state.client.in_flight_rids
                   if r == body.rid or (state.api_keys and client_rid(r) == body.rid)}
        for rid in targets or {body.rid}:
            await state.client.abort(rid)
        log.info("admin abort of %r: %d request(s) in flight", body.rid, len(targets))
        return {"rid": body.rid}

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        # smg fills in "unknown" when the client named no model: that is no model, not a wrong one
        check_model(state, None if body.model == SMG_NO_MODEL else body.model)
        for flag in ("return_hidden_states", "return_entropy", "return_bytes", "background"):
            if getattr(body, flag):
                raise APIError(400, f"{flag} is not supported (only false)", param=flag)
        prompts = await _native_prompts(state, body)
        raw_params = _with_carried_dials(body)
        check_logit_bias_keys(raw_params.get("logit_bias"), "sampling_params.logit_bias")
        if body.return_logprob:
            raw_params.update(logprobs=True, top_logprobs=body.top_logprobs_num)
        try:
            params = SamplingParams.from_dict(raw_params)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=f"sampling_params.{exc.param}" if exc.param else None) from exc
        await check_native_constraint(state, params, body.rid or request.state.request_id)
        input_lps = None
        if body.return_logprob and body.logprob_start_len >= 0:  # the prompt's staircase values
            if body.stream:
                raise APIError(400, "input logprobs (logprob_start_len >= 0) need stream=false", param="stream")
            input_lps = await all_prompt_logprobs(state, request, prompts, body.logprob_start_len,
                                                  body.top_logprobs_num, "logprob_start_len")
        if body.stream and len(prompts) != 1:
            raise APIError(400, "stream=true takes a single prompt", param="stream")
        base_rid = body.rid or uuid.uuid4().hex
        rids = [base_rid] if len(prompts) == 1 else [f"{base_rid}-{i}" for i in range(len(prompts))]
        rids = [engine_rid(request, r) for r in rids]  # scoped by the API key; meta_info.id stays the client's
        names = {"input_ids": "text" if body.text is not None else "input_ids",
                 **{k: f"sampling_params.{k}" for k in ("max_new_tokens", "rid")}}
        streams = await start_streams(state, rids, prompts, [params] * len(prompts), names,
                                      count_param="text" if body.text is not None else "input_ids")
        if body.stream:
            return StreamingResponse(_native_sse(streams[0]), media_type="text/event-stream")
        outs = await run_until_disconnect(request, run_all(streams))
        failed = next((o for o in outs if _error_finish(o)), None)
        if failed is not None:  # a failure inside the engine ended it: a 500 naming the reason, never a 200
            raise aborted_error(failed)
        results = [_native_payload(o, final=True) for o in outs]
        for res, ids, lps in zip(results, prompts, input_lps or []):
            res["meta_info"]["input_token_logprobs"] = [[e[0] if e else None, t, None] for t, e in zip(ids, lps)]
            res["meta_info"]["input_top_logprobs"] = [[[v, a, None] for a, v in e[1]] if e else None for e in lps]
        if body.return_text_in_logprobs:
            for res in results:
                _token_texts(res["meta_info"], state.tokenizer)
        batch = isinstance(body.text, list) or _is_batch_ids(body.input_ids)
        return results if batch else results[0]

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


def _unknown_v1_route(app: FastAPI, path: str) -> str:
    """A 404 under /v1 that says what is here (and why embeddings are not)."""
    routes = sorted({r.path for r in app.routes if getattr(r, "path", "").startswith("/v1/")})
    why = " (this server runs a generative model: it has no embeddings)" if path.startswith("/v1/embeddings") else ""
    return f"no route {path}{why}; the OpenAI routes here are {', '.join(routes)}"


def _with_carried_dials(body: GenerateBody) -> dict[str, Any]:
    """sampling_params with the dials that came in `sampling_params.custom_params` or `metadata` (smg keeps
    both; server/dials.py)."""
    raw = dict(body.sampling_params or {})
    custom = raw.pop("custom_params", None)
    if custom is not None and (not isinstance(custom, dict) or set(custom) - set(DIALS)):
        raise APIError(400, f"sampling_params.custom_params may hold only redraft's dials ({', '.join(DIALS)})",
                       param="sampling_params.custom_params")
    try:
        return lift_dials(raw, {"sampling_params.custom_params": custom, "metadata": body.metadata},
                          prefix="sampling_params.")
    except DialError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def _token_texts(meta: dict, tokenizer: Any) -> None:
    """return_text_in_logprobs: fill the third entry of every [logprob, id, text] with the token's text."""
    def fill(entry: list | None) -> None:
        if entry is not None:
            entry[2] = tokenizer.decode([entry[1]], skip_special_tokens=False)

    for key in ("input_token_logprobs", "output_token_logprobs"):
        for entry in meta.get(key) or []:
            fill(entry)
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for row in meta.get(key) or []:
            for entry in row or []:
                fill(entry)


def _is_batch_ids(ids: Any) -> bool:
    return bool(ids) and isinstance(ids[0], list)


async def _native_prompts(state: ServerState, body: GenerateBody) -> list[list[int]]:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text or input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if len(texts) > state.max_choices:
            raise APIError(400, f"at most {state.max_choices} prompts per request", param="text")
        prompts = [await state.encode(t, "text") for t in texts]
    else:
        prompts = body.input_ids if _is_batch_ids(body.input_ids) else [body.input_ids]  # type: ignore[list-item]
    if not prompts:  # an empty batch; an empty prompt is the engine's to refuse
        raise APIError(400, "the prompt is empty", param="text" if body.text is not None else "input_ids")
    return [list(p) for p in prompts]


def _error_finish(out: OutputStream) -> bool:
    return (out.finish_reason or {}).get("type") == "error"


def _native_payload(out: OutputStream, final: bool = False) -> dict:
    """SGLang's native shape: the text decided so far (all of it at the end), every output id, meta_info."""
    text = out.text if final else out.detok.released
    return {"text": text, "output_ids": list(out.ids), "meta_info": out.meta_info()}


async def _native_sse(stream: ChoiceStream) -> AsyncIterator[str]:
    """One SSE chunk per committed block (cumulative text and ids, as SGLang streams them), then [DONE]."""
    try:
        async for _ in stream.updates():
            yield sse(_native_payload(stream.out, final=stream.out.finished))
            if stream.out.finished and _error_finish(stream.out):  # its last chunk, then the error
                yield sse_error(aborted_error(stream.out))
                break
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
        yield sse_error(exc)
    finally:
        await stream.close()
    yield "data: [DONE]\n\n"
