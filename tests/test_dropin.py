"""Drop-in II (issue 39): what SGLang's and vLLM's own clients send, answered as they expect, against a live
`redraft serve` of the bundled demo model through the real openai SDK (raw httpx where the SDK hides the wire).

Each test names the numbered request it covers. What is asserted holds whatever the model writes: shapes,
statuses, and equalities between two ways of asking the same thing at temperature 0."""

from __future__ import annotations

import json
import httpx
import pytest
from pydantic import BaseModel

from live_server import assert_error_shape
from redraft.training.tasks import MATH_TOOLS

MODEL = "demo_model"
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def http(demo_server) -> httpx.Client:
    with httpx.Client(base_url=demo_server.url, timeout=TIMEOUT_S) as c:
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
def test_forced_tool_call_with_defs_on_chat(demo_client, tool_choice):
    r = demo_client.chat.completions.create(model=MODEL, messages=user("What is 12 + 7?"), tools=PYDANTIC_TOOLS,
                                            tool_choice=tool_choice, max_tokens=160, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice
    if choice.finish_reason == "tool_calls":
        names = {tool_choice["function"]["name"]} if isinstance(tool_choice, dict) else set(ARGS_MODELS)
        assert _check_calls(choice.message.tool_calls, names) >= 1
    else:
        assert choice.message.content == "" and not choice.message.tool_calls


@pytest.mark.slow  # over 10 s on two busy cores
def test_forced_tool_call_with_defs_on_responses(demo_client):
    tools = [{"type": "function", **t["function"]} for t in PYDANTIC_TOOLS]
    for choice in ("required", {"type": "function", "name": "add"}):
        r = demo_client.responses.create(model=MODEL, input="What is 12 + 7?", tools=tools, tool_choice=choice,
                                         max_output_tokens=160, temperature=0)
        calls = [item for item in r.output if item.type == "function_call"]
        assert r.status in ("completed", "incomplete"), r
        if r.status == "completed":
            assert calls
            for call in calls:
                ARGS_MODELS[call.name].model_validate_json(call.arguments)


def test_forced_call_answers_validate(demo_client):
    """Not vacuous: the demo model finishes the named add call, and its arguments are the nested model."""
    r = demo_client.chat.completions.create(model=MODEL, messages=user("What is 12 + 7?"), tools=PYDANTIC_TOOLS,
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
def test_forced_call_cut_by_max_tokens(demo_client, http):
    kw = dict(model=MODEL, messages=user("What is 12 + 7?"), tools=list(MATH_TOOLS), tool_choice="required",
              max_tokens=3, temperature=0)
    choice = demo_client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == "" and not choice.message.tool_calls
    chunks = list(demo_client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    r = demo_client.responses.create(model=MODEL, input="What is 12 + 7?", tools=[
        {"type": "function", **t["function"]} for t in MATH_TOOLS], tool_choice="required", max_output_tokens=3)
    assert r.status == "incomplete" and r.output_text == ""
    assert not [item for item in r.output if item.type == "function_call"]


def test_auto_tool_choice_keeps_plain_text_on_responses(demo_client):
    """tool_choice auto (the default) and an answer without a call: the text is the answer, as on chat."""
    tools = [{"type": "function", **t["function"]} for t in MATH_TOOLS]
    q = "Reverse the word: planet"
    r = demo_client.responses.create(model=MODEL, input=q, tools=tools, temperature=0)
    chat = demo_client.chat.completions.create(model=MODEL, messages=user(q), tools=list(MATH_TOOLS), temperature=0)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content
    assert r.output_text == chat.choices[0].message.content


# ---- 4. logprobs 0: the sampled token is always in top_logprobs --------------------------------------------
def test_logprobs_zero_holds_the_sampled_token(demo_client):
    r = demo_client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=8, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens > 0
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    # with alternatives the sampled token is there too (at temperature 0 it is the best one)
    r2 = demo_client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=8, logprobs=2, temperature=0)
    for tok, v, alts in zip(r2.choices[0].logprobs.tokens, r2.choices[0].logprobs.token_logprobs,
                            r2.choices[0].logprobs.top_logprobs):
        assert tok in alts and alts[tok] >= v - 1e-5
    # echoed prompt positions too (the first has no logprob)
    r3 = demo_client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=0, logprobs=0, echo=True)
    lp3 = r3.choices[0].logprobs
    assert lp3.top_logprobs[0] is None
    assert lp3.top_logprobs[1:] == [{t: v} for t, v in zip(lp3.tokens[1:], lp3.token_logprobs[1:])]


# ---- 5. one model object --------------------------------------------------------------------------------
def test_model_retrieve_equals_the_list_entry(http, demo_client):
    listed = http.get("/v1/models").json()["data"][0]
    alone = http.get(f"/v1/models/{listed['id']}").json()
    assert {k: v for k, v in alone.items() if k != "created"} == {k: v for k, v in listed.items() if k != "created"}
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(alone)
    retrieved = demo_client.models.retrieve(listed["id"]).model_dump()
    assert retrieved.keys() == demo_client.models.list().data[0].model_dump().keys()


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


# ---- 8. assistant prefill ---------------------------------------------------------------------------------
PREFILL = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "The answer"}]


def test_continue_final_message(demo_client, http):
    open_ids = http.post("/tokenize", json={"messages": PREFILL, "continue_final_message": True,
                                            "add_generation_prompt": False}).json()["tokens"]
    closed = http.post("/tokenize", json={"messages": PREFILL, "add_generation_prompt": False}).json()["tokens"]
    assert closed[: len(open_ids)] == open_ids and len(closed) > len(open_ids)
    tail = http.post("/detokenize", json={"tokens": closed[len(open_ids):]}).json()["prompt"]
    assert tail == "<|role_end|>", tail  # only the turn's closing markup is cut
    opened = http.post("/detokenize", json={"tokens": open_ids}).json()["prompt"]
    assert opened.endswith("<role>ASSISTANT</role>The answer")
    r = demo_client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=12, temperature=0,
                                            extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(open_ids)
    same = demo_client.completions.create(model=MODEL, prompt=open_ids, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text  # the prompt is the open turn, nothing else


def test_add_generation_prompt_false(demo_client, http):
    ids = http.post("/tokenize", json={"messages": user("hi"), "add_generation_prompt": False}).json()["tokens"]
    with_prompt = http.post("/tokenize", json={"messages": user("hi")}).json()["tokens"]
    assert with_prompt[: len(ids)] == ids and len(with_prompt) > len(ids)
    r = demo_client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2,
                                            extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("body", [
    {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True},
    {"messages": user("hi"), "continue_final_message": True},
    {"messages": [*PREFILL[:1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}],
     "continue_final_message": True}])
def test_prefill_refusals(http, body):
    err = assert_error_shape(http.post("/v1/chat/completions", json={**body, "max_tokens": 2}), 400)
    assert err["param"] == "continue_final_message"
    err = assert_error_shape(http.post("/tokenize", json={k: v for k, v in body.items()}), 400)
    assert err["param"] == "continue_final_message"


# ---- 9. /generate with sampling_params.n -------------------------------------------------------------------
@pytest.mark.slow  # over 10 s on two busy cores
def test_generate_n(http):
    sp = {"max_new_tokens": 8, "temperature": 0}
    one = http.post("/generate", json={"text": "What is 2 + 3?", "sampling_params": sp}).json()
    same = http.post("/generate", json={"text": "What is 2 + 3?", "sampling_params": {**sp, "n": 1}}).json()
    assert isinstance(same, dict) and same["text"] == one["text"]
    many = http.post("/generate", json={"text": ["What is 2 + 3?", "Count to 3."],
                                        "sampling_params": {**sp, "n": 2}}).json()
    assert isinstance(many, list) and len(many) == 4
    assert many[0]["text"] == many[1]["text"] == one["text"]  # a prompt's n samples together, in order
    single = http.post("/generate", json={"text": "Count to 3.", "sampling_params": {**sp, "n": 1}}).json()
    assert many[2]["text"] == many[3]["text"] == single["text"]
    seeded = http.post("/generate", json={"text": "Tell me a word.", "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "seed": 7, "n": 3}}).json()
    assert len(seeded) == 3 and len({r["meta_info"]["id"] for r in seeded}) == 3
    for bad in (0, 17, "2", True):
        err = assert_error_shape(http.post("/generate", json={"text": "x", "sampling_params": {"n": bad}}), 400)
        assert err["param"] == "sampling_params.n"
    err = assert_error_shape(http.post("/generate", json={"text": "x", "stream": True,
                                                          "sampling_params": {"n": 2}}), 400)
    assert err["param"] == "stream"


# ---- 10. reasoning_content: null; include_reasoning ----------------------------------------------------------
def test_reasoning_content_is_null(demo_client):
    r = demo_client.chat.completions.create(model=MODEL, messages=user("Count to 3."), max_tokens=8,
                                            extra_body={"include_reasoning": False})
    assert r.choices[0].message.reasoning_content is None
    chunks = list(demo_client.chat.completions.create(model=MODEL, messages=user("Count to 3."), max_tokens=8,
                                                      stream=True, extra_body={"include_reasoning": True}))
    assert all(c.choices[0].delta.reasoning_content is None for c in chunks if c.choices)


# ---- 11. echo with stream ---------------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs", [None, 1])
def test_echo_streamed_equals_whole(demo_client, logprobs):
    kw = dict(model=MODEL, prompt=["What is 2 + 2?", "Count to 3."], max_tokens=6, temperature=0, echo=True,
              logprobs=logprobs, n=1)
    whole = demo_client.completions.create(**kw)
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    for chunk in demo_client.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if logprobs is not None and ch.logprobs:
                tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
    for ch in whole.choices:
        assert texts[ch.index] == ch.text and ch.text.startswith(kw["prompt"][ch.index])
        if logprobs is not None:
            assert tokens[ch.index] == ch.logprobs.tokens
    only = list(demo_client.completions.create(**{**kw, "max_tokens": 0}, stream=True))
    assert sorted(c.choices[0].text for c in only) == sorted(kw["prompt"])
    assert {c.choices[0].finish_reason for c in only} == {"length"}


# ---- 12. vLLM's structured_outputs and guided_* -------------------------------------------------------------
CHOICES = ["yes (a.k.a. y)", "no|never", "maybe?"]


@pytest.mark.parametrize("extra", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}])
def test_choice(demo_client, extra):
    r = demo_client.chat.completions.create(model=MODEL, messages=user("Is 7 prime?"), max_tokens=16, extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content in CHOICES


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("extra,check", [
    ({"guided_json": ANSWER}, lambda t: set(json.loads(t)) == {"answer"}),
    ({"guided_json": json.dumps(ANSWER)}, lambda t: set(json.loads(t)) == {"answer"}),
    ({"structured_outputs": {"json": ANSWER}}, lambda t: set(json.loads(t)) == {"answer"}),
    ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_regex": "[0-9]{1,3}"}, lambda t: t.isdigit()),
    ({"structured_outputs": {"regex": "[0-9]{1,3}"}}, lambda t: t.isdigit()),
    ({"guided_grammar": 'root ::= "forty" | "two"'}, lambda t: t in ("forty", "two")),
    ({"structured_outputs": {"grammar": 'root ::= "forty" | "two"'}}, lambda t: t in ("forty", "two")),
])
def test_structured_outputs(demo_client, extra, check):
    r = demo_client.chat.completions.create(model=MODEL, messages=user("What is 40 + 2?"), max_tokens=24, temperature=0,
                                            extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), r.choices[0]


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "frob"}}}, "structured_outputs.json"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": ANSWER, "response_format": {"type": "json_object"}}, "guided_json"),
])
def test_structured_outputs_refusals(http, body, param):
    for route, base in (("/v1/chat/completions", {"messages": user("x")}), ("/v1/completions", {"prompt": "x"})):
        err = assert_error_shape(http.post(route, json={**base, **body, "max_tokens": 4}), 400)
        assert err["param"] == param, err


# ---- 13. return_token_ids, truncate_prompt_tokens, prompt_logprobs ---------------------------------------------
def test_return_token_ids(demo_client, http):
    plain = demo_client.chat.completions.create(model=MODEL, messages=user("Count to 3."), max_tokens=8, temperature=0)
    assert plain.model_extra["prompt_token_ids"] is None and plain.choices[0].model_extra["token_ids"] is None
    r = demo_client.chat.completions.create(model=MODEL, messages=user("Count to 3."), max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == http.post("/tokenize", json={"messages": user("Count to 3.")}
                                                          ).json()["tokens"]
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens and r.choices[0].message.content == plain.choices[0].message.content
    streamed = [t for c in demo_client.chat.completions.create(model=MODEL, messages=user("Count to 3."), max_tokens=8,
                                                               temperature=0, stream=True,
                                                               extra_body={"return_token_ids": True})
                     for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert streamed == ids
    c = demo_client.completions.create(model=MODEL, prompt="Count to 3.", max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert c.choices[0].model_extra["prompt_token_ids"] == http.post("/tokenize", json={"prompt": "Count to 3."}
                                                                     ).json()["tokens"]
    assert len(c.choices[0].model_extra["token_ids"]) == c.usage.completion_tokens
    chunks = demo_client.completions.create(model=MODEL, prompt="Count to 3.", max_tokens=8, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True})
    streamed = [t for ch in chunks for x in ch.choices for t in (x.model_extra.get("token_ids") or [])]
    assert streamed == c.choices[0].model_extra["token_ids"]
    first = next(iter(demo_client.completions.create(model=MODEL, prompt="Count to 3.", max_tokens=8, stream=True,
                                                     extra_body={"return_token_ids": True, "prompt_logprobs": 1})))
    assert first.choices[0].model_extra["prompt_token_ids"] == c.choices[0].model_extra["prompt_token_ids"]
    assert first.choices[0].text == "" and first.choices[0].model_extra["prompt_logprobs"][0] is None


def test_truncate_prompt_tokens(demo_client, http):
    ids = http.post("/tokenize", json={"prompt": "Please, what is 12 + 30?"}).json()["tokens"]
    cut = demo_client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 5})
    tail = demo_client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=6, temperature=0)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == tail.choices[0].text
    whole = demo_client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                           extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    chat = demo_client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2,
                                               extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    for bad in (0, -2):
        assert_error_shape(http.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": bad}), 400)


def test_prompt_logprobs_are_the_echo_values(demo_client):
    echo = demo_client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=0, echo=True, logprobs=2)
    r = demo_client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=2,
                                       extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    plps, prompt = r.choices[0].model_extra["prompt_logprobs"], r.choices[0].model_extra["prompt_token_ids"]
    assert plps[0] is None and len(plps) == len(prompt) == len(echo.choices[0].logprobs.tokens)
    for token, want, entry in zip(prompt[1:], echo.choices[0].logprobs.token_logprobs[1:], plps[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want)
        ranked = sorted((e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] >= -1e9
    chat = demo_client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2,
                                               extra_body={"prompt_logprobs": 0})
    plps = chat.model_extra["prompt_logprobs"]
    assert plps[0] is None and all(len(e) == 1 for e in plps[1:]) and len(plps) == chat.usage.prompt_tokens
    first = next(iter(demo_client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, stream=True,
                                                          extra_body={"prompt_logprobs": 0})))
    assert first.choices[0].model_extra["prompt_logprobs"] == plps  # streamed: on the first chunk


# ---- 14. matched_stop and stop_reason ---------------------------------------------------------------------
def test_matched_stop(demo_client, demo_server):
    base = dict(model=MODEL, messages=user("Count from 1 to 20."), max_tokens=64, temperature=0)
    free = demo_client.chat.completions.create(**base)
    text = free.choices[0].message.content
    assert free.choices[0].finish_reason == "stop"
    eos = free.choices[0].model_extra["matched_stop"]
    assert isinstance(eos, int) and free.choices[0].model_extra["stop_reason"] is None  # an EOS nobody named
    stop = text[len(text) // 2]
    cut = demo_client.chat.completions.create(**base, stop=[stop])
    assert cut.choices[0].model_extra["matched_stop"] == cut.choices[0].model_extra["stop_reason"] == stop
    named = demo_client.chat.completions.create(**base, extra_body={"stop_token_ids": [eos]})
    assert named.choices[0].model_extra["stop_reason"] == eos
    short = demo_client.completions.create(model=MODEL, prompt="Count from 1 to 20.", max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].model_extra["matched_stop"] is short.choices[0].model_extra["stop_reason"] is None
    last = [c for c in demo_client.chat.completions.create(**base, stop=[stop], stream=True) if c.choices][-1]
    assert last.choices[0].model_extra["matched_stop"] == stop


# ---- 15. /v1/responses logprobs ----------------------------------------------------------------------------
def test_responses_logprobs(demo_client):
    kw = dict(model=MODEL, input="Count to 3.", max_output_tokens=8, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = demo_client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in lps)
    assert "".join(e.token for e in lps).startswith(r.output_text)
    streamed = [e for ev in demo_client.responses.create(**kw, stream=True) if ev.type == "response.output_text.delta"
                     for e in ev.logprobs]
    assert [e.token for e in streamed] == [e.token for e in lps][: len(streamed)] and streamed
    plain = demo_client.responses.create(**{k: v for k, v in kw.items() if k != "include"})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


# ---- 16. history as clients replay it ------------------------------------------------------------------------
def test_replayed_history(demo_client):
    legacy = [{"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
              {"role": "function", "name": "add", "content": "5"}]
    modern = [legacy[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    a = demo_client.chat.completions.create(model=MODEL, messages=legacy, tools=list(MATH_TOOLS), max_tokens=8,
                                            temperature=0)
    b = demo_client.chat.completions.create(model=MODEL, messages=modern, tools=list(MATH_TOOLS), max_tokens=8,
                                            temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message == b.choices[0].message
    first = demo_client.chat.completions.create(model=MODEL, messages=user("Count to 3."), max_tokens=8, temperature=0)
    echoed = first.choices[0].message.model_dump()  # as a client appends it: refusal, annotations, reasoning ...
    echoed.update(annotations=[], refusal=None, reasoning_content="", reasoning="")
    turn = [*user("Count to 3."), echoed, *user("Again.")]
    clean = [*user("Count to 3."), {"role": "assistant", "content": echoed["content"]}, *user("Again.")]
    x = demo_client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0)
    y = demo_client.chat.completions.create(model=MODEL, messages=clean, max_tokens=8, temperature=0)
    assert x.usage.prompt_tokens == y.usage.prompt_tokens and x.choices[0].message == y.choices[0].message


# ---- 18. a body without a JSON Content-Type ------------------------------------------------------------------
def test_body_without_json_content_type(http):
    body = {"prompt": "Count to 3.", "max_tokens": 4, "temperature": 0}
    want = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        r = http.post("/v1/completions", content=json.dumps(body), headers={"content-type": kind})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    r = http.post("/v1/completions", content=b"prompt=hi&max_tokens=2",
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error_shape(r, 400)
    gen = http.post("/generate", content=json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert gen.status_code == 200, gen.text


# ---- the compatibility listing (docs/openai.md): a sample of what it says is ignored or refused ------------------
@pytest.mark.parametrize("field,value", [("min_p", 0.1), ("use_beam_search", False), ("guided_decoding_backend", "x"),
                                         ("guided_whitespace_pattern", " "), ("bad_words", ["x"]),
                                         ("return_tokens_as_token_ids", True), ("structural_tag", "{}")])
def test_listed_as_refused(http, field, value):
    err = assert_error_shape(http.post("/v1/chat/completions", json={"messages": user("x"), field: value}), 400)
    assert err["param"] == field


@pytest.mark.parametrize("field,value", [("service_tier", "auto"), ("reasoning_effort", "low"),
                                         ("include_reasoning", False), ("separate_reasoning", False)])
def test_listed_as_ignored(http, field, value):
    body = {"messages": user("Count to 3."), "max_tokens": 6, "temperature": 0}
    want = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    got = http.post("/v1/chat/completions", json={**body, field: value})
    assert got.status_code == 200 and got.json()["choices"][0]["message"] == want


# ---- bad values of the new fields: a 400 in OpenAI's shape, never a 5xx ------------------------------------------
HOSTILE = [
    ("/v1/chat/completions", {"messages": user("x"), "truncate_prompt_tokens": 1.5}),
    ("/v1/chat/completions", {"messages": user("x"), "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": user("x"), "return_token_ids": "yes"}),
    ("/v1/chat/completions", {"messages": user("x"), "guided_choice": ["a", 3]}),
    ("/v1/chat/completions", {"messages": user("x"), "guided_choice": ["x" * 4000] * 100}),
    ("/v1/chat/completions", {"messages": user("x"), "guided_json": "{not json"}),
    ("/v1/chat/completions", {"messages": user("x"), "structured_outputs": {"json": [1, 2]}}),
    ("/v1/chat/completions", {"messages": user("x"), "structured_outputs": "json"}),
    ("/v1/chat/completions", {"messages": user("x"), "guided_grammar": "root ::= ("}),
    ("/v1/chat/completions", {"messages": [*PREFILL[:1], {"role": "assistant", "content": [{"type": "image_url"}]}],
                              "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": None}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "function_call": {"arguments": "{}"}}]}),
    ("/v1/chat/completions", {"messages": user("x"), "continue_final_message": "true"}),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -7}),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "echo": True, "stream": True, "logprobs": 9}),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}),
    ("/v1/responses", {"input": "x", "top_logprobs": 50, "include": ["message.output_text.logprobs"]}),
    ("/v1/responses", {"input": "x", "include": "message.output_text.logprobs"}),
    ("/v1/responses", {"input": "x", "include": [7]}),
    ("/tokenize", {"messages": user("x"), "continue_final_message": True}),
    ("/tokenize", {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": "no"}),
    ("/generate", {"text": "x", "sampling_params": {"n": 2.5}}),
    ("/generate", {"input_ids": [[1, 2], [3, 2**40]], "sampling_params": {"n": 2}}),
    ("/score", {"items": [{"prompt": [5, -1], "response": [6]}]}),
    ("/score", {"items": [{"prompt": [5], "response": [6, 2**63]}], "estimator": "staircase"}),
    ("/detokenize", {"tokens": [5, 2**63]}),
]


@pytest.mark.parametrize("route,body", HOSTILE)
def test_bad_values_are_400s(http, route, body):
    assert_error_shape(http.post(route, json=body), 400)


def test_bad_form_bodies_are_400s(http):
    for content in (b"[" * 5000, b"{" * 100 + b"}" * 100, b"\xff\xfe", b""):
        r = http.post("/v1/completions", content=content, headers={"content-type": "text/plain"})
        assert_error_shape(r, 400)
    assert http.get("/health").status_code == 200
