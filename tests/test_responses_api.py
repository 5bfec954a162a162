"""`POST /v1/responses` (OpenAI's Responses API, stateless) against a live server of the bundled model, through
the real `openai` SDK and langchain's `use_responses_api=True`: plain, streamed, a function tool, a JSON schema;
the answer is the chat route's answer to the same conversation; what needs state is a 400 that says so."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from live_server import assert_error_shape
from optional_tools import need_module
from redraft.training.tasks import MATH_TOOLS

MODEL = "demo_model"
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
# the chat tools in the Responses spelling (name and parameters at the top of each tool)
TOOLS = [{"type": "function", **t["function"]} for t in MATH_TOOLS]


def _chat(client: openai.OpenAI, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_plain_answer_is_the_chat_answer(demo_client) -> None:
    r = demo_client.responses.create(model=MODEL, input="What is 12 + 30?", temperature=0, store=False)
    assert r.status == "completed" and r.output_text == "42", r
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    chat = _chat(demo_client, [{"role": "user", "content": "What is 12 + 30?"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    # instructions are the system message; message items are the conversation
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Reverse the word: planet"}]}]
    r = demo_client.responses.create(model=MODEL, input=items, instructions="You are terse.", temperature=0)
    chat = _chat(demo_client, [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Reverse the word: planet"}])
    assert r.output_text == chat.choices[0].message.content


def test_streamed_events_build_the_same_answer(demo_client) -> None:
    q = "Count from 5 to 60."
    whole = demo_client.responses.create(model=MODEL, input=q, temperature=0)
    events = list(demo_client.responses.create(model=MODEL, input=q, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"], kinds
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2, "one delta per committed block: a multi-block answer streams in pieces"
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_function_tool_is_called(demo_client) -> None:
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    r = demo_client.responses.create(model=MODEL, input="What is 40 - 3?", tools=TOOLS, tool_choice="required",
                                     temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name in schemas for c in calls), r.output
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    # the call and its result go back as input items, as a client runs the loop
    follow = [{"role": "user", "content": "What is 40 - 3?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "37"}]
    again = demo_client.responses.create(model=MODEL, input=follow, tools=TOOLS, temperature=0)
    assert again.status in ("completed", "incomplete")
    streamed = list(demo_client.responses.create(model=MODEL, input="What is 40 - 3?", tools=TOOLS,
                                                 tool_choice="required", temperature=0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]


def test_a_json_schema_shapes_the_answer(demo_client) -> None:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    for q in ("What is 12 + 7?", "Reverse the word: planet"):
        r = demo_client.responses.create(model=MODEL, input=q, text=fmt, temperature=0)
        jsonschema.validate(json.loads(r.output_text), ANSWER)
    r = demo_client.responses.create(model=MODEL, input="What is 3 + 4?", text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


def test_dials_and_length(demo_client, demo_server) -> None:
    r = demo_client.responses.create(model=MODEL, input="Count from 5 to 60.", max_output_tokens=8,
                                     extra_body={"mode": "S"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.model_extra["diffusion"]["mode"] == "S"
    bad = httpx.post(demo_server.url + "/v1/responses", json={"input": "hi", "mode": "Z"}, timeout=30)
    assert assert_error_shape(bad, 400)["param"] == "mode"


@pytest.mark.parametrize("body,param,says", [
    ({"input": "hi", "store": True}, "store", "keeps no responses"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "nothing is stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0",
     "'input_image'"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
    ({"input": "hi", "temprature": 1}, "temprature", "unsupported field"),
])
def test_what_needs_state_or_another_model_is_a_400(demo_server, body: dict, param: str, says: str) -> None:
    err = assert_error_shape(httpx.post(demo_server.url + "/v1/responses", json=body, timeout=30), 400)
    assert err["param"] == param and says in err["message"], err


def test_unknown_v1_routes_say_what_exists(demo_server) -> None:
    r = httpx.post(demo_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    err = assert_error_shape(r, 404)
    assert "no embeddings" in err["message"] and "/v1/responses" in err["message"], err
    assert httpx.get(demo_server.url + "/version", timeout=30).json()["version"]


def test_langchain_use_responses_api(demo_server) -> None:
    langchain_openai = need_module("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{demo_server.url}/v1", api_key="unused", temperature=0,
                                           use_responses_api=True, max_retries=0)
    assert llm.invoke("What is 12 + 30?").text == "42"
    assert "".join(chunk.text for chunk in llm.stream("What is 12 + 30?")) == "42"
