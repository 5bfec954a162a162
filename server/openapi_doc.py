"""The OpenAPI document (`GET /openapi.json`) made to say what the routes answer. Generated SDKs and validating
gateways read it, so every status a route may answer is declared with the body it has:

- errors in OpenAI's shape (`ErrorResponse`), never FastAPI's 422 `HTTPValidationError`: 400 for a bad body or
  parameter (every POST: malformed JSON is one), 401 for a missing or wrong key (with --api-key; the open paths
  excepted), 403 on the admin routes, 404 where the request names a `model`, 413 for a body over
  --max-body-bytes (every POST), 500 where an engine failure ends a generation, 503 while the engine is away or
  the server drains;
- a route whose body has `stream` answers `text/event-stream` as well as JSON;
- what a route's own `response_class` and `responses` say (empty bodies for /health, /live and /health_generate,
  text/plain for /metrics): a status a route declares itself is kept as it is.

The rules are read from the routes themselves (their body schema, their path), so a new route is described
without a table here to keep up to date."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from redraft.server.middleware import ADMIN_PATHS, OPEN_PATHS

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
SSE = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events: `data: <JSON>` "
                                                                         "lines, ending with `data: [DONE]`"}}}
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")  # engine failure: a 500
NEVER_UNAVAILABLE = ("/metrics", "/version")  # answered by the HTTP process alone, draining or not


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, the answer of every refusal and failure."""

    error: ErrorDetail


ERRORS = {
    "400": "Invalid request (a field is named in error.param)",
    "401": "Missing or incorrect API key (only with --api-key)",
    "403": "An admin route without the admin key",
    "404": "The model named is not served here",
    "409": "The server holds another weight version than require_weight_version names (docs/rl.md)",
    "413": "The request body is larger than --max-body-bytes",
    "500": "The engine failed this request",
    "503": "The engine is not available, or the server is shutting down",
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with every answer declared (cached on the app, as FastAPI does)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (ErrorDetail, ErrorResponse):
            schemas[model.__name__] = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                _declare(path, method, op, schemas)
        for unused in ("HTTPValidationError", "ValidationError"):
            if unused not in _refs_in(doc["paths"]):
                schemas.pop(unused, None)
        app.openapi_schema = doc
    return app.openapi_schema


def _declare(path: str, method: str, op: dict[str, Any], schemas: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)  # FastAPI's validation error: answered as a 400 in OpenAI's shape here
    body = _body_schema(op, schemas)
    codes = set()
    if method == "post" or op.get("parameters"):
        codes.add("400")
    if method == "post":
        codes.add("413")
    if path not in OPEN_PATHS:
        codes.add("401")
    if path in ADMIN_PATHS:
        codes.add("403")
    if "model" in body.get("properties", {}) or "{model}" in path:
        codes.add("404")
    if "require_weight_version" in body.get("properties", {}):
        codes.add("409")
    if path in GENERATING:
        codes.add("500")
    if path not in NEVER_UNAVAILABLE:
        codes.add("503")
    for code in sorted(codes):  # what a route declares itself (an empty 503 of a probe) stands
        responses.setdefault(code, {"description": ERRORS[code],
                                    "content": {"application/json": {"schema": ERROR_REF}}})
    if "stream" in body.get("properties", {}):
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok.setdefault("content", {}).update(SSE)


def _body_schema(op: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """The JSON request body's schema of an operation ({} when it has none), its $ref followed."""
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    ref = schema.get("$ref", "")
    return schemas.get(ref.rsplit("/", 1)[-1], {}) if ref else schema


def _refs_in(node: Any) -> set[str]:
    """The component names every $ref under `node` points to."""
    found: set[str] = set()
    stack = [node]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str):
                found.add(ref.rsplit("/", 1)[-1])
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return found
