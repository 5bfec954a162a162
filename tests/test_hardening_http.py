"""Hardening of the HTTP process (issue 24, items 5, 7, 8, 10, 11) against a live `redraft serve` on the bundled
demo model: a streamed choice finishes exactly once; the text routes never stall the event loop; deep nesting is
a 400 naming the field; request ids are scoped per API key; one Authorization header; bounded non-streamed
logprobs; strict logit_bias keys and token ids; the matched EOS trimmed from the text. Every refusal is an error
in OpenAI's shape and a log line naming the request."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from live_server import RedraftServer, assert_error_shape

KEY_A, KEY_B, ADMIN = "sk-user-a", "sk-user-b", "sk-admin-1"
MODEL = "demo_model"
ENDLESS = {"max_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(request, tmp_path_factory) -> RedraftServer:
    server = RedraftServer(None, tmp_path_factory.mktemp("hard-http"),
                           ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-api-key", ADMIN, "--log-level", "info"])
    request.addfinalizer(server.stop)
    return server.start()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def http(srv) -> httpx.Client:
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False, headers=_auth(KEY_A)) as client:
        yield client


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _sse_events(lines) -> list:
    """The data events of an SSE stream: parsed JSON objects, and the string "[DONE]"."""
    events = []
    for line in lines:
        if line == "data: [DONE]":
            events.append("[DONE]")
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events


# ---- item 5: a streamed choice finishes once, and nothing follows its finish ----------------------------------
def _check_choices(events: list, chat: bool) -> dict[int, int]:
    """Per choice index, how many finish_reasons it got; fails on content after a choice's finish."""
    finishes: dict[int, int] = {}
    for ev in events:
        if ev == "[DONE]" or "error" in ev:
            continue
        for c in ev["choices"]:
            i = c["index"]
            text = (c["delta"].get("content") or "") if chat else c["text"]
            lp = c.get("logprobs")
            assert not (finishes.get(i) and (text or (lp and (lp.get("content") or lp.get("tokens"))))), \
                f"choice {i} got content after its finish: {c}"
            if c["finish_reason"] is not None:
                finishes[i] = finishes.get(i, 0) + 1
    return finishes


def _mixed_request(rng: random.Random, k: int) -> tuple[str, dict, bool]:
    """(path, body, abort early) of a random streamed request."""
    chat = rng.random() < 0.6
    body: dict = {"stream": True, "n": rng.randint(1, 4), "max_tokens": rng.choice([16, 24, 40, 64]),
                  "temperature": rng.choice([0.0, 0.8]), "seed": k}
    prompt = rng.choice([f"Write a Python function named f{k} that adds two numbers.", "Count from 1 to 30.",
                         f"What is {k} + {k}?", "Name three colors.", "Give a JSON object with a name and an age."])
    if chat:
        body["messages"] = _user(prompt)
    else:
        body["prompt"] = prompt
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["\n"], [","], ["5", "def"], [" "]])
    if rng.random() < 0.3:
        body["mbe_window"] = 2
    if rng.random() < 0.15:
        body["response_format"] = {"type": "json_object"}
    if rng.random() < 0.2:
        body["logprobs"] = True if chat else 2
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, rng.random() < 0.1


@pytest.mark.slow
def test_streamed_choices_finish_exactly_once(srv) -> None:
    """A few hundred mixed streamed requests (chat and completions, n 1..4, stop strings, MBE, json_object,
    logprobs, some abandoned by their client) at concurrency 32: each choice of a finished stream has exactly one
    finish and nothing after it, and every stream that was read to the end ends with [DONE]."""
    rng = random.Random(24)
    jobs = [_mixed_request(rng, k) for k in range(200)]
    failures: list[str] = []
    done_streams = 0

    async def one(client: httpx.AsyncClient, sem: asyncio.Semaphore, path: str, body: dict, abort: bool) -> None:
        nonlocal done_streams
        chat = path.endswith("chat/completions")
        async with sem:
            async with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200, (r.status_code, await r.aread())
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if abort and len(lines) >= 3:
                        break  # the connection is closed here: the server aborts the engine requests
            events = _sse_events(lines)
            try:
                finishes = _check_choices(events, chat)
                if not abort:
                    assert events and events[-1] == "[DONE]", events[-3:]
                    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
                    assert finishes == {i: 1 for i in range(body["n"])}, (finishes, body)
                    done_streams += 1
                else:
                    assert all(v == 1 for v in finishes.values()), finishes
            except AssertionError as exc:
                failures.append(f"{path} {body}: {exc}")

    async def main() -> None:
        sem = asyncio.Semaphore(32)
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, trust_env=False, headers=_auth(KEY_A),
                                     limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*[one(client, sem, *job) for job in jobs]), 170)

    start = time.monotonic()
    asyncio.run(main())
    assert not failures, f"{len(failures)} bad streams, e.g. {failures[:3]}"
    assert done_streams >= 150
    assert time.monotonic() - start < 170


def test_the_issue_stream_finishes_each_choice_once(http) -> None:
    """The issue's reproduction (n 3, 16 tokens), a few times: one finish per choice, nothing after it."""
    body = {"messages": _user("Write a Python function named f24 that adds two numbers."), "n": 3,
            "max_tokens": 16, "stream": True, "temperature": 0.8, "seed": 5}
    for _ in range(5):
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = _sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert _check_choices(events, chat=True) == {0: 1, 1: 1, 2: 1}


# ---- item 7: the text routes run off the event loop, bounded before they start ---------------------------
def _max_chars(http: httpx.Client) -> int:
    """The longest text /tokenize takes: found from its own refusal of a too long one (a 400 that names it)."""
    r = http.post("/tokenize", json={"prompt": "x" * 300_000})
    err = assert_error_shape(r, 400)
    assert err["code"] == "context_length_exceeded"
    return int(err["message"].split("no text longer than ")[1].split()[0])


def test_live_answers_fast_while_text_routes_are_hammered(srv, http) -> None:
    limit = _max_chars(http)
    ids = [random.Random(1).randrange(1000) for _ in range(131072)]  # the most /detokenize takes
    assert http.post("/detokenize", json={"tokens": ids}).status_code == 200
    text = "".join(random.Random(2).choice("ab {}:,\n") for _ in range(limit - 200))
    tool_msgs = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}]}]
    bodies = [("/detokenize", {"tokens": ids}), ("/tokenize", {"prompt": text}),
              ("/tokenize", {"messages": tool_msgs})]
    for path, body in bodies:
        assert http.post(path, json=body).status_code == 200, path
    stop = threading.Event()
    errors: list[str] = []

    def hammer(path: str, body: dict) -> None:
        raw = json.dumps(body).encode()  # encoded once: the probe's timing is the server's, not this process's
        headers = {**_auth(KEY_A), "content-type": "application/json"}
        with httpx.Client(base_url=srv.url, timeout=30, trust_env=False, headers=headers) as c:
            while not stop.is_set():
                r = c.post(path, content=raw)
                if r.status_code != 200:
                    errors.append(f"{path}: {r.status_code}")

    threads = [threading.Thread(target=hammer, args=b, daemon=True) for b in bodies]
    for t in threads:
        t.start()
    slow = []
    try:
        time.sleep(0.5)
        with httpx.Client(base_url=srv.url, timeout=10, trust_env=False) as probe:
            end = time.monotonic() + 5.0
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert probe.get("/live").status_code == 200
                took = time.monotonic() - t0
                if took >= 0.5:
                    slow.append(round(took, 3))
                time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert not slow, f"/live took {slow} s while the text routes were busy"


def test_tokenize_counts_every_string_of_a_message(http) -> None:
    """Tool call arguments count toward /tokenize's limit: 6 MB of them are refused before rendering."""
    limit = _max_chars(http)
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * (limit + 1)}}]}]
    t0 = time.monotonic()
    err = assert_error_shape(http.post("/tokenize", json={"messages": msgs}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    msgs[0]["tool_calls"][0]["function"]["arguments"] = "a" * 6_000_000
    err = assert_error_shape(http.post("/tokenize", json={"messages": msgs}), 400)
    assert err["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 5.0


def test_detokenize_is_capped_and_takes_only_integers(http) -> None:
    err = assert_error_shape(http.post("/detokenize", json={"tokens": [1] * 131073}), 400)
    assert err["param"] == "tokens" and "131072" in err["message"]
    for bad in ([True, False], [1.0], ["1"]):
        err = assert_error_shape(http.post("/detokenize", json={"tokens": bad}), 400)
        assert err["param"].startswith("tokens"), err
    assert http.post("/detokenize", json={"tokens": [40, 41]}).json()["prompt"]


# ---- item 8: deep nesting is a 400 that names the field --------------------------------------------------
def _nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def test_deep_nesting_is_a_400_naming_the_field(srv, http) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(450)}}  # ~900 levels
    r = http.post("/v1/chat/completions", json={"messages": _user("hi"), "tools": [tool], "max_tokens": 4},
                  headers={"X-Request-Id": "deep-tools"})
    err = assert_error_shape(r, 400)
    assert err["code"] == "nesting_too_deep"
    assert err["param"].startswith("tools.0.function.parameters"), err
    deep: list = []
    for _ in range(900):
        deep = [deep]
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi", "extra": deep}]})
    err = assert_error_shape(r, 400)
    assert err["code"] == "nesting_too_deep" and err["param"].startswith("messages.0.extra"), err
    # beyond what Python's json module parses at all: still a 400 in OpenAI's shape
    r = http.post("/v1/completions", content=b"[" * 200_000 + b"]" * 200_000,
                  headers={"content-type": "application/json"})
    assert_error_shape(r, 400)
    # deep JSON inside a string (tool call arguments are parsed for the template): a 400, never a 500
    for args in ("[" * 500 + "]" * 500, "[" * 100_000 + "]" * 100_000):
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]
        err = assert_error_shape(http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}), 400)
        assert err["param"] == "messages", err
    # a schema of ordinary depth is served
    tool["function"]["parameters"] = _nested(8)  # 25 levels in all
    r = http.post("/v1/chat/completions", json={"messages": _user("hi"), "tools": [tool], "max_tokens": 4})
    assert r.status_code == 200, r.text[:300]
    assert "deep-tools" in srv.log_tail(200_000)  # the refusal is logged with its request id


# ---- item 10: request ids scoped per API key ---------------------------------------------------------------
def _open_endless_stream(url: str, key: str, rid: str, path: str = "/v1/chat/completions"):
    """Start a long streamed request and read its first event; returns (client, response context, stream)."""
    client = httpx.Client(base_url=url, timeout=60, trust_env=False, headers=_auth(key))
    if path == "/generate":
        body = {"text": "hi", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        headers = {}
    else:
        body = {"messages": _user("hi"), "stream": True, **ENDLESS}
        headers = {"X-Request-Id": rid}
    ctx = client.stream("POST", path, json=body, headers=headers)
    resp = ctx.__enter__()
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    next(line for line in lines if line.startswith("data: "))
    return client, ctx, resp, lines


def _close(client, ctx) -> None:
    ctx.__exit__(None, None, None)
    client.close()


def test_request_ids_are_scoped_per_api_key(srv) -> None:
    a = httpx.Client(base_url=srv.url, timeout=60, trust_env=False, headers=_auth(KEY_A))
    b = httpx.Client(base_url=srv.url, timeout=60, trust_env=False, headers=_auth(KEY_B))
    short = {"messages": _user("hi"), "max_tokens": 4}
    held = _open_endless_stream(srv.url, KEY_A, "target")
    try:
        # B may use A's id (no oracle, no denial), and sees its own id everywhere
        r = b.post("/v1/chat/completions", json=short, headers={"X-Request-Id": "target"})
        assert r.status_code == 200, r.text[:300]
        assert r.headers["x-request-id"] == "target" and r.json()["id"] == "chatcmpl-target"
        r = b.post("/generate", json={"text": "hi", "rid": "target-0", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["meta_info"]["id"] == "target-0"
        # A reusing its own running id is refused, naming that id (not the engine's scoped one)
        err = assert_error_shape(a.post("/v1/chat/completions", json=short, headers={"X-Request-Id": "target"}), 400)
        assert err["code"] == "duplicate_request_id" and err["message"] == "request id 'target-0' is already in flight"
    finally:
        _close(held[0], held[1])
    # B holding "target-0" does not stop A's chat with X-Request-Id target
    held = _open_endless_stream(srv.url, KEY_B, "target-0", "/generate")
    try:
        r = a.post("/v1/chat/completions", json=short, headers={"X-Request-Id": "target"})
        assert r.status_code == 200, r.text[:300]
    finally:
        _close(held[0], held[1])
    a.close()
    b.close()


def test_the_admin_aborts_by_the_id_the_user_sees(srv) -> None:
    client, ctx, resp, lines = _open_endless_stream(srv.url, KEY_A, "cut-me")
    try:
        r = httpx.post(srv.url + "/abort_request", json={"rid": "cut-me-0"}, headers=_auth(ADMIN), timeout=10,
                       trust_env=False)
        assert r.status_code == 200
        events = _sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_aborted", events[-3:]
    finally:
        _close(client, ctx)


def test_one_authorization_header_or_a_400(srv) -> None:
    for order in ((KEY_A, "WRONG"), ("WRONG", KEY_A), (KEY_A, KEY_A)):
        headers = [("Authorization", f"Bearer {order[0]}"), ("Authorization", f"Bearer {order[1]}")]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers,
                       timeout=30, trust_env=False)
        err = assert_error_shape(r, 400)
        assert err["code"] == "duplicate_authorization" and err["param"] == "authorization"


# ---- item 11 -------------------------------------------------------------------------------------------------
def test_a_huge_non_streamed_logprobs_answer_is_refused(http) -> None:
    body = {"messages": _user("hi"), "n": 16, "max_tokens": 1000, "logprobs": True, "top_logprobs": 20}
    err = assert_error_shape(http.post("/v1/chat/completions", json=body), 400)
    assert err["code"] == "response_too_large" and err["param"] == "n", err
    err = assert_error_shape(http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 16, "max_tokens": 1000,
                                                                "logprobs": 5}), 400)
    assert err["code"] == "response_too_large", err
    small = {"messages": _user("hi"), "n": 2, "max_tokens": 8, "logprobs": True, "top_logprobs": 5}
    r = http.post("/v1/chat/completions", json=small)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5


@pytest.mark.parametrize("key", [" 7", "7 ", "\u0661\u0662", "+7", "-1", "0x7", "7.0", ""])
def test_logit_bias_keys_are_ascii_digits(http, key) -> None:
    err = assert_error_shape(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                "logit_bias": {key: 5}}), 400)
    assert err["param"] == "logit_bias", err
    err = assert_error_shape(http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "logit_bias": {key: 5}}}), 400)
    assert err["param"] == "sampling_params.logit_bias", err


def test_logit_bias_with_a_plain_id_is_served(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {"7": 5}})
    assert r.status_code == 200, r.text[:300]


def test_the_tokenizer_routes_check_the_model(http) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [40]})):
        err = assert_error_shape(http.post(path, json={**body, "model": "no-such-model"}), 404)
        assert err["code"] == "model_not_found"
        assert http.post(path, json={**body, "model": MODEL}).status_code == 200


def test_the_matched_eos_is_trimmed_unless_no_stop_trim(http) -> None:
    eos = http.get("/tokenizer_info").json()["eos_token"]
    base = {"text": "What is 2 + 3?", "sampling_params": {"max_new_tokens": 64, "skip_special_tokens": False}}
    out = http.post("/generate", json=base).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    eos_id = out["meta_info"]["finish_reason"]["matched"]
    assert out["output_ids"][-1] == eos_id  # the ids keep it (as SGLang's)
    assert not out["text"].endswith(eos), out["text"]
    kept = http.post("/generate", json={**base, "sampling_params": {**base["sampling_params"],
                                                                    "no_stop_trim": True}}).json()
    assert kept["text"].endswith(eos), kept["text"]
    chat = http.post("/v1/chat/completions", json={"messages": _user("What is 2 + 3?"), "max_tokens": 64,
                                                   "skip_special_tokens": False}).json()
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert not chat["choices"][0]["message"]["content"].endswith(eos)


def test_refusals_are_logged_with_the_request_id(srv, http) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {" 7": 1}},
                  headers={"X-Request-Id": "refused-logit-bias"})
    assert_error_shape(r, 400)
    r = http.post("/v1/completions", json={"prompt": "hi", "temperature": 9},
                  headers={"X-Request-Id": "refused-validation"})
    assert_error_shape(r, 400)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False, timeout=30,
                   headers={"X-Request-Id": "refused-auth", **_auth("WRONG")})
    assert_error_shape(r, 401)
    deadline = time.monotonic() + 5
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = srv.log_tail(400_000).splitlines()
        if all(any(rid in line for line in lines) for rid in ("refused-logit-bias", "refused-validation",
                                                              "refused-auth")):
            break
        time.sleep(0.2)
    for rid, reason in (("refused-logit-bias", "logit_bias"), ("refused-validation", "temperature"),
                        ("refused-auth", "invalid_api_key")):
        assert any(rid in line and reason in line for line in lines), (rid, [l for l in lines if rid in l])
