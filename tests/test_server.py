"""End to end: a real `redraft serve` subprocess, real HTTP on 127.0.0.1, compared with the in-process Engine.

Every server is started with `python -m redraft serve` on a free port, polled on /health, and stopped with
SIGTERM in its fixture's teardown, which also checks that the server exits and that none of its child
processes (the engine process, multiprocessing's resource tracker) outlives it. Children are found in /proc.

Outputs are checked token for token against `redraft.Engine` in this process: batch invariance and the exact
prefix cache mean that a request's output_ids must not depend on what the server batched it with or cached.
Every wait is bounded by a deadline and every load loop by a count.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import redraft
from live_server import RedraftServer as ServerProcess, assert_error_shape, still_running

MODEL_LEN = 4096  # max_position_embeddings of the tiny config
FIRST_ID, VOCAB = 12, 448  # ids 0..11 are the tiny tokenizer's special tokens (EOS 1, MASK 2)
REQUEST_TIMEOUT_S = 60.0
# A request that can only end by abort (or after thousands of forwards): the abort tests rely on it.
ENDLESS = {"max_new_tokens": 2000, "ignore_eos": True, "mode": "Q"}


def _server_fixture(request, ckpt: Path, tmp_path_factory, extra_args: list[str]):
    server = ServerProcess(ckpt, tmp_path_factory.mktemp("server"), extra_args)
    request.addfinalizer(server.stop)
    server.start()
    assert server.seen_descendants, "the server started no engine process?"
    return server


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(ckpt: Path):
    import torch

    torch.set_num_threads(1)  # two slow cores, shared with the server subprocesses
    # float64 here and in the server: batches of different composition sum in different orders, and in
    # float32 that can flip a sampled token at a CDF boundary (seen: 1 of 255 at temperature 0.8)
    eng = redraft.Engine(model_path=str(ckpt), dtype="float64", progress=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(request, ckpt: Path, tmp_path_factory) -> ServerProcess:
    # A KV cache of 160 pages: the load test fills it, so cached blocks get evicted and requests preempted.
    return _server_fixture(request, ckpt, tmp_path_factory, ["--max-total-tokens", str(160 * 32), "--dtype", "float64"])


@pytest.fixture(scope="module")
def tight_server(request, ckpt: Path, tmp_path_factory) -> ServerProcess:
    return _server_fixture(request, ckpt, tmp_path_factory, ["--max-queued-requests", "1", "--max-running-requests", "1",
                                                                "--dtype", "float64"])


# ---- HTTP helpers --------------------------------------------------------------------------------------------
def _run(coro, timeout: float = 120.0):
    """Run a coroutine in a fresh event loop, bounded by a global timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _client(server: ServerProcess, timeout: float = REQUEST_TIMEOUT_S) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    return httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} is not in /metrics"
    return float(m.group(1))


async def _gauges(client: httpx.AsyncClient) -> dict[str, float]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return {k: _metric(r.text, f"sglang:{k}") for k in ("num_running_reqs", "num_queue_reqs", "num_used_tokens")}


async def _wait_idle(client: httpx.AsyncClient, deadline_s: float) -> tuple[dict[str, float], float]:
    """Poll /metrics until nothing runs or waits; the gauges and the seconds it took."""
    t0 = time.monotonic()
    while True:
        g = await _gauges(client)
        if g["num_running_reqs"] == 0 and g["num_queue_reqs"] == 0:
            return g, time.monotonic() - t0
        assert time.monotonic() - t0 < deadline_s, f"still busy after {deadline_s}s: {g}"
        await asyncio.sleep(0.1)


async def _flush_and_check_no_pages(client: httpx.AsyncClient) -> None:
    r = await client.post("/flush_cache")
    assert r.status_code == 200, r.text
    g = await _gauges(client)
    assert g["num_used_tokens"] == 0, f"KV pages still in use after /flush_cache with nothing running: {g}"


def _parse_sse(lines: list[str]) -> tuple[list[dict], bool]:
    """The JSON chunks of an SSE body and whether it ended with `data: [DONE]`."""
    events = [ln for ln in lines if ln.strip()]
    for ln in events:
        assert ln.startswith("data: "), f"not an SSE data line: {ln!r}"
    done = bool(events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in events if ln != "data: [DONE]"]
    return chunks, done


async def _stream_first_chunk_then_close(client: httpx.AsyncClient, body: dict) -> dict:
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return json.loads(line[len("data: "):])  # leaving the block closes the connection
    raise AssertionError("the stream ended without a chunk")


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


# ---- 1. concurrent requests = each alone in-process ------------------------------------------------------
def test_concurrent_generate_matches_engine_alone(server, engine):
    rng = random.Random(1234)
    lengths = [1, 2, 31, 32, 33, 63, 64, 65, 95, 96, 97, 100] + [rng.randint(1, 100) for _ in range(20)]
    budgets = [1, 5, 16, 31, 32, 33, 64, 100]
    cases = []
    for i, n in enumerate(lengths):
        params: dict[str, Any] = {"max_new_tokens": budgets[i % len(budgets)], "mode": "SQ"[i % 2]}
        if i % 4 == 3:
            params.update(temperature=0.8, seed=1000 + i)
        if i % 3 == 0:
            params["ignore_eos"] = True
        cases.append((_random_prompt(rng, n), params))
    assert len(cases) == 32

    async def main():
        async with _client(server) as c:
            return await asyncio.gather(*[c.post("/generate", json={"input_ids": ids, "sampling_params": p})
                                          for ids, p in cases])

    responses = _run(main())
    for (ids, params), resp in zip(cases, responses):
        assert resp.status_code == 200, resp.text
        got = resp.json()
        want = engine.generate(input_ids=ids, sampling_params=params)  # alone, one call per request
        assert got["output_ids"] == want["output_ids"], (len(ids), params)
        assert got["text"] == want["text"]
        meta = got["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(got["output_ids"]) <= params["max_new_tokens"]
        assert meta["finish_reason"]["type"] == want["meta_info"]["finish_reason"]["type"]


# ---- 2. prefix cache -------------------------------------------------------------------------------------------
def test_repeated_prompt_reports_cached_tokens(server):
    ids = _random_prompt(random.Random(77), 100)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "mode": "S"}}

    async def main():
        async with _client(server) as c:
            first = await c.post("/generate", json=body)
            second = await c.post("/generate", json=body)
            return first, second

    first, second = _run(main())
    assert first.status_code == 200 and second.status_code == 200
    assert second.json()["meta_info"]["cached_tokens"] >= 96  # three whole blocks of the 100-token prompt
    assert second.json()["output_ids"] == first.json()["output_ids"]  # the cache is exact


# ---- 3. disconnects abort; nothing leaks -------------------------------------------------------------------
def test_streams_closed_after_first_chunk_are_aborted(server):
    async def main():
        async with _client(server) as c:
            bodies = [{"input_ids": _random_prompt(random.Random(i), 10 + 20 * i), "sampling_params": ENDLESS}
                      for i in range(4)]
            firsts = await asyncio.gather(*[_stream_first_chunk_then_close(c, b) for b in bodies])
            for body, chunk in zip(bodies, firsts):
                assert chunk["meta_info"]["finish_reason"] is None
                n = len(body["input_ids"])
                assert len(chunk["output_ids"]) == 32 - n % 32  # the rest of the prompt's last block
            # Each would need ~2000 more tokens (thousands of forwards); the aborts must come far sooner.
            await _wait_idle(c, deadline_s=10.0)
            await _flush_and_check_no_pages(c)

    _run(main())


def test_non_streaming_client_disconnect_aborts(server):
    async def main():
        async with _client(server) as c:
            body = {"input_ids": _random_prompt(random.Random(5), 40), "sampling_params": ENDLESS}
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
                await c.post("/generate", json=body, timeout=1.5)
            # It would need ~2000 tokens (thousands of forwards); the abort must end it within seconds.
            await _wait_idle(c, deadline_s=6.0)
            await _flush_and_check_no_pages(c)

    _run(main())


# ---- 4. admission control ----------------------------------------------------------------------------------
def test_full_queue_answers_503_at_once(tight_server, engine):
    rng = random.Random(9)
    params = {"max_new_tokens": 96, "ignore_eos": True, "mode": "Q"}
    prompts = [_random_prompt(rng, 20) for _ in range(5)]

    async def one(c, ids):
        t0 = time.monotonic()
        r = await c.post("/generate", json={"input_ids": ids, "sampling_params": params})
        return r, time.monotonic() - t0

    async def main():
        async with _client(tight_server) as c:
            results = await asyncio.gather(*[one(c, ids) for ids in prompts])
            await _wait_idle(c, deadline_s=10.0)
            after = await c.post("/generate", json={"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 4}})
            return results, after

    results, after = _run(main())
    ok = [(ids, r, dt) for ids, (r, dt) in zip(prompts, results) if r.status_code == 200]
    full = [(r, dt) for r, dt in results if r.status_code == 503]
    assert len(ok) + len(full) == len(prompts), [r.status_code for r, _ in results]
    assert ok and full, [r.status_code for r, _ in results]
    for r, _ in full:
        err = assert_error_shape(r, 503)
        assert err["code"] == "queue_full"
    # "at once": every refusal came back before the quickest accepted request could finish
    assert max(dt for _, dt in full) < min(dt for _, _, dt in ok)
    for ids, r, _ in ok:
        assert r.json()["output_ids"] == engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert after.status_code == 200  # the server still serves once the queue drained


def test_full_queue_refuses_streams_and_plain_requests_while_busy(tight_server):
    """Deterministic: one request running, one waiting; the next ones (streamed or not) get 503 at once."""
    ids = _random_prompt(random.Random(10), 12)
    small = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}

    async def main():
        async with _client(tight_server) as c:
            hog_body = {"input_ids": ids, "sampling_params": ENDLESS, "rid": "hog", "stream": True}
            async with c.stream("POST", "/generate", json=hog_body) as hog:
                assert hog.status_code == 200
                lines = hog.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # it is running
                queued = asyncio.ensure_future(
                    c.post("/generate", json={"input_ids": ids, "sampling_params": ENDLESS, "rid": "queued"}))
                t0 = time.monotonic()
                while (await _gauges(c))["num_queue_reqs"] != 1:
                    assert time.monotonic() - t0 < 10.0, "the second request never showed up as queued"
                    await asyncio.sleep(0.05)
                t0 = time.monotonic()
                plain = await c.post("/generate", json=small)
                streamed = await c.post("/generate", json={**small, "stream": True})
                refused_in = time.monotonic() - t0
                for rid in ("queued", "hog"):
                    assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
                rest = [line async for line in lines]
            queued_resp = await queued
            await _wait_idle(c, deadline_s=10.0)
            return plain, streamed, refused_in, rest, queued_resp

    plain, streamed, refused_in, rest, queued_resp = _run(main())
    for r in (plain, streamed):
        assert assert_error_shape(r, 503)["code"] == "queue_full"
    assert refused_in < 2.0
    chunks, done = _parse_sse(rest)
    assert done and chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert queued_resp.status_code == 200
    assert queued_resp.json()["meta_info"]["finish_reason"]["type"] == "abort"


# ---- 5. engine death ---------------------------------------------------------------------------------------
def test_dead_engine_gives_503_at_once_and_unhealthy(ckpt, tmp_path_factory, request):
    srv = _server_fixture(request, ckpt, tmp_path_factory, [])
    eng = srv.engine_pid()
    body = {"input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 4}}

    async def main():
        async with _client(srv, timeout=5.0) as c:
            assert (await c.post("/generate", json=body)).status_code == 200
            os.kill(eng, signal.SIGKILL)
            t0 = time.monotonic()

            async def probe(i: int):
                # Spread over 0.3 s: some land after the engine is gone but before the server has noticed.
                await asyncio.sleep(0.01 * i)
                r = await (c.get("/health") if i % 2 else c.post("/generate", json=body))
                return r, time.monotonic() - t0

            probes = await asyncio.gather(*[probe(i) for i in range(30)])
            streamed = await c.post("/generate", json={**body, "stream": True})
            health = await c.get("/health")
            return probes, streamed, health

    probes, streamed, health = _run(main(), timeout=60.0)
    for r, dt in probes:
        assert_error_shape(r, 503)
        assert dt < 1.5, f"{r.request.url.path} took {dt:.2f}s to answer after the engine died"
    assert_error_shape(streamed, 503)
    assert_error_shape(health, 503)
    assert not still_running(eng, srv.seen_descendants[eng])


# ---- 6. streaming format -------------------------------------------------------------------------------------
def test_stream_format_and_equality_with_non_streamed(server):
    cases = [
        ([30, 31, 32, 33], {"max_new_tokens": 100, "ignore_eos": True, "mode": "S"}),
        (_random_prompt(random.Random(3), 45), {"max_new_tokens": 70, "mode": "Q"}),
        (_random_prompt(random.Random(4), 64), {"max_new_tokens": 96, "ignore_eos": True, "mode": "Q"}),
    ]

    async def stream(c, ids, params):
        async with c.stream("POST", "/generate", json={"input_ids": ids, "sampling_params": params, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            return [line async for line in r.aiter_lines()]

    async def main():
        async with _client(server) as c:
            out = []
            for ids, params in cases:
                plain = await c.post("/generate", json={"input_ids": ids, "sampling_params": params})
                assert plain.status_code == 200
                out.append((plain.json(), await stream(c, ids, params)))
            return out

    for (ids, params), (plain, lines) in zip(cases, _run(main())):
        chunks, done = _parse_sse(lines)
        assert done, "the stream must end with data: [DONE]"
        assert chunks
        for prev, cur in zip(chunks, chunks[1:]):  # cumulative ids and text, one chunk per committed block
            assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
            assert cur["text"].startswith(prev["text"])
            assert (len(ids) + len(prev["output_ids"])) % 32 == 0  # whole blocks of the sequence
            assert prev["meta_info"]["finish_reason"] is None
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        assert last["output_ids"] == plain["output_ids"]
        assert last["text"] == plain["text"]
        if params.get("ignore_eos"):
            first_block, last_block = len(ids) // 32, (len(ids) + params["max_new_tokens"] - 1) // 32
            assert len(chunks) == last_block - first_block + 1


# ---- 7. errors -----------------------------------------------------------------------------------------------
def test_bad_requests_are_400_with_the_error_shape(server):
    long_prompt = _random_prompt(random.Random(8), 100)

    async def main():
        async with _client(server) as c:
            gen = "/generate"
            r = {}
            r["json"] = await c.post(gen, content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"})
            r["field"] = await c.post(gen, json={"input_ids": [20], "bogus": 1})
            r["temp"] = await c.post(gen, json={"input_ids": [20], "sampling_params": {"temperature": -1}})
            r["param"] = await c.post(gen, json={"input_ids": [20], "sampling_params": {"nonsense": 1}})
            r["zero"] = await c.post(gen, json={"input_ids": [20], "sampling_params": {"max_new_tokens": 0}})
            r["ctx"] = await c.post(gen, json={"input_ids": long_prompt,
                                                "sampling_params": {"max_new_tokens": MODEL_LEN - 99}})
            r["ctx_stream"] = await c.post(gen, json={"input_ids": long_prompt, "stream": True,
                                                       "sampling_params": {"max_new_tokens": MODEL_LEN}})
            r["empty"] = await c.post(gen, json={"input_ids": []})
            r["vocab"] = await c.post(gen, json={"input_ids": [10**6]})
            r["mask"] = await c.post(gen, json={"input_ids": [20, 2, 21]})
            r["neither"] = await c.post(gen, json={"sampling_params": {}})
            aborts = [await c.post("/abort_request", json={"rid": "no-such-request"}) for _ in range(2)]
            info = await c.get("/get_server_info")
            return r, aborts, info

    r, aborts, info = _run(main())
    for name, resp in r.items():
        err = assert_error_shape(resp, 400)
        assert err["type"] == "invalid_request_error", (name, err)
    assert r["json"].json()["error"]["param"] is None
    assert r["field"].json()["error"]["param"] == "bogus"
    assert r["temp"].json()["error"]["param"] == "sampling_params.temperature"
    assert r["ctx"].json()["error"]["code"] == "context_length_exceeded"
    assert r["ctx_stream"].json()["error"]["code"] == "context_length_exceeded"
    for a in aborts:  # idempotent: an unknown rid is not an error
        assert a.status_code == 200
    assert info.status_code == 200 and info.json()["max_model_len"] == MODEL_LEN


# ---- 8. bounded load ---------------------------------------------------------------------------------------
N_LOAD, CONCURRENCY = 300, 64


def _load_plan() -> list[dict]:
    rng = random.Random(2024)
    plan = []
    for i in range(N_LOAD):
        ids = _random_prompt(rng, rng.randint(1, 100))
        params: dict[str, Any] = {"max_new_tokens": rng.choice([1, 8, 16, 32, 40, 64, 96, 128]), "mode": rng.choice("SQ")}
        if rng.random() < 0.2:
            params.update(temperature=0.8, seed=rng.randrange(2**31))
        if rng.random() < 0.3:
            params["ignore_eos"] = True
        kind = "normal"
        if rng.random() < 0.15:  # aborted mid-way, three ways
            kind = rng.choice(["close", "rid_stream", "rid_plain"])
            params = {**ENDLESS, "mode": params["mode"]}
        plan.append({"rid": f"load-{i}", "ids": ids, "params": params, "kind": kind,
                     "stream": kind == "normal" and rng.random() < 0.25})
    return plan


async def _abort_until_done(c, task, rid):
    for _ in range(200):  # the abort may overtake the request itself: repeat until it ends
        if task.done():
            return
        assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
        await asyncio.wait({task}, timeout=0.25)
    raise AssertionError(f"{rid} did not end after repeated aborts")


async def _stream_then_abort_by_rid(c, body: dict, rid: str) -> None:
    """A streamed /generate aborted by its rid after its first chunk: the stream ends with an abort finish."""
    async with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines, aborted_sent = [], False
        async for line in r.aiter_lines():
            lines.append(line)
            if line.startswith("data: {") and not aborted_sent:
                assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
                aborted_sent = True
    chunks, done = _parse_sse(lines)
    assert done and chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bounded_load_with_aborts_matches_engine_and_leaks_nothing(server, engine):
    plan = _load_plan()
    aborted = [p for p in plan if p["kind"] != "normal"]
    assert 0.10 * N_LOAD <= len(aborted) <= 0.22 * N_LOAD
    normal = [p for p in plan if p["kind"] == "normal"]
    want = engine.generate(input_ids=[p["ids"] for p in normal], sampling_params=[p["params"] for p in normal])
    expected = {p["rid"]: w["output_ids"] for p, w in zip(normal, want)}

    async def run_one(c, p) -> tuple[str, Any]:
        body = {"input_ids": p["ids"], "sampling_params": p["params"], "rid": p["rid"]}
        if p["kind"] == "close":
            await _stream_first_chunk_then_close(c, body)
            return p["rid"], None
        if p["kind"] == "rid_stream":
            await _stream_then_abort_by_rid(c, body, p["rid"])
            return p["rid"], None
        if p["kind"] == "rid_plain":
            task = asyncio.ensure_future(c.post("/generate", json=body))
            await asyncio.sleep(0.2)
            await _abort_until_done(c, task, p["rid"])
            r = await task
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
            return p["rid"], None
        if p["stream"]:
            async with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                chunks, done = _parse_sse([line async for line in r.aiter_lines()])
            assert done
            return p["rid"], chunks[-1]
        r = await c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return p["rid"], r.json()

    async def main():
        sem = asyncio.Semaphore(CONCURRENCY)

        async def bounded(c, p):
            async with sem:
                return await run_one(c, p)

        async with _client(server, timeout=120.0) as c:
            results = await asyncio.gather(*[bounded(c, p) for p in plan])
            await _wait_idle(c, deadline_s=15.0)
            info = (await c.get("/get_server_info")).json()
            await _flush_and_check_no_pages(c)
            return results, info

    t0 = time.monotonic()
    results, info = _run(main(), timeout=300.0)
    print(f"load: {N_LOAD} requests ({len(aborted)} aborted) in {time.monotonic() - t0:.1f}s, "
          f"{info.get('num_preemptions')} preemptions")
    got = dict(results)
    mismatched = [rid for rid in expected if got[rid]["output_ids"] != expected[rid]]
    assert not mismatched, f"{len(mismatched)} outputs differ from the in-process Engine: {mismatched[:10]}"
    for p in normal:
        meta = got[p["rid"]]["meta_info"]
        assert meta["id"] == p["rid"]
        assert meta["completion_tokens"] == len(expected[p["rid"]]) <= p["params"]["max_new_tokens"]
