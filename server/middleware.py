"""Pure-ASGI middleware: allowed hosts and cross-site requests (server/host_check.py), request ids, API keys,
body-size limit.

Written as raw ASGI (not BaseHTTPMiddleware) so that streaming responses and client-disconnect detection
pass through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.protocol.errors import RequestError
from redraft.server.common import REQUEST_ID, RETRY_AFTER, ServerState, key_scope
from redraft.server.host_check import cross_site, host_allowed
from redraft.server.playground import PATHS as PLAYGROUND_PATHS
from redraft.server.rl_api import RL_ADMIN_PATHS

log = logging.getLogger("redraft.http")

# liveness probes and Prometheus need no key; nor does the playground's static page (its calls carry the key)
OPEN_PATHS = {"/health", "/live", "/metrics", *PLAYGROUND_PATHS}
ADMIN_PATHS = {"/abort_request", "/flush_cache", *RL_ADMIN_PATHS}  # they change what other clients get: the admin key only


async def _send_error(send, err: RequestError, headers: list[tuple[bytes, bytes]]) -> None:
    """Answer `err` in OpenAI's shape from the middleware (the app never sees the request)."""
    rid = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), "-")
    log.info("request %s refused: %d %s: %s", rid, err.status, err.code, err.message)
    body = json.dumps(err.body()).encode()
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers, *extra]})
    await send({"type": "http.response.body", "body": body})


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant time in the key's content, and every configured key is always compared."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


def _invalid_key() -> RequestError:
    return RequestError("Incorrect API key provided.", status=401, code="invalid_api_key")


class RedraftMiddleware:
    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        echo = [(b"x-request-id", rid.encode())]
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await _send_error(send, refusal, echo)

        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), *echo]}
            await send(message)

        try:
            await self.app(scope, _limited(receive, self.state.max_body_bytes), send_with_id)
        except BodyTooLarge as exc:
            await _send_error(send, RequestError(exc.detail, status=413, code=exc.code), echo)
        except Exception:  # a bug: a JSON 500 here, not re-raised, so the keep-alive connection lives on
            log.exception("request %s %s %s failed", rid, scope.get("method"), scope.get("path"))
            if started:
                raise  # the status line is gone: the server closes the connection
            await _send_error(send, RequestError("internal server error", status=500, code="internal_error"), echo)

    def _refusal(self, scope, headers: dict[str, str]) -> RequestError | None:
        """Why the request is answered here, before the app reads it; None: it goes on."""
        if not host_allowed(headers.get("host", ""), self.state.allowed_hosts):
            return RequestError(f"the Host header {headers.get('host', '')[:64]!r} is not a name this server answers "
                                "to (--allowed-hosts)", param="host", code="host_not_allowed")
        if cross_site(scope["method"], headers):
            return RequestError("a request from another site's page is refused (Origin / Sec-Fetch-Site): this "
                                "server serves no other site", status=403, code="cross_site_request")
        if sum(k.lower() == b"authorization" for k, _ in scope.get("headers", [])) > 1:
            # one credential per request: a proxy that checks the first header and this server (the last) would
            # otherwise disagree on who is calling
            return RequestError("the request has more than one Authorization header", param="authorization",
                                code="duplicate_authorization")
        if self.state.api_keys and scope["path"] not in OPEN_PATHS:
            refused = self._key_refusal(scope, headers)
            if refused is not None:
                return refused
        if self.state.draining and scope["path"] not in OPEN_PATHS:
            return RequestError("the server is shutting down", status=503, code="shutting_down", headers=RETRY_AFTER)
        limit = self.state.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return RequestError(f"the request body is larger than {limit} bytes", status=413, code="body_too_large")
        return None

    def _key_refusal(self, scope, headers: dict[str, str]) -> RequestError | None:
        """With API keys: the admin routes take the admin key only, the others any API key, whose requests get
        engine ids of their own namespace (common.engine_rid)."""
        auth = headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if scope["path"] in ADMIN_PATHS:
            if not self.state.admin_keys:
                return RequestError("admin routes are disabled: start the server with --admin-api-key to use them",
                                    status=403, code="admin_disabled")
            if key_matches(token, self.state.admin_keys):
                return None
            if key_matches(token, self.state.api_keys):  # a user: known, but not allowed here
                return RequestError("this route needs the admin API key", status=403, code="admin_key_required")
            return _invalid_key()
        if not key_matches(token, self.state.api_keys):
            return _invalid_key()
        scope["state"]["rid_scope"] = key_scope(token)
        return None


def _limited(receive, limit: int):
    """`receive`, raising BodyTooLarge once the body read so far is larger than `limit` bytes (a chunked body
    declares no length up front)."""
    received = 0

    async def limited_receive():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return limited_receive


class BodyTooLarge(StarletteHTTPException):
    """A chunked body that outgrows the limit while it is read. An HTTPException, because FastAPI's body
    parsing re-raises those and turns any other exception into a 400; the app's HTTPException handler then
    answers 413 (RedraftMiddleware's except clause covers reads outside FastAPI's body parsing)."""

    code = "body_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


def install_middleware(app: FastAPI, state: ServerState) -> None:
    app.add_middleware(RedraftMiddleware, state=state)
