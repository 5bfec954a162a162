"""Watching the decoding over HTTP (docs/denoise.md), on a live server with the bundled demo model and an API key:
/generate's `event: denoise` stream, the OpenAI streams' event chunks read through the real openai SDK (whose
content must be exactly what a stream without the flag carries), step maps in both answers, the dials' router
spellings, an aborted stream; then /playground in headless Chromium (scripts/playground_browser.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from live_server import RedraftServer
from optional_tools import missing, need_module
from test_denoise import replay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from playground_browser import CHROMIUM, PROMPT, run_playground  # noqa: E402

KEY = "sk-denoise-test"
TIMEOUT_S = 60
COUNT = "Count from 310 to 345."  # the demo model counts with edits along the way


@pytest.fixture(scope="module")
def count_text() -> str:
    """COUNT as /generate's raw text: through the demo model's chat template."""
    from redraft.engine.text.model_path import BUNDLED_MODEL_DIR
    from redraft.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    return tok.apply_chat_template([{"role": "user", "content": COUNT}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(None, tmp_path_factory.mktemp("denoise-log"), ["--api-key", KEY])
    request.addfinalizer(srv.stop)
    srv.start()
    return srv


@pytest.fixture(scope="module")
def client(server: RedraftServer) -> openai.OpenAI:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server: RedraftServer) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """(event name or None, decoded data) of each SSE event of a body; `[DONE]` kept as the string."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name = next((ln[6:].strip() for ln in block.split("\n") if ln.startswith("event:")), None)
        data = "\n".join(ln[5:].strip() for ln in block.split("\n") if ln.startswith("data:"))
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def check_event_stream(events: list[dict], steps: int, text: str) -> None:
    forwards = [e for e in events if e["event"] == "forward"]
    assert len(forwards) == steps > 0
    assert [e["forward"] for e in forwards] == list(range(1, steps + 1))
    assert events[-1]["committed_text"] == text
    for a, b in zip(events, events[1:]):
        assert b["committed_text"].startswith(a["committed_text"])
        if "window" in b:
            assert b["window"]["offset"] >= a["committed_tokens"]


# ---- /generate ---------------------------------------------------------------------------------------------
def _without_timing(payload: dict) -> dict:
    meta = {k: v for k, v in payload["meta_info"].items()
            if k not in ("id", "e2e_latency", "queue_time", "first_forward")}
    return {**payload, "meta_info": meta}


@pytest.mark.parametrize("sampling", [{"mode": "S"}, {"mode": "Q", "mbe_window": 3}])
def test_generate_streams_a_named_event_per_forward(http: httpx.Client, count_text: str, sampling: dict) -> None:
    body = {"text": count_text, "sampling_params": dict(sampling, max_new_tokens=96)}
    plain = http.post("/generate", json=body).json()
    base = sse_events(http.post("/generate", json=dict(body, stream=True)).text)
    got = sse_events(http.post("/generate", json=dict(body, stream=True, stream_denoise=True)).text)
    data = [d for name, d in got if name is None]
    assert [_without_timing(d) if d != "[DONE]" else d for d in data] == \
           [_without_timing(d) if d != "[DONE]" else d for _, d in base]  # the SGLang chunks are unchanged
    events = [d for name, d in got if name == "denoise"]
    check_event_stream(events, data[-2]["meta_info"]["steps"], plain["text"])
    assert data[-2]["text"] == plain["text"]


def test_generate_step_maps_replay_and_the_flag_in_sampling_params(http: httpx.Client, count_text: str) -> None:
    body = {"text": count_text, "sampling_params": {"mode": "S", "max_new_tokens": 96, "return_step_maps": True}}
    out = http.post("/generate", json=body).json()
    maps = out["meta_info"]["step_maps"]
    assert replay(maps, len(out["output_ids"])) == out["output_ids"]
    assert len({f for f, _ in maps["placed"]}) > 1  # placed over several forwards (edits: tests/test_denoise.py)
    top = http.post("/generate", json={"text": count_text, "return_step_maps": True,
                                       "sampling_params": {"mode": "S", "max_new_tokens": 96}}).json()
    assert top["meta_info"]["step_maps"] == maps
    assert "step_maps" not in http.post("/generate", json={"text": count_text}).json()["meta_info"]


# ---- OpenAI routes through the real SDK ----------------------------------------------------------------------
def _chat_stream(client: openai.OpenAI, model: str, **kw: Any) -> tuple[dict[int, str], list[dict], dict | None]:
    """Per choice its content, every forward/commit event (from the chunks' `diffusion` extra), the usage chunk's
    diffusion figures."""
    content: dict[int, str] = {}
    events, summary = [], None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        extra = (chunk.model_extra or {}).get("diffusion")
        if extra is not None and extra.get("event"):
            events.append(extra)
            assert all(not (c.delta.content or "") for c in chunk.choices)  # an event chunk carries no content
        elif extra is not None:
            summary = extra
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
    return content, events, summary


def test_chat_stream_events_ride_beside_unchanged_content(client: openai.OpenAI, model: str) -> None:
    kw = dict(messages=[{"role": "user", "content": COUNT}], n=2, temperature=0.8, seed=11, max_tokens=96)
    plain = client.chat.completions.create(model=model, **kw, extra_body={"return_step_maps": True})
    usage = {"stream_options": {"include_usage": True}}
    without, none, _ = _chat_stream(client, model, **kw, **usage)
    content, events, summary = _chat_stream(client, model, **kw, **usage, extra_body={"stream_denoise": True})
    assert none == [] and content == without
    assert summary is not None and "step_maps" not in summary
    for choice in plain.choices:
        mine = [e for e in events if e["index"] == choice.index]
        assert content[choice.index] == choice.message.content
        assert mine[-1]["committed_text"].strip() == choice.message.content
    forwards = [e for e in events if e["event"] == "forward"]
    assert len(forwards) == summary["forwards"] == plain.model_extra["diffusion"]["forwards"]
    maps = plain.model_extra["diffusion"]["step_maps"]
    assert len(maps) == 2 and sum(len(m["placed"]) for m in maps) == plain.usage.completion_tokens


def test_completions_stream_with_structured_output_and_a_metadata_dial(client: openai.OpenAI, model: str) -> None:
    """The dial spelt in `metadata` (kept by SGLang's routers) as a string; a regex constrains the output."""
    kw = dict(model=model, prompt="Count from 7 to 30.", max_tokens=64)
    plain = client.completions.create(**kw, extra_body={"regex": "[0-9 ]{4,60}"})
    events, text = [], ""
    dial = {"regex": "[0-9 ]{4,60}", "metadata": {"stream_denoise": "true"}}
    for chunk in client.completions.create(**kw, stream=True, extra_body=dial):
        extra = (chunk.model_extra or {}).get("diffusion")
        if extra is not None and extra.get("event"):
            events.append(extra)
        text += "".join(c.text for c in chunk.choices)
    assert text == plain.choices[0].text
    check_event_stream(events, plain.model_extra["diffusion"]["forwards"], plain.choices[0].text)


def test_responses_stream_carries_the_events_as_their_own_type(client: openai.OpenAI, model: str) -> None:
    """/v1/responses with the dial in extra_body: one `response.diffusion.event` per forward and commit, beside
    text deltas that build the answer the route gives without it."""
    kw = dict(model=model, input=COUNT, temperature=0, max_output_tokens=96)
    plain = client.responses.create(**kw, extra_body={"return_step_maps": True})
    stream = list(client.responses.create(**kw, stream=True, extra_body={"stream_denoise": True}))
    events = [e.diffusion for e in stream if e.type == "response.diffusion.event"]
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == plain.output_text
    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    check_event_stream(events, plain.model_extra["diffusion"]["forwards"], plain.output_text)
    assert sum(len(m["placed"]) for m in plain.model_extra["diffusion"]["step_maps"]) == plain.usage.output_tokens
    quiet = list(client.responses.create(**kw, stream=True))
    assert not any(e.type == "response.diffusion.event" for e in quiet)


def test_a_bad_dial_value_is_refused(http: httpx.Client, model: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                "metadata": {"stream_denoise": "maybe"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.stream_denoise"


def test_an_aborted_stream_and_a_stop_string(http: httpx.Client, count_text: str) -> None:
    """A client that leaves after the first event ends its request (the server goes on serving); a stop string
    (the output side ends the engine request there) cuts the last event's text where it cuts the answer's."""
    body = {"text": count_text, "stream": True, "stream_denoise": True, "sampling_params": {"max_new_tokens": 200}}
    with http.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("event: denoise"):
                break
    stop = {"text": count_text, "sampling_params": {"max_new_tokens": 96, "stop": ["320"]}}
    plain = http.post("/generate", json=stop).json()
    got = sse_events(http.post("/generate", json=dict(stop, stream=True, stream_denoise=True)).text)
    events = [d for name, d in got if name == "denoise"]
    final = [d for name, d in got if name is None][-2]
    assert final["text"] == plain["text"] and "320" not in plain["text"] and plain["text"]
    check_event_stream(events, final["meta_info"]["steps"], plain["text"])


# ---- the playground ----------------------------------------------------------------------------------------
def test_the_playground_is_served_without_a_key(server: RedraftServer) -> None:
    page = httpx.get(f"{server.url}/playground", timeout=TIMEOUT_S)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(f"{server.url}/playground/", timeout=TIMEOUT_S).text == page.text
    head = httpx.head(f"{server.url}/playground", timeout=TIMEOUT_S)  # link checkers, curl -I
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"].startswith("text/html")
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        r = httpx.get(f"{server.url}/playground/{name}", timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.text
    assert "http" not in page.text.replace(">http", "")  # nothing fetched from elsewhere (no CDN)
    assert httpx.get(f"{server.url}/playground/x.js", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=TIMEOUT_S).status_code == 404  # its three files only
    assert httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT_S).status_code == 401  # the API is still keyed


def test_the_playgrounds_default_prompt_shows_s_faster_than_q(server: RedraftServer, http: httpx.Client,
                                                                model: str) -> None:
    """The prompt the page opens with is one where the demo model's S preset takes fewer forwards than Q's for
    the same answer (the product's trade-off, seen at the first click)."""
    page = http.get("/playground/").text
    prompt = page.split('<textarea id="prompt" rows="3">')[1].split("</textarea>")[0]
    answers = {mode: http.post("/v1/chat/completions", json={"model": model, "mode": mode, "max_tokens": 128,
                                                              "messages": [{"role": "user", "content": prompt}]}).json()
               for mode in "SQ"}
    s, q = answers["S"], answers["Q"]
    assert s["choices"][0]["message"]["content"] == q["choices"][0]["message"]["content"]
    assert s["diffusion"]["forwards"] < q["diffusion"]["forwards"]


@pytest.fixture(scope="module")
def browser_ready() -> None:
    """Playwright ([dev]) and Debian's chromium, or a skip that says which is missing (tests/optional_tools.py)."""
    need_module("playwright")
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        missing("Debian's chromium", "apt-get install chromium; .ci/run does this")


def test_playground_runs_a_prompt_in_a_real_browser(server: RedraftServer, http: httpx.Client, model: str,
                                                     browser_ready) -> None:
    got = run_playground(server.url, race=False, mode="Q", api_key=KEY)
    assert got["console_errors"] == [] and got["status"] == "done"
    (column,) = got["columns"]
    assert column["error"] is None and column["done"]
    frames = column["frames"]
    assert any("mask" in f["window"]["states"] for f in frames if f["event"] == "forward")  # the server's
    assert column["framesWithMasks"] > 0  # and the page drew them
    answer = http.post("/v1/chat/completions", json={"model": model, "messages": [
        {"role": "user", "content": PROMPT}], "mode": "Q", "max_tokens": 128}).json()
    want = answer["choices"][0]["message"]["content"]
    assert frames[-1]["committed_text"].strip() == want == column["finalText"]
    assert int(column["counts"]["forwards"]) == answer["diffusion"]["forwards"]


def test_playground_races_s_and_q_side_by_side(server: RedraftServer, http: httpx.Client, model: str,
                                               browser_ready) -> None:
    got = run_playground(server.url, race=True, api_key=KEY)
    assert got["console_errors"] == [] and got["status"] == "done"
    assert [c["title"].split()[0] for c in got["columns"]] == ["S", "Q"]
    for c, mode in zip(got["columns"], "SQ"):
        assert c["framesWithMasks"] > 0
        answer = http.post("/v1/chat/completions", json={"model": model, "messages": [
            {"role": "user", "content": PROMPT}], "mode": mode, "max_tokens": 128}).json()
        counts = c["counts"]
        assert int(counts["forwards"]) == answer["diffusion"]["forwards"] > 0
        assert int(counts["edits"]) == answer["diffusion"]["edits"]
        assert int(counts["tokens"]) == answer["usage"]["completion_tokens"]
        # mid-run, the count is of what the answer will hold: never the block's drafted end-of-text cells
        assert max(c["tokenCounts"]) == answer["usage"]["completion_tokens"]
        assert float(counts["tpf"]) == pytest.approx(int(counts["tokens"]) / int(counts["forwards"]), abs=0.01)
