"""The HTTP process's app: FastAPI wired to the routers of every route group, talking to the engine process over
ZMQ through the ServerState's EngineClient.

    native_api      /generate, /abort_request, /flush_cache, /health, /live, /server_info, /model_info, /metrics,
                    /version
    openai_api      /v1/models, /v1/chat/completions, /v1/completions
    likelihood_api  /score, /tokenize, /detokenize, /tokenizer_info
    responses_api   /v1/responses
    rl_api          the training control plane: weight versions and updates, pause/continue, /health_generate,
                    /v1/loads (docs/rl.md)

`create_app` only wires: the lifespan (connect to the engine, then close it), the middleware (request ids, API
keys, body size), the routers, the handlers that answer every error in OpenAI's shape, and the OpenAPI document.
The event loop never waits on the model: requests go to the engine process and their progress comes back
through EngineClient.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.protocol.errors import RequestError
from redraft.server import likelihood_api, native_api, openai_api, playground, responses_api, rl_api
from redraft.server.common import ServerState, error_response
from redraft.server.middleware import install_middleware
from redraft.server.openapi_doc import openapi_document
from redraft.server.routing import DepthCheckedRoute

log = logging.getLogger("redraft.http")
MAX_PARAM_CHARS = 200

# in this order in the OpenAPI document
ROUTERS: tuple[APIRouter, ...] = (openai_api.router, likelihood_api.router, responses_api.router, native_api.router,
                                  rl_api.router, playground.router)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="redraft", version="0.1.0", lifespan=lifespan)
    app.router.route_class = DepthCheckedRoute  # every route parses its body through the depth check
    app.openapi = lambda: openapi_document(app)  # every answer declared (server/openapi_doc.py)
    app.state.redraft = state  # what the routes' `State` dependency hands them (server/routing.py)
    install_middleware(app, state)
    for router in ROUTERS:
        app.include_router(router)
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: ServerState = app.state.redraft
    await state.client.connect()
    log.info("engine connected: %s", state.client.info.get("model_path"))
    yield
    log.info("shutting down the engine process")
    await state.client.close()
    state.close_grammar_sandbox()


# ---- every error in OpenAI's shape, logged with the request id ------------------------------------------------
async def request_error(request: Request, exc: RequestError):
    _log_refusal(request, exc)
    return error_response(exc)


async def validation_error(request: Request, exc: RequestValidationError):
    """FastAPI's 422 as OpenAI's 400, naming the first field it names."""
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in err.get("loc", []) if x != "body"]
    param = ".".join(loc) or getattr(err.get("ctx", {}).get("error"), "param", None)
    if param is not None and len(param) > MAX_PARAM_CHARS:  # a field name is the client's: never echo megabytes
        param = param[:MAX_PARAM_CHARS] + "…"
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = f"unsupported field: {param}"
    elif err.get("type") == "json_invalid":  # its loc holds a character position, not a field
        msg, param = "the body is not valid JSON", None
    message = f"{msg}" + (f" ({param})" if param and "unsupported" not in msg else "")
    return await request_error(request, RequestError(message, param=param))


async def http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's errors (404, 405, a body too large or nested too deep) in OpenAI's shape."""
    message = str(exc.detail)
    if exc.status_code == 404 and request.url.path.startswith("/v1/"):
        message = _unknown_v1_route(request.url.path)
    err = RequestError(message, status=exc.status_code, param=getattr(exc, "param", None),
                       code=getattr(exc, "code", None))
    return await request_error(request, err)


def _log_refusal(request: Request, err: RequestError) -> None:
    """Every refusal in the log with the request id (the client's) and the reason."""
    rid = request.scope.get("state", {}).get("request_id", "-")
    level = logging.WARNING if err.status >= 500 else logging.INFO
    log.log(level, "request %s %s %s refused: %d %s (param %s): %s", rid, request.method, request.url.path,
            err.status, err.code, err.param, err.message)


def _unknown_v1_route(path: str) -> str:
    """A 404 under /v1 that says what is here (and why embeddings are not)."""
    routes = sorted({r.path for router in ROUTERS for r in router.routes if getattr(r, "path", "").startswith("/v1/")})
    why = " (this server runs a generative model: it has no embeddings)" if path.startswith("/v1/embeddings") else ""
    return f"no route {path}{why}; the OpenAI routes here are {', '.join(routes)}"
