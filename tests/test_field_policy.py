"""One field policy on the OpenAI routes, the one vLLM users expect: OpenAI fields that mean nothing here are
accepted and ignored (each said once in the log), an explicit null means absent, a field that is no one's is a
400 naming it, and a content part this text model cannot read is a 400 naming its type."""

from __future__ import annotations


import httpx
import pytest

from live_server import RedraftServer, assert_error_shape

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(request, ckpt, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("policy-log"), [])
    request.addfinalizer(srv.stop)
    return srv.start()


def _post(srv: RedraftServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, trust_env=False)


IGNORED = {"store": False, "service_tier": "auto", "reasoning_effort": "low", "metadata": {"team": "a"},
           "user": "u-1", "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low"}


def test_fields_that_mean_nothing_here_are_accepted_and_said_once(server) -> None:
    for _ in range(2):
        r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "parallel_tool_calls": True,
                                                   **IGNORED})
        assert r.status_code == 200, r.text
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **IGNORED})
        assert r.status_code == 200, r.text
    log = server.log_tail(500_000)
    for name in ("service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier"):
        assert log.count(f"the request field '{name}' is accepted and ignored") == 1, name


def test_explicit_nulls_mean_absent(server) -> None:
    nulls = {"logprobs": None, "n": None, "stream": None, "stop": None, "seed": None, "temperature": None,
             "stream_options": None, "tools": None, "tool_choice": None, "response_format": None}
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "echo": None, "logprobs": None,
                                          "n": None, "stream": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_legacy_functions_are_tools(server) -> None:
    fn = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "functions": [fn]})
    assert r.status_code == 200, r.text
    both = _post(server, "/v1/chat/completions", {"messages": CHAT, "functions": [fn],
                                                  "tools": [{"type": "function", "function": fn}]})
    assert assert_error_shape(both, 400)["param"] == "functions"


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/chat/completions", {"messages": CHAT, "temprature": 0.5}, "temprature", "unsupported field"),
    ("/v1/completions", {"prompt": "hi", "max_tokenz": 3}, "max_tokenz", "unsupported field"),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, "store", "store=true is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content", "content parts of type 'image_url' are not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages.0.content", "'input_audio'"),
])
def test_what_is_no_ones_is_a_400_naming_it(server, path: str, body: dict, param: str, says: str) -> None:
    err = assert_error_shape(_post(server, path, body), 400)
    assert err["param"] == param and says in err["message"], err
    assert not err["message"].startswith("Value error"), err


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_continuous_usage_stats_puts_usage_on_every_chunk(server, path: str, body: dict) -> None:
    import json

    req = {**body, "max_tokens": 70, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = []
    with httpx.stream("POST", server.url + path, json=req, timeout=60, trust_env=False) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    with_choices = [c for c in chunks if c["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert len(counts) >= 3 and counts == sorted(counts) and counts[-1] == 70, counts
    prompt = with_choices[0]["usage"]["prompt_tokens"]
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in with_choices)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 70
