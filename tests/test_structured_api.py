"""Structured output through the real openai SDK against `redraft serve` on the bundled demo model
(docs/structured-output.md): JSON-schema answers to its held-out math problems, json_object, a regex, forced
tool calls (named and `required`), streaming, /generate; `response_format` text changes nothing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from redraft.training.tasks import MATH_TOOLS, JSON_SUFFIX, eval_set, is_correct

MODEL = "demo_model"
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
PROBLEMS = 60


def _ask(client: openai.OpenAI, text: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=64,
                                          **kw).choices[0]


def test_json_schema_answers_parse_validate_and_are_mostly_right(demo_client) -> None:
    problems = eval_set(0, PROBLEMS, families=("json",), suite="v3")
    with ThreadPoolExecutor(8) as pool:  # concurrent requests: the engine batches them
        choices = list(pool.map(lambda ex: _ask(demo_client, ex.user, response_format=RESPONSE_FORMAT), problems))
    ended = right = 0
    for ex, choice in zip(problems, choices):
        if choice.finish_reason == "stop":  # every answer that ended by itself is valid
            ended += 1
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
        right += is_correct(ex, choice.message.content or "")
    assert ended == len(problems), f"{len(problems) - ended} answers ran out of tokens"
    assert right > len(problems) // 2, f"{right}/{len(problems)} right"


def test_json_schema_without_the_instruction_still_validates(demo_client) -> None:
    """The prompt does not ask for JSON (the model answers `19`): the grammar alone makes it JSON."""
    for q in ("What is 12 + 7?", "What is 40 - 3?", "Sort the list [4, 1, 3]."):
        choice = _ask(demo_client, q, response_format=RESPONSE_FORMAT)
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_json_object_and_streaming(demo_client) -> None:
    text = "What is 21 + 5?" + JSON_SUFFIX
    whole = _ask(demo_client, text, response_format={"type": "json_object"})
    assert isinstance(json.loads(whole.message.content), dict)
    stream = demo_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                 max_tokens=64, response_format={"type": "json_object"}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.message.content


def test_regex_answer_full_matches(demo_client) -> None:
    pattern = r"\[[0-9]+(, [0-9]+)*\]"
    for q in ("Sort the list [5, 2, 9, 1].", "What is 12 + 7?"):
        choice = _ask(demo_client, q, extra_body={"regex": pattern})
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.message.content), choice.message.content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "subtract"}}])
def test_forced_tool_call_has_schema_valid_arguments(demo_client, tool_choice) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in MATH_TOOLS}
    for q in ("What is 12 + 7?", "What is 40 - 3?"):
        choice = _ask(demo_client, q, tools=list(MATH_TOOLS), tool_choice=tool_choice)
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and all(c.function.name in schemas for c in calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in calls] == ["subtract"]
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def test_response_format_text_changes_nothing(demo_client) -> None:
    q = "Reverse the word lantern."
    as_text = _ask(demo_client, q, response_format={"type": "text"}).message.content
    assert as_text == _ask(demo_client, q).message.content


def test_generate_with_json_schema(demo_server) -> None:
    body = {"text": "What is 3 + 4?", "sampling_params": {"json_schema": json.dumps(ANSWER), "max_new_tokens": 32}}
    out = httpx.post(f"{demo_server.url}/generate", json=body, timeout=60).json()
    jsonschema.validate(json.loads(out["text"]), ANSWER)
    assert out["meta_info"]["grammar"]["forced"] > 0  # `{"answer":` is written by the grammar, not the model
