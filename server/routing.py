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
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
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


class TooManyItems(StarletteHTTPException):
    """A body holding more JSON objects than --max-request-items: refused while it is parsed, before validation
    (whose cost, on the event loop, grows with them)."""

    code = "too_many_items"

    def __init__(self, limit: int):
        super().__init__(400, f"the request body holds more than {limit} objects (messages, tool calls, content "
                              f"parts, input items ...); the server allows at most {limit} per request "
                              "(--max-request-items)")
        self.param = None


OFF_LOOP_BYTES = 64 * 1024  # larger bodies are parsed on the parser thread: the event loop never waits on them
# One thread parses every large body, one after another: eight 6 MiB bodies at once then compete with the event
# loop for the GIL as one thread, not eight (the loop's wait for it grows with the threads that want it).
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redraft-json")


def parse_checked(body: bytes, max_items: int) -> Any:
    """The JSON value of `body`, refused (an HTTPException) when it holds more than `max_items` objects (counted
    as they are parsed: the parse stops at the first one too many) or is nested too deep. Small bodies, whose
    brackets already bound both, skip the counting and the scan."""
    brackets = body.count(b"[") + body.count(b"{")
    if brackets <= max_items:
        value = json.loads(body)
    else:
        seen = 0

        def count(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            nonlocal seen
            seen += 1
            if seen > max_items:
                raise TooManyItems(max_items)
            return dict(pairs)

        value = json.loads(body, object_pairs_hook=count)  # a Python call per object: the GIL is passed on too
    if brackets > MAX_JSON_DEPTH:
        path = too_deep(value)
        if path is not None:
            raise NestingTooDeep(path)
    return value


class DepthCheckedRequest(Request):
    """A request whose JSON body is parsed (on the parser thread when large) and refused, before any validation
    or recursion sees it, when it holds too many objects or is nested too deep. A large JSON body is validated
    against the route's body model on the parser thread too (`preload`): FastAPI then receives the model
    itself, which it takes as it is."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            max_items = self.app.state.redraft.max_request_items
            if len(body) > OFF_LOOP_BYTES:
                loop = asyncio.get_running_loop()
                self._json = await loop.run_in_executor(_PARSER, parse_checked, body, max_items)
            else:
                self._json = parse_checked(body, max_items)
        return self._json

    async def preload(self, body_field: Any) -> None:
        """A large JSON body for `body_field` (the route's FastAPI ModelField): parsed and validated on the
        parser thread; its errors raised as FastAPI would (RequestValidationError, answered as a 400)."""
        if body_field is None or not _is_json(self.headers.get("content-type")):
            return  # FastAPI refuses a body that is not JSON by itself
        body = await self.body()
        if len(body) <= OFF_LOOP_BYTES:
            return
        max_items = self.app.state.redraft.max_request_items

        def parse_and_validate() -> tuple[Any, list]:
            return body_field.validate(parse_checked(body, max_items), loc=("body",))

        try:
            value, errors = await asyncio.get_running_loop().run_in_executor(_PARSER, parse_and_validate)
        except (ValueError, RecursionError):
            return  # not JSON (or too deep for Python's parser): FastAPI's own read refuses it as a 400
        if errors:
            raise RequestValidationError(errors, body=None)
        self._json = value


def _is_json(content_type: str | None) -> bool:
    """FastAPI's test: application/json, or any */*+json."""
    if not content_type:
        return False
    subtype = content_type.split(";", 1)[0].strip().lower().partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


class DepthCheckedRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()
        body_field = self.body_field

        async def route(request: Request) -> Response:
            checked = DepthCheckedRequest(request.scope, request.receive)
            await _json_when_untyped(checked)
            await checked.preload(body_field)
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
    body = await request.body()
    try:
        if len(body) > OFF_LOOP_BYTES:  # not on the event loop (too many objects: refused here, as a 400)
            await asyncio.get_running_loop().run_in_executor(_PARSER, parse_checked, body,
                                                             request.app.state.redraft.max_request_items)
        else:
            json.loads(body)
    except (ValueError, RecursionError):
        return
    request.scope["headers"] = [(k, v) for k, v in headers if k != b"content-type"] + [
        (b"content-type", b"application/json")]
