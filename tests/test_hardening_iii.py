"""Hardening III (issue 37) against a live `redraft serve` on the bundled demo model, with bystanders whose
answers must not change and whose requests must stay within a stated time: request ids and logged strings
(item 6), a non-object `text.format` (7), strict booleans and the playground's headers (10)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from bystanders import MODEL, Bystanders
from live_server import RedraftServer, assert_error_shape

BYSTANDER_BOUND_S = 20.0  # a 16-token bystander answer on a shared 2-core machine; alone it takes well under 2 s


@pytest.fixture(scope="module")
def srv(request, tmp_path_factory) -> RedraftServer:
    server = RedraftServer(None, tmp_path_factory.mktemp("hard-iii"), ["--log-level", "info", "--cpu-threads", "1"])
    request.addfinalizer(server.stop)
    return server.start()


@pytest.fixture(scope="module")
def http(srv) -> httpx.Client:
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as client:
        yield client


def _log_size(srv: RedraftServer) -> int:
    return srv.log_path.stat().st_size


# ---- item 6: /generate's rid is checked as X-Request-Id is; every logged string is one bounded line -----------
@pytest.mark.parametrize("rid", ["a\nFORGED request ok", "x" * 129, "", "a b", "ü"],
                         ids=["newline", "129-chars", "empty", "space", "non-ascii"])
def test_a_generate_rid_is_checked_like_x_request_id(http, rid) -> None:
    r = http.post("/generate", json={"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 4}})
    err = assert_error_shape(r, 400)
    assert err["param"] == "rid", err
    assert "X-Request-Id" in err["message"], err


def test_a_plain_rid_is_served_and_echoed(http) -> None:
    r = http.post("/generate", json={"text": "hi", "rid": "job-7.a:b_c", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "job-7.a:b_c"


@pytest.mark.slow
def test_huge_and_multiline_strings_reach_the_log_as_one_bounded_line(srv, http) -> None:
    before = _log_size(srv)
    with Bystanders(srv.url, n=1) as bystanders:
        t0 = time.monotonic()
        for k in range(10):  # a 7 MB rid, and a 7 MB unknown field name that the refusal quotes
            assert_error_shape(http.post("/generate", json={"text": "hi", "rid": "r" * 7_000_000}), 400)
            huge_field = f"FORGED{k}\n" + "y" * 7_000_000
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], huge_field: 1})
            assert_error_shape(r, 400)
            assert len(r.content) < 2000, len(r.content)  # the field's name is not echoed whole either
        forged = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                           "content": "hi"}], "x\nFORGED request ok": 1}, headers={"X-Request-Id": "forger-1"})
        assert_error_shape(forged, 400)
        elapsed = time.monotonic() - t0
    bystanders.check(max_latency_s=BYSTANDER_BOUND_S)
    time.sleep(0.5)
    grown = _log_size(srv) - before
    assert grown < 200_000, f"21 refusals wrote {grown} bytes of log"  # was 67 MiB for ten
    log = srv.log_tail(10**6)
    assert not any(line.startswith("FORGED") for line in log.splitlines()), log[-3000:]
    line = next(ln for ln in log.splitlines() if "request forger-1 " in ln)
    assert "x\\nFORGED" in line, line
    assert elapsed < 120, elapsed


# ---- item 7: text.format that is not an object is a 400; the connection lives on ------------------------------
@pytest.mark.parametrize("fmt", ["json_object", ["json_object"], 3, True])
def test_a_text_format_that_is_not_an_object_is_a_400(http, fmt) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4,
                                         "text": {"format": fmt}})
    err = assert_error_shape(r, 400)
    assert err["param"] == "text.format", err
    # the same keep-alive connection serves the next request
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4})
    assert r.status_code == 200, r.text


def test_a_failure_inside_a_route_is_a_json_500_and_the_connection_lives_on(srv) -> None:
    """A bug's 500 (here: a response format the route does not expect, reached by a raw HTTP/1.1 connection)
    must be JSON in OpenAI's shape, and keep-alive must survive it: two requests on one socket."""
    body = b'{"model": "demo_model", "input": "hi", "max_output_tokens": 4, "text": {"format": "x"}}'
    request = (b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(request + b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        got = b""
        deadline = time.monotonic() + 30
        while got.count(b"HTTP/1.1 ") < 2 and time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 400"), got[:500]
    assert b"HTTP/1.1 200" in got.split(b"\r\n\r\n", 1)[1], got[:1000]


# ---- item 10: strict booleans; the playground's headers ---------------------------------------------------------
@pytest.mark.parametrize("value", [1, "true", "yes", "on", 1.0])
def test_store_and_other_flags_take_only_json_booleans(http, value) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": value})
    err = assert_error_shape(r, 400)
    assert err["param"] == "store", err
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "stream": value})
    assert assert_error_shape(r, 400)["param"] == "stream"
    r = http.post("/generate", json={"text": "hi", "return_logprob": value})
    assert assert_error_shape(r, 400)["param"] == "return_logprob"
    r = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": value})
    assert assert_error_shape(r, 400)["param"] == "add_special_tokens"


def test_store_false_and_true_flags_still_work(http) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": False, "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    assert_error_shape(http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": True}), 400)


def test_the_playground_forbids_framing_sniffing_and_foreign_scripts(http) -> None:
    for path in ("/playground/", "/playground/playground.js", "/playground/playground.css"):
        r = http.get(path)
        assert r.status_code == 200, path
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp


# ---- item 9: allowed hosts; no state change from another site's page --------------------------------------------
def test_a_rebound_host_name_is_refused_and_loopback_names_are_served(srv) -> None:
    with Bystanders(srv.url, n=1) as bystanders, httpx.Client(timeout=30, trust_env=False) as c:
        for host in ("evil.example", "attacker.test:%d" % srv.port, "localhost.evil.example"):
            for method, path in (("GET", "/v1/models"), ("POST", "/flush_cache"), ("GET", "/live")):
                r = c.request(method, srv.url + path, headers={"Host": host})
                err = assert_error_shape(r, 400)
                assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"], err
        for host in (f"localhost:{srv.port}", "127.0.0.1", f"[::1]:{srv.port}", "LOCALHOST."):
            assert c.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    bystanders.check(max_latency_s=BYSTANDER_BOUND_S)


@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                                     {"Sec-Fetch-Site": "same-site"}, {"Origin": "null"},
                                     {"Origin": "http://localhost:1", "Content-Type": "text/plain"}],
                         ids=["origin", "fetch-cross", "fetch-same-site", "null-origin", "other-port"])
def test_a_page_of_another_site_cannot_change_state(srv, http, headers) -> None:
    for path, body in (("/flush_cache", None), ("/abort_request", '{"rid": "x"}'),
                       ("/v1/chat/completions", '{"model": "demo_model", "messages": []}')):
        r = http.post(path, content=body, headers=headers)
        err = assert_error_shape(r, 403)
        assert err["code"] == "cross_site_request", err
    log = srv.log_tail(10**6)
    assert "Cache flushed" not in log


def test_same_origin_pages_and_plain_clients_still_change_state(srv, http) -> None:
    origin = f"http://127.0.0.1:{srv.port}"
    for headers in ({}, {"Origin": origin}, {"Sec-Fetch-Site": "same-origin", "Origin": origin},
                    {"Sec-Fetch-Site": "none"}):
        assert http.post("/flush_cache", headers=headers).status_code == 200, headers
    # a text/plain JSON body (curl -d) is read as JSON for a plain client, and refused from another site's page
    body = b'{"model": "demo_model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    assert http.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"}).status_code == 200
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain",
                                                                  "Origin": "http://evil.example"})
    assert assert_error_shape(r, 403)["code"] == "cross_site_request"


# ---- item 2: large legal bodies: item caps named in the 400, parsing off the event loop ------------------------
def _tool_call_chat(n: int) -> dict:
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(n)]
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": None, "tool_calls": calls}]}


def _function_call_items(n: int) -> dict:
    return {"model": MODEL, "max_output_tokens": 4, "input": [
        {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(n)]}


class LiveProbe:
    """GET /live every 50 ms on its own connection; `worst` is the longest answer."""

    def __init__(self, url: str):
        import threading

        self.url, self.times, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60, trust_env=False) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                assert c.get("/live").status_code == 200
                self.times.append(time.monotonic() - t0)
                time.sleep(0.05)

    def __enter__(self) -> "LiveProbe":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)

    @property
    def worst(self) -> float:
        return max(self.times)


LIVE_BOUND_S = 1.5  # /live under eight 6 MiB bodies at once (was 7.8-9.7 s); alone it answers in milliseconds


@pytest.mark.slow
def test_huge_item_counts_are_refused_naming_the_limit(http) -> None:
    for route, body in (("/v1/chat/completions", _tool_call_chat(80_000)), ("/v1/responses",
                                                                            _function_call_items(80_000))):
        r = http.post(route, json=body)
        err = assert_error_shape(r, 400)
        assert err["code"] == "too_many_items" and "--max-request-items" in err["message"], err
    r = http.post("/v1/chat/completions", json=_tool_call_chat(129))  # per message: as many as tools may name
    err = assert_error_shape(r, 400)
    assert err["param"] == "messages.1.tool_calls" and "128" in err["message"], err
    r = http.post("/v1/chat/completions", json=_tool_call_chat(128))  # past validation: only the context refuses
    assert assert_error_shape(r, 400)["code"] == "context_length_exceeded", r.text
    assert http.post("/v1/chat/completions", json=_tool_call_chat(16)).status_code == 200


@pytest.mark.slow
def test_large_bodies_leave_live_and_a_bystander_stream_responsive(srv) -> None:
    import concurrent.futures as cf
    import json as _json

    huge = _json.dumps(_tool_call_chat(80_000)).encode()  # about 6 MiB
    assert len(huge) > 6 * 2**20 - 2**19, len(huge)
    legal = _json.dumps({"model": MODEL, "max_tokens": 4, "messages": [  # at the cap, and over the context
        {"role": "user", "content": [{"type": "text", "text": "x" * 700}] * 4} for _ in range(2000)]}).encode()

    def post(body: bytes) -> int:
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
            return c.post("/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"}).status_code

    with Bystanders(srv.url, n=1, max_tokens=32) as bystanders, LiveProbe(srv.url) as probe:
        time.sleep(0.5)
        with cf.ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(post, [huge] * 8 + [legal] * 4))
        time.sleep(0.5)
    assert statuses == [400] * 12, statuses
    assert probe.worst < LIVE_BOUND_S, f"/live took {probe.worst:.2f}s"
    bystanders.check(max_latency_s=BYSTANDER_BOUND_S, max_gap_s=5.0)
