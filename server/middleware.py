"""Pure-ASGI middleware: request ids, API keys, body-size limit.

Written as raw ASGI (not BaseHTTPMiddleware) so that streaming responses and client-disconnect detection
pass through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.server.common import ServerState, key_scope

log = logging.getLogger("redraft.http")

OPEN_PATHS = {"/health", "/live", "/metrics"}  # liveness probes and Prometheus need no key
ADMIN_PATHS = {"/abort_request", "/flush_cache"}  # they change what other clients get: the admin key only
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


async def _send_error(send, status: int, message: str, type_: str, code: str | None, headers=(),
                      param: str | None = None) -> None:
    rid = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), "-")
    log.info("request %s refused: %d %s: %s", rid, status, code, message)
    body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant time in the key's content, and every configured key is always compared."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


class RedraftMiddleware:
    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        echo = [(b"x-request-id", rid.encode())]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *echo]}
            await send(message)

        if sum(k.lower() == b"authorization" for k, _ in scope.get("headers", [])) > 1:
            # one credential per request: a proxy that checks the first header and this server (the last) would
            # otherwise disagree on who is calling
            return await _send_error(send, 400, "the request has more than one Authorization header",
                                     "invalid_request_error", "duplicate_authorization", echo, "authorization")
        if self.state.api_keys and scope["path"] not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if scope["path"] in ADMIN_PATHS:
                if not self.state.admin_keys:
                    return await _send_error(send, 403, "admin routes are disabled: start the server with "
                                             "--admin-api-key to use them", "invalid_request_error",
                                             "admin_disabled", echo)
                if not key_matches(token, self.state.admin_keys):
                    if key_matches(token, self.state.api_keys):  # a user: known, but not allowed here
                        return await _send_error(send, 403, "this route needs the admin API key",
                                                 "invalid_request_error", "admin_key_required", echo)
                    return await _send_error(send, 401, "Incorrect API key provided.", "invalid_request_error",
                                             "invalid_api_key", echo)
            elif not key_matches(token, self.state.api_keys):
                return await _send_error(send, 401, "Incorrect API key provided.", "invalid_request_error",
                                         "invalid_api_key", echo)
            else:  # the engine ids of this key's requests live in their own namespace (common.engine_rid)
                scope["state"]["rid_scope"] = key_scope(token)
        if self.state.draining and scope["path"] not in OPEN_PATHS:
            return await _send_error(send, 503, "the server is shutting down", "server_error", "shutting_down",
                                     [*echo, (b"retry-after", b"2")])
        limit = self.state.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_error(send, 413, f"the request body is larger than {limit} bytes",
                                     "invalid_request_error", "body_too_large", echo)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send_with_id)
        except BodyTooLarge as exc:
            await _send_error(send, 413, exc.detail, "invalid_request_error", exc.code, echo)


class BodyTooLarge(StarletteHTTPException):
    """A chunked body that outgrows the limit while it is read. An HTTPException, because FastAPI's body
    parsing re-raises those and turns any other exception into a 400; the app's HTTPException handler then
    answers 413 (the except clause above covers reads outside FastAPI's body parsing)."""

    code = "body_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


def install_middleware(app: FastAPI, state: ServerState) -> None:
    app.add_middleware(RedraftMiddleware, state=state)
