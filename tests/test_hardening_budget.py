"""Hardening III, item 8 (issue 37): one request's dials cannot multiply its cost without bound. Against a live
`redraft serve` (tiny LLaDA2.1 checkpoint) started with --max-forwards-per-token 1: a request whose dials keep
it editing (max_post_steps 1024) stops at its forward budget with a `length` finish naming the flag, its
committed blocks as its answer; a bystander with the default dials gets its answer unchanged and in bounded
time; /metrics counts forwards per request."""

from __future__ import annotations

import time

import httpx
import pytest

from live_server import RedraftServer

BUDGET_PER_TOKEN = 1
PROMPT = list(range(40, 75))  # 35 tokens: a 64-token answer spans 3 blocks, so the budget is 96 forwards
GREEDY = {"max_new_tokens": 64, "ignore_eos": True}
HOSTILE = {**GREEDY, "max_post_steps": 1024, "threshold": 0.99, "edit_threshold": 0.0}
BYSTANDER_BOUND_S = 30.0  # a 64-token answer of the tiny model on a shared 2-core machine (a second or two alone)


@pytest.fixture(scope="module")
def srv(request, ckpt, tmp_path_factory) -> RedraftServer:
    server = RedraftServer(ckpt, tmp_path_factory.mktemp("hard-budget"),
                           ["--cpu-threads", "1", "--max-forwards-per-token", str(BUDGET_PER_TOKEN)])
    request.addfinalizer(server.stop)
    return server.start()


def _generate(c: httpx.Client, params: dict, prompt: list[int] = PROMPT) -> tuple[dict, float]:
    t0 = time.monotonic()
    r = c.post("/generate", json={"input_ids": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json(), time.monotonic() - t0


@pytest.mark.slow
def test_raised_dials_stop_at_the_forward_budget_and_bystanders_are_unchanged(srv) -> None:
    with httpx.Client(base_url=srv.url, timeout=300, trust_env=False) as c:
        reference, _ = _generate(c, GREEDY, PROMPT[:20])
        for _ in range(2):
            out, _ = _generate(c, HOSTILE)
            meta = out["meta_info"]
            assert meta["finish_reason"]["type"] == "length", meta["finish_reason"]
            assert "--max-forwards-per-token" in meta["finish_reason"]["message"]
            assert meta["steps"] == 3 * 32 * BUDGET_PER_TOKEN, meta["steps"]
            assert 0 < len(out["output_ids"]) < 64  # the blocks committed before the budget ran out
            by, took = _generate(c, GREEDY, PROMPT[:20])
            assert by["output_ids"] == reference["output_ids"] and took < BYSTANDER_BOUND_S, took
            assert "message" not in by["meta_info"]["finish_reason"]
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 64, **{k: v for k, v in HOSTILE.items()
                                                                         if k != "max_new_tokens"}})
        assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "length", chat.text
        metrics = c.get("/metrics").text
    assert "redraft:request_forwards_bucket" in metrics
    count = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("redraft:request_forwards_count"))
    assert count >= 5, count
