"""What every route module builds its `APIRouter` from: the route class that refuses a body nested too deep
before anything parses it further, and the dependency that hands a route the app's `ServerState`.

    router = APIRouter(route_class=DepthCheckedRoute)

    @router.post("/v1/thing")
    async def thing(body: ThingBody, state: State): ...

A router's routes keep its route class when `create_app` includes them (server/http_server.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.server.common import ServerState
from redraft.server.openai_protocol import MAX_JSON_DEPTH, too_deep


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (set by create_app). Async: a plain function would run on a worker thread."""
    return request.app.state.redraft


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter of this type receives it


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
            checked = DepthCheckedRequest(request.scope, request.receive)
            await _json_when_untyped(checked)
            return await handler(checked)

        return route


_READ_AS_JSON = (b"application/x-www-form-urlencoded", b"text/plain")  # what curl -d and bare clients send


async def _json_when_untyped(request: DepthCheckedRequest) -> None:
    """A body sent as a form or as plain text (`curl -d '{...}'` without a JSON Content-Type) is read as JSON
    when it parses as JSON: its Content-Type is set to application/json before FastAPI looks at it. A body that
    does not parse is left as it came (and refused as before)."""
    headers = request.scope.get("headers", [])
    kind = next((v for k, v in headers if k == b"content-type"), None)
    if kind is None or kind.split(b";")[0].strip().lower() not in _READ_AS_JSON:
        return
    try:
        json.loads(await request.body())
    except (ValueError, RecursionError):
        return
    request.scope["headers"] = [(k, v) for k, v in headers if k != b"content-type"] + [
        (b"content-type", b"application/json")]
