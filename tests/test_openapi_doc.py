"""`GET /openapi.json` tells the truth about the live server (issue 39, item 7): every answer a route gives has its
status declared, with the content type it has (an empty body where none is declared), and every error body
validates against the declared ErrorResponse. Checked two ways against a live `redraft serve` with an API key:
fixed requests that reach each kind of answer (empty health probes, Prometheus text, SSE streams, 401, 404,
413), and schemathesis' response checks (status codes, content types, response schemas) on a few generated
requests per POST route, within a wall-clock budget."""

from __future__ import annotations

import time

import httpx
import jsonschema
import pytest

from live_server import RedraftServer
from optional_tools import need_module
from test_openai_fuzz import cap_cost

schemathesis = need_module("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow

KEY = "sk-doc"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 100_000
EXAMPLES = 4  # generated requests per POST route and mode
BUDGET_S = 40.0  # for all generated requests together


@pytest.fixture(scope="module")
def server(request, ckpt, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("openapi-log"),
                        ["--api-key", KEY, "--default-max-tokens", "8", "--max-body-bytes", str(MAX_BODY)])
    request.addfinalizer(srv.stop)
    return srv.start()


@pytest.fixture(scope="module")
def doc(server) -> dict:
    r = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=30)
    assert r.status_code == 200
    return r.json()


def declared(doc: dict, path: str, method: str, resp: httpx.Response) -> None:
    """`resp` is one of the answers the document declares for the operation: its status, its content type (or
    no body where none is declared), and an error body that validates against the declared schema."""
    op = doc["paths"][path][method]
    status = str(resp.status_code)
    assert status in op["responses"], f"{method.upper()} {path}: {status} is not declared ({list(op['responses'])})"
    content = op["responses"][status].get("content")
    if not content:
        assert resp.content == b"", f"{method.upper()} {path}: a body where none is declared: {resp.text[:200]}"
        return
    media = resp.headers["content-type"].split(";")[0].strip()
    assert media in content, f"{method.upper()} {path} {status}: {media} is not among {list(content)}"
    if media == "application/json":
        schema = {**content[media]["schema"], "components": doc["components"]}
        jsonschema.validate(resp.json(), schema)


def test_no_422_and_errors_in_openai_shape(doc):
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            for status, answer in op["responses"].items():
                if status.startswith(("4", "5")) and "content" in answer:  # else: an empty body, declared so
                    assert answer["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_every_get_route_answers_as_declared(server, doc):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, ops in doc["paths"].items():
            if "get" in ops and "post" not in ops and "{" not in path:  # a GET twin of a POST acts: left out
                declared(doc, path, "get", http.get(path))
        declared(doc, "/v1/models/{model}", "get", http.get("/v1/models/no-such-model"))  # 404
        name = http.get("/v1/models").json()["data"][0]["id"]
        declared(doc, "/v1/models/{model}", "get", http.get(f"/v1/models/{name}"))
    assert httpx.get(f"{server.url}/health").content == b""  # empty, as declared
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}


STREAMED = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})]


@pytest.mark.parametrize("path,body", STREAMED)
def test_post_routes_answer_as_declared(server, doc, path, body):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for stream in (False, True):
            declared(doc, path, "post", http.post(path, json={**body, "stream": stream}))
        if path != "/generate":  # a model that is not served: 404
            declared(doc, path, "post", http.post(path, json={**body, "model": "no-such-model"}))
        declared(doc, path, "post", http.post(path, json={**body, "no_such_field": 1}))  # 400
        declared(doc, path, "post", http.post(path, content=b"{", headers={"content-type": "application/json"}))
        declared(doc, path, "post", http.post(path, json={**body, "pad": "x" * MAX_BODY}))  # 413
    declared(doc, path, "post", httpx.post(f"{server.url}{path}", json=body, timeout=30))  # no key: 401


def test_generated_requests_answer_as_declared(server, doc):
    """schemathesis' own response checks on requests it generates from the document."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_dict(doc).include(method="POST")
    ops = [result.ok() for result in schema.get_all_operations() if result.ok().path not in ("/flush_cache",)]
    deadline = time.monotonic() + BUDGET_S
    sent = 0
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                nonlocal sent
                if time.monotonic() > deadline:
                    return
                cap_cost(case.body)
                resp = case.call(base_url=server.url, headers=AUTH, timeout=60)
                sent += 1
                case.validate_response(resp, checks=checks, headers=AUTH)

            run()
    assert sent >= 20, f"only {sent} generated requests within the budget"
    assert httpx.get(f"{server.url}/health").status_code == 200
