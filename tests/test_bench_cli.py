"""`redraft bench` end to end: against a live `redraft serve` (tiny checkpoint, 127.0.0.1) at two concurrencies
(JSON + PNG), without matplotlib (JSON, a clear message, no PNG), and against a plain OpenAI-compatible server
that is not redraft (a stand-in that accepts only OpenAI's fields, as strict servers do)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from live_server import RedraftServer

httpx = pytest.importorskip("httpx")
from fastapi import Request  # noqa: E402 - the stand-in server's route annotation, resolved at module level

from redraft.clients.bench import make_prompts  # noqa: E402
from redraft.clients.loadgen import percentile  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GROUP_FIELDS = {"requests", "completed", "failed", "output_tokens", "output_tok_per_s", "req_per_s", "ttft_ms_p50",
                "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99",
                "tokens_per_forward", "errors"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench(args: list[str], env: dict | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "redraft", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ))


@pytest.fixture(scope="module")
def server(request, ckpt, tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("bench-server")
    srv = RedraftServer(ckpt, tmp, [])
    request.addfinalizer(srv.stop)  # registered first: a failed start is cleaned up too
    return srv.start().url


def test_sse_events_yields_events_and_raises_server_errors(server):
    """The stream reader both benchmark clients use, against the live server: events of a good stream up to
    [DONE]; a 400 and an unknown model as StreamError with the status, never a hang."""
    from redraft.clients.sse import StreamError, sse_events

    async def collect(body: dict) -> list[dict]:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            return [e async for e in sse_events(client, server + "/v1/completions", body, {})]

    events = asyncio.run(collect({"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}))
    assert events and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    with pytest.raises(StreamError, match="HTTP 400"):
        asyncio.run(collect({"model": "tiny", "prompt": "hello", "max_tokens": -1, "stream": True}))
    with pytest.raises(StreamError, match="HTTP 404"):
        asyncio.run(collect({"model": "no-such-model", "prompt": "hello", "stream": True}))


def test_helpers():
    assert percentile([], 50) is None and percentile([2.0], 99) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    a = make_prompts(["code", "math", "chat", "weather"], 8, seed=3, prefix_words=(0, 4), output_len=(8, 16))
    assert a == make_prompts(["code", "math", "chat", "weather"], 8, seed=3, prefix_words=(0, 4), output_len=(8, 16))
    assert [p.domain for p in a] == ["code", "math", "chat", "weather"] * 2
    assert all(8 <= p.max_tokens <= 16 for p in a)
    assert "Python function" in a[0].text and a[1].text.rstrip("?").split()[-1].isdigit()  # demo task suite


def test_two_concurrencies_json_and_png(server, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    res = _bench(["--base-url", server, "--concurrency", "1", "3", "--num-requests", "6", "--output-len", "16", "48",
                  "--max-seconds", "120", "--json", str(out), "--plot", str(png)])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["server_kind"] == "redraft" and report["config"]["modes"] == ["S", "Q"]
    assert [lv["load"] for lv in report["levels"]] == [{"concurrency": 1}, {"concurrency": 3}]
    for lv in report["levels"]:
        o = lv["overall"]
        assert GROUP_FIELDS <= o.keys()
        assert o["requests"] == o["completed"] == 6 and o["failed"] == 0 and o["errors"] == {}
        assert o["output_tok_per_s"] > 0 and o["tokens_per_forward"] > 0
        assert 0 < o["ttft_ms_p50"] <= o["e2e_ms_p50"] and o["e2e_ms_p50"] <= o["e2e_ms_p90"] <= o["e2e_ms_p99"]
        # 6 requests over 3 domains x 2 modes: one per (domain, mode), each with the server's tokens per forward
        assert {(g["domain"], g["mode"]) for g in lv["groups"]} == {
            (d, m) for d in ("code", "math", "chat") for m in ("S", "Q")}
        assert all(g["completed"] == 1 and g["tokens_per_forward"] > 0 for g in lv["groups"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| c=1 | all | all | 6/6 |" in res.stdout


def test_without_matplotlib_json_and_a_message(server, tmp_path):
    fake = tmp_path / "nompl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    res = _bench(["--base-url", server, "--concurrency", "2", "--num-requests", "2", "--output-len", "8", "16",
                  "--warmup", "0", "--json", str(out), "--plot", str(png)], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(out.read_text())["levels"][0]["overall"]["completed"] == 2
    assert not png.exists() and "matplotlib is not installed" in res.stderr

# ---- a server that is not redraft -------------------------------------------------------------------------------
OPENAI_FIELDS = {"model", "messages", "max_tokens", "temperature", "stream", "stream_options"}


def _plain_openai_app(seen: list[dict]):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain-model", "object": "model", "owned_by": "vllm"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        unknown = set(body) - OPENAI_FIELDS
        if unknown:  # a strict server refuses fields it does not know
            return JSONResponse({"error": {"message": f"unknown fields {sorted(unknown)}"}}, status_code=400)

        async def events():
            n = body["max_tokens"]
            for i in range(n):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'length'}]})}\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_plain_openai_server(tmp_path):
    uvicorn = pytest.importorskip("uvicorn")
    seen: list[dict] = []
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(_plain_openai_app(seen), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the stand-in server did not start"
            time.sleep(0.05)
        out = tmp_path / "plain.json"
        res = _bench(["--base-url", f"http://127.0.0.1:{port}", "--request-rate", "20", "--num-requests", "8",
                      "--max-seconds", "30", "--output-len", "4", "12", "--domains", "code,chat", "--json", str(out)])
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    finally:
        srv.should_exit = True
        thread.join(10)
    report = json.loads(out.read_text())
    assert report["server_kind"] == "openai" and report["model"] == "plain-model"
    lv = report["levels"][0]
    assert lv["load"] == {"request_rate": 20.0} and lv["overall"]["completed"] == 8
    assert lv["overall"]["tokens_per_forward"] is None
    assert {(g["domain"], g["mode"]) for g in lv["groups"]} == {("code", "-"), ("chat", "-")}
    assert all(set(b) <= OPENAI_FIELDS for b in seen)
    sent = sum(b["max_tokens"] for b in seen[2:])  # after the two warm-up requests
    assert lv["overall"]["output_tokens"] == sent
