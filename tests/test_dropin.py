"""Drop-in II (issue 39): what SGLang's and vLLM's own clients send, answered as they expect, against a live
`redraft serve` of the bundled demo model through the real openai SDK (raw httpx where the SDK hides the wire).

Each test names the numbered request it covers. What is asserted holds whatever the model writes: shapes,
statuses, and equalities between two ways of asking the same thing at temperature 0."""

from __future__ import annotations

import json
import httpx
import openai
import pytest
from pydantic import BaseModel

from live_server import RedraftServer, assert_error_shape
from redraft.training.tasks import MATH_TOOLS

MODEL = "demo_model"
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server(request, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(None, tmp_path_factory.mktemp("dropin"), ["--cpu-threads", "1"])
    request.addfinalizer(srv.stop)
    return srv.start()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_events(resp: httpx.Response) -> list[dict]:
    """The JSON `data:` events of an SSE answer (the final [DONE] checked and dropped)."""
    assert resp.status_code == 200, resp.text[:500]
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


# ---- 1. tool schemas with $defs / $ref (what Pydantic's model_json_schema() writes) ----------------------------
class Pair(BaseModel):
    a: int
    b: int


class AddArgs(BaseModel):  # a nested model: $defs.Pair
    pair: Pair


class Node(BaseModel):  # refers to itself: {"$defs": {"Node": ...}, "$ref": "#/$defs/Node"}
    v: int
    kids: list["Node"] = []


# two tools (the demo model's context is 1024 tokens: the rendered tools take 818 of them)
PYDANTIC_TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": AddArgs.model_json_schema()}},
    {"type": "function", "function": {"name": "tree", "parameters": Node.model_json_schema()}},
]
ARGS_MODELS = {"add": AddArgs, "tree": Node}


def test_schemas_carry_refs():
    """The premise: pydantic writes nested and recursive models as $defs and $ref."""
    assert "$defs" in AddArgs.model_json_schema() and "$defs" in Node.model_json_schema()
    assert '"#/$defs/Node"' in json.dumps(Node.model_json_schema()["$defs"])


def _check_calls(calls, allowed: set[str]) -> int:
    for call in calls:
        assert call.function.name in allowed
        ARGS_MODELS[call.function.name].model_validate_json(call.function.arguments)
    return len(calls)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}},
                                         {"type": "function", "function": {"name": "tree"}}])
def test_forced_tool_call_with_defs_on_chat(client, tool_choice):
    r = client.chat.completions.create(model=MODEL, messages=user("What is 12 + 7?"), tools=PYDANTIC_TOOLS,
                                       tool_choice=tool_choice, max_tokens=160, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice
    if choice.finish_reason == "tool_calls":
        names = {tool_choice["function"]["name"]} if isinstance(tool_choice, dict) else set(ARGS_MODELS)
        assert _check_calls(choice.message.tool_calls, names) >= 1
    else:
        assert choice.message.content == "" and not choice.message.tool_calls


def test_forced_tool_call_with_defs_on_responses(client):
    tools = [{"type": "function", **t["function"]} for t in PYDANTIC_TOOLS]
    for choice in ("required", {"type": "function", "name": "add"}):
        r = client.responses.create(model=MODEL, input="What is 12 + 7?", tools=tools, tool_choice=choice,
                                    max_output_tokens=160, temperature=0)
        calls = [item for item in r.output if item.type == "function_call"]
        assert r.status in ("completed", "incomplete"), r
        if r.status == "completed":
            assert calls
            for call in calls:
                ARGS_MODELS[call.name].model_validate_json(call.arguments)


def test_forced_call_answers_validate(client):
    """Not vacuous: the demo model finishes the named add call, and its arguments are the nested model."""
    r = client.chat.completions.create(model=MODEL, messages=user("What is 12 + 7?"), tools=PYDANTIC_TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       max_tokens=160, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert _check_calls(r.choices[0].message.tool_calls, {"add"}) >= 1


# ---- 2. prompt ids out of range are a 400 on every path ---------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 2**63, 10**9])
@pytest.mark.parametrize("extra", [{"echo": True, "logprobs": 1}, {"echo": True, "max_tokens": 0}, {}])
def test_prompt_ids_out_of_range(http, bad, extra):
    body = {"prompt": [5, bad], "max_tokens": 2, **extra}
    err = assert_error_shape(http.post("/v1/completions", json=body), 400)
    assert err["param"] == "prompt" and "vocabulary" in err["message"]
    err = assert_error_shape(http.post("/v1/completions", json={**body, "prompt": [[5, 6], [5, bad]]}), 400)
    assert err["param"] == "prompt"


def test_generate_ids_out_of_range(http):
    for body in ({"input_ids": [5, -1]}, {"input_ids": [5, 2**63], "return_logprob": True, "logprob_start_len": 0}):
        err = assert_error_shape(http.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}), 400)
        assert err["param"] == "input_ids"
    assert http.get("/health").status_code == 200


# ---- 3. a forced call cut by max_tokens writes no envelope text -------------------------------------------
def test_forced_call_cut_by_max_tokens(client, http):
    kw = dict(model=MODEL, messages=user("What is 12 + 7?"), tools=list(MATH_TOOLS), tool_choice="required",
              max_tokens=3, temperature=0)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == "" and not choice.message.tool_calls
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    r = client.responses.create(model=MODEL, input="What is 12 + 7?", tools=[
        {"type": "function", **t["function"]} for t in MATH_TOOLS], tool_choice="required", max_output_tokens=3)
    assert r.status == "incomplete" and r.output_text == ""
    assert not [item for item in r.output if item.type == "function_call"]


def test_auto_tool_choice_keeps_plain_text_on_responses(client):
    """tool_choice auto (the default) and an answer without a call: the text is the answer, as on chat."""
    tools = [{"type": "function", **t["function"]} for t in MATH_TOOLS]
    q = "Reverse the word: planet"
    r = client.responses.create(model=MODEL, input=q, tools=tools, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=user(q), tools=list(MATH_TOOLS), temperature=0)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content
    assert r.output_text == chat.choices[0].message.content


# ---- 4. logprobs 0: the sampled token is always in top_logprobs --------------------------------------------
def test_logprobs_zero_holds_the_sampled_token(client):
    r = client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=8, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens > 0
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    # with alternatives the sampled token is there too (at temperature 0 it is the best one)
    r2 = client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=8, logprobs=2, temperature=0)
    for tok, v, alts in zip(r2.choices[0].logprobs.tokens, r2.choices[0].logprobs.token_logprobs,
                            r2.choices[0].logprobs.top_logprobs):
        assert tok in alts and alts[tok] >= v - 1e-5
    # echoed prompt positions too (the first has no logprob)
    r3 = client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=0, logprobs=0, echo=True)
    lp3 = r3.choices[0].logprobs
    assert lp3.top_logprobs[0] is None
    assert lp3.top_logprobs[1:] == [{t: v} for t, v in zip(lp3.tokens[1:], lp3.token_logprobs[1:])]


# ---- 5. one model object --------------------------------------------------------------------------------
def test_model_retrieve_equals_the_list_entry(http, client):
    listed = http.get("/v1/models").json()["data"][0]
    alone = http.get(f"/v1/models/{listed['id']}").json()
    assert {k: v for k, v in alone.items() if k != "created"} == {k: v for k, v in listed.items() if k != "created"}
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(alone)
    assert client.models.retrieve(listed["id"]).model_dump().keys() == client.models.list().data[0].model_dump().keys()


# ---- 6. continuous_usage_stats only with include_usage ----------------------------------------------------
@pytest.mark.parametrize("route,body", [("/v1/chat/completions", {"messages": user("Count to 5.")}),
                                        ("/v1/completions", {"prompt": "Count to 5."})])
def test_continuous_usage_needs_include_usage(http, route, body):
    base = {**body, "max_tokens": 12, "stream": True, "temperature": 0}
    off = sse_events(http.post(route, json={**base, "stream_options": {"continuous_usage_stats": True}}))
    assert off and all(e.get("usage") is None for e in off)
    on = sse_events(http.post(route, json={**base, "stream_options": {"continuous_usage_stats": True,
                                                                       "include_usage": True}}))
    assert all(e["usage"] is not None for e in on), "every chunk carries usage when both are set"
