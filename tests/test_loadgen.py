"""The load-generation core both benchmark clients share (clients/loadgen.py): the level runners' bounds and
bookkeeping, the two routes' event readers, the summary. End to end through live servers: tests/test_bench_cli.py
(`redraft bench`) and tests/test_bench_serving.py (benchmarks/bench_serving.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from redraft.clients.loadgen import (CANCELLED, ChatStream, GenerateStream, Result, closed_loop, collect, open_loop,
                                     summarize)


def _sender(seconds: float, in_flight: list[int], peak: list[int]):
    async def send(i: int) -> Result:
        in_flight.append(i)
        peak[0] = max(peak[0], len(in_flight))
        await asyncio.sleep(seconds)
        in_flight.remove(i)
        return Result(domain=str(i), ok=True, output_tokens=i)
    return send


def test_closed_loop_keeps_concurrency_and_order():
    in_flight, peak = [], [0]

    async def go() -> list[Result]:
        sent = await closed_loop(_sender(0.01, in_flight, peak), 7, 3, max_seconds=30, grace_seconds=30)
        return await collect(sent, lambda i: Result(error=CANCELLED))

    results = asyncio.run(go())
    assert [r.domain for r in results] == [str(i) for i in range(7)] and all(r.ok for r in results)
    assert peak[0] == 3 and in_flight == []


def test_closed_loop_cancels_past_the_grace_period_and_counts_them_failed():
    async def go() -> tuple[list[Result], float]:
        t0 = time.perf_counter()
        sent = await closed_loop(_sender(60, [], [0]), 10, 2, max_seconds=0.05, grace_seconds=0.1)
        results = await collect(sent, lambda i: Result(domain=f"cut {i}", error=CANCELLED))
        return results, time.perf_counter() - t0

    results, took = asyncio.run(go())
    assert took < 5
    assert [(r.domain, r.ok, r.error) for r in results] == [("cut 0", False, CANCELLED), ("cut 1", False, CANCELLED)]


def test_open_loop_sends_at_a_rate_and_caps_in_flight():
    in_flight, peak = [], [0]

    async def go() -> list[Result]:
        sent = await open_loop(_sender(0.05, in_flight, peak), 12, rate=400.0, max_concurrency=2, max_seconds=30,
                               grace_seconds=30, seed=1)
        return await collect(sent, lambda i: Result(error=CANCELLED))

    results = asyncio.run(go())
    assert len(results) == 12 and all(r.ok for r in results) and peak[0] == 2


def test_a_request_that_raises_is_raised_not_counted():
    async def broken(i: int) -> Result:
        raise KeyError("a bug in the client")

    async def go() -> list[Result]:
        return await collect(await closed_loop(broken, 2, 1, 30, 30), lambda i: Result(error=CANCELLED))

    with pytest.raises(KeyError):
        asyncio.run(go())


def test_chat_stream_reads_content_finish_usage_and_forwards():
    reader = ChatStream()
    events = [{"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "ab"}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "cd"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"completion_tokens": 9, "prompt_tokens": 4}, "diffusion": {"forwards": 3}}]
    assert [reader.see(e) for e in events] == [False, True, True, False]
    res = Result()
    assert reader.close(res) == "" and (res.output_tokens, res.prompt_tokens, res.forwards) == (9, 4, 3)
    unfinished = ChatStream()
    unfinished.see(events[1])
    assert "finish_reason" in unfinished.close(Result())


def test_generate_stream_reads_the_final_meta_info():
    reader = GenerateStream()
    assert reader.see({"output_ids": [], "meta_info": {"finish_reason": None}}) is False
    assert reader.see({"output_ids": [5, 6], "meta_info": {"finish_reason": None}})
    res = Result()
    assert reader.close(res) == "the stream ended before the request finished"
    reader.see({"output_ids": [5, 6, 7], "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 3,
                                                       "prompt_tokens": 8, "cached_tokens": 2, "steps": 2}})
    assert reader.close(res) == ""
    assert (res.output_tokens, res.prompt_tokens, res.cached_tokens, res.forwards) == (3, 8, 2, 2)
    assert GenerateStream().close(Result()) == "the stream ended without a chunk"


def test_summary_counts_rates_and_forwards_of_reporting_requests_only():
    results = [Result(ok=True, ttft=0.1, latency=0.5, output_tokens=5, forwards=2),
               Result(ok=True, ttft=0.3, latency=0.7, output_tokens=9),  # a server that does not say its forwards
               Result(error="x"), Result(error="x")]
    row = summarize(results, 2.0, metrics=("ttft", "tpot"), qs=(50,))
    assert (row["requests"], row["completed"], row["failed"], row["errors"]) == (4, 2, 2, {"x": 2})
    assert row["output_tok_per_s"] == 7.0 and row["req_per_s"] == 1.0
    assert row["ttft_ms_mean"] == 200.0 and row["ttft_ms_p50"] == 200.0
    assert row["tpot_ms_p50"] == pytest.approx(75.0)  # (400 / 4 + 400 / 8) / 2
    assert row["tokens_per_forward"] == 2.5 and "e2e_ms_p50" not in row
