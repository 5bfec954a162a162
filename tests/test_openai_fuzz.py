"""Schema fuzzing: schemathesis generates requests from the app's own OpenAPI document (/openapi.json of a live
`redraft serve`) for POST /v1/chat/completions, /v1/completions and /generate, and no answer may be a 5xx.

Two documents are fuzzed:
- as served: positive and negative cases. Most positive cases are still refused, since the document cannot
  express the rules the handlers enforce in code (a message needs content, token ids below the vocabulary
  size, exactly one of text / input_ids, ...);
- tightened: the same document with those rules written into it (and with no unsupported fields), so that
  most cases get past validation into tokenisation, sampling parameters and the engine, where a crash is a
  dead engine rather than a 400; integer sampling parameters (top_k, seed) are drawn around the int64 edges,
  where they once killed the engine process.
What must hold: no 5xx, every 4xx in the OpenAI error shape, every SSE stream ends with [DONE] and carries
no server_error event, and the server is healthy and answers exactly as before at the end.

Cost bounds: the cost knobs of a case (max_tokens, n, prompt lists, post steps) are capped before it is
sent, examples are few and derandomised, shrinking is off, and each route and generation mode has a share of
a wall-clock budget, after which its run ends (about 45 s in all with the server's start, on two cores).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import httpx
import pytest


# the server launcher and checks of the OpenAI API tests (tests/ is on sys.path, as for naive_llada2)
from optional_tools import need_module
from test_openai_api import AUTH, KEYS, VOCAB, RedraftServer, assert_error_shape, sse_payloads, user

schemathesis = need_module("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow

ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]
BUDGET_S = {"as-served": 12.0, "tightened": 20.0}  # wall clock for each document's cases, all routes
EXAMPLES = {"as-served": 25, "tightened": 25}  # per operation and generation mode
REQUEST_TIMEOUT_S = 60.0
CAP_TOKENS, CAP_N, CAP_LIST, CAP_POST_STEPS = 16, 2, 4, 8


@pytest.fixture(scope="module")
def server(request, ckpt, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("fuzz-log"), ["--api-key", KEYS[0], "--default-max-tokens",
                                                                    str(CAP_TOKENS)])
    request.addfinalizer(srv.stop)
    return srv.start()


@pytest.fixture(scope="module")
def openapi_doc(server: RedraftServer) -> dict:
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401, "the document needs the key too"
    r = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=30)
    assert r.status_code == 200
    doc = r.json()
    assert set(ROUTES) <= set(doc["paths"])
    return doc


def tighten(doc: dict) -> dict:
    """The served document plus the rules the handlers check in code, minus the fields only ever refused."""
    doc = copy.deepcopy(doc)
    s = doc["components"]["schemas"]
    text = {"type": "string", "minLength": 1, "maxLength": 200}
    tokens = {"type": "integer", "minimum": 1, "maximum": CAP_TOKENS}
    token_id = {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}
    stop = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "maxItems": 4}
    # small values, and values at and beyond the int64 edges (sampling parameters travel as int64 tensors)
    int64_edges = {"anyOf": [{"type": "integer", "minimum": -1, "maximum": 100},
                             {"type": "integer", "minimum": 2**63 - 3, "maximum": 2**63 + 3},
                             {"type": "integer", "minimum": -(2**63) - 3, "maximum": -(2**63) + 3}]}
    s["ChatMessage"]["properties"]["content"] = text
    s["ChatMessage"]["required"] = ["role", "content"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = s[name]["properties"]
        for field in ("model", "frequency_penalty", "presence_penalty", "logit_bias", "mbe_window", "stream_options",
                      "best_of", "echo", "suffix", "top_logprobs", "tool_choice", "response_format",
                      "chat_template_kwargs"):
            props.pop(field, None)
        props.update(
            max_tokens=tokens, n={"type": "integer", "minimum": 1, "maximum": CAP_N}, stop=stop,
            max_post_steps={"type": "integer", "minimum": 0, "maximum": CAP_POST_STEPS},
            stop_token_ids={"type": "array", "items": token_id, "maxItems": 4},
            top_k=int64_edges, seed=int64_edges,
            metadata={"type": "object", "properties": {"domain": {"type": "string", "maxLength": 16}},
                      "additionalProperties": False},
            # structured output: short grammars, valid or not (a bad one must be a 400, never a 500)
            regex={"type": "string", "minLength": 1, "maxLength": 12},
            ebnf={"type": "string", "minLength": 1, "maxLength": 24},
            lark={"type": "string", "minLength": 1, "maxLength": 24},
        )
    chat = s["ChatCompletionRequest"]["properties"]
    chat["messages"] = {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1,
                        "maxItems": 4}
    chat["max_completion_tokens"] = tokens
    chat["tools"] = {"type": "array", "items": {"$ref": "#/components/schemas/Tool"}, "maxItems": 2}
    comp = s["CompletionRequest"]["properties"]
    comp["prompt"] = {"anyOf": [text, {"type": "array", "items": token_id, "minItems": 1, "maxItems": 64},
                                {"type": "array", "items": text, "minItems": 1, "maxItems": 2}]}
    comp["logprobs"] = {"type": "integer", "minimum": 0, "maximum": 5}
    gen = s["GenerateBody"]
    gen["properties"].pop("input_ids")
    gen["properties"]["text"] = text
    gen["required"] = ["text"]
    gen["properties"]["sampling_params"] = {
        "type": "object", "additionalProperties": False, "required": ["max_new_tokens"],
        "properties": {
            "max_new_tokens": tokens, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": int64_edges, "seed": int64_edges, "stop": stop,
            "stop_token_ids": {"type": "array", "items": token_id, "maxItems": 4}, "ignore_eos": {"type": "boolean"},
            "mode": {"enum": ["S", "Q", "auto"]}, "threshold": {"type": "number", "minimum": 0, "maximum": 1},
            "edit_threshold": {"type": "number", "minimum": 0, "maximum": 1},
            "max_post_steps": {"type": "integer", "minimum": 0, "maximum": CAP_POST_STEPS},
            "domain": {"type": "string", "maxLength": 16}, "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        },
    }
    return doc


def cap_cost(body: Any) -> None:
    """Bound what one case can cost the engine (the limits themselves are the hostile battery's business)."""
    if not isinstance(body, dict):
        return
    body.pop("model", None)  # an unknown model is a 404 before anything else runs
    for key, cap in (("max_tokens", CAP_TOKENS), ("max_completion_tokens", CAP_TOKENS), ("n", CAP_N),
                     ("max_post_steps", CAP_POST_STEPS)):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
            body[key] = cap
    for key in ("prompt", "text", "input_ids"):
        if isinstance(body.get(key), list) and body[key] and not isinstance(body[key][0], int):
            body[key] = body[key][:CAP_LIST]  # a batch of prompts: a few only
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        for key, cap, absent in (("max_new_tokens", CAP_TOKENS, 128), ("max_post_steps", CAP_POST_STEPS, 0)):
            value = sp.get(key, absent)  # max_new_tokens defaults to 128 in the native API
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                sp[key] = cap


def check_response(resp) -> None:
    """No 5xx; a 4xx in the OpenAI error shape; an SSE stream ending in [DONE] with no server error inside."""
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:500]}"
    headers = [(k, v) for k, vs in resp.headers.items() for v in (vs if isinstance(vs, list) else [vs])]
    wrapped = httpx.Response(resp.status_code, headers=headers, content=resp.content)
    if resp.status_code >= 400:
        assert_error_shape(wrapped)
    elif wrapped.headers.get("content-type", "").startswith("text/event-stream"):
        for event in sse_payloads(wrapped):
            if isinstance(event, dict) and "error" in event:
                assert event["error"].get("type") != "server_error", event


class OutOfBudget(Exception):
    """Raised by a fuzz case once the wall-clock budget is spent."""


def _operations(doc: dict):
    schema = schemathesis.openapi.from_dict(doc).include(method="POST", path=ROUTES)
    ops = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.path for op in ops) == sorted(ROUTES)
    return ops


def test_schema_fuzz_finds_no_server_error(server, openapi_doc):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=REQUEST_TIMEOUT_S) as http:
        baseline = http.post("/v1/chat/completions", json={"messages": user("the small cat"), "max_tokens": 16,
                                                           "temperature": 0}).json()
        sent: dict[str, dict[int, int]] = {}
        plan = [("as-served", openapi_doc, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)),
                ("tightened", tighten(openapi_doc), (GenerationMode.POSITIVE,))]
        for variant, doc, modes in plan:
            ops = _operations(doc)
            for op in ops:
                for mode in modes:
                    deadline = time.monotonic() + BUDGET_S[variant] / (len(ops) * len(modes))  # a fair share
                    counts = sent.setdefault(f"{variant} {mode.value} {op.path}", {})

                    @settings(max_examples=EXAMPLES[variant], deadline=None, database=None, derandomize=True,
                              phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                              suppress_health_check=list(HealthCheck))
                    @given(case=op.as_strategy(generation_mode=mode))
                    def run(case) -> None:
                        if time.monotonic() > deadline:
                            raise OutOfBudget()  # ends this run at once (Hypothesis stops at a first failure)
                        cap_cost(case.body)
                        resp = case.call(base_url=server.url, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
                        counts[resp.status_code] = counts.get(resp.status_code, 0) + 1
                        try:
                            check_response(resp)
                        except AssertionError as exc:  # name the case: Hypothesis prints an empty repr
                            body = repr(case.body)[:1500]
                            raise AssertionError(f"{variant} {mode.value} {case.method} {case.path} body={body}\n"
                                                 f"{exc}\nserver log:\n{server.log_tail()}") from None

                    try:
                        run()
                    except OutOfBudget:
                        pass
        print("fuzz cases by status:", sent)
        total = sum(sum(c.values()) for c in sent.values())
        served = sum(c.get(200, 0) for c in sent.values())
        assert total >= 60, f"too few cases were sent within the budget: {sent}"
        assert served >= 10, f"hardly any case got through validation: {sent}"
        # still healthy, and a fixed request answers exactly as before the fuzzing
        assert http.get("/health").status_code == 200
        after = http.post("/v1/chat/completions", json={"messages": user("the small cat"), "max_tokens": 16,
                                                        "temperature": 0}).json()
        assert after["choices"][0]["message"] == baseline["choices"][0]["message"]
