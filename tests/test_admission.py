"""Admission in one iteration: every engine request of one HTTP request (the choices of `n`, the prompts of a
/generate list) reaches the engine as one message, is admitted all or none, and starts in the same forward.

Before, each choice's acceptance waited for the engine's next forward, so the k-th choice of a request began k
forwards late; `first_forward` (meta_info, and per choice in the OpenAI `diffusion` object) is the engine's
forward count when a request first ran, and shows it."""

from __future__ import annotations

import httpx
import pytest

import redraft
from live_server import RedraftServer
from redraft.protocol.errors import RequestError
from redraft.protocol.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def server(request, ckpt, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("admission-log"), ["--max-running-requests", "64"])
    request.addfinalizer(srv.stop)
    return srv.start()


def _post(srv: RedraftServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120, trust_env=False)


def test_chat_choices_start_in_one_forward(server) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "count"}], "n": 8,
                                               "max_tokens": 40, "temperature": 0.8, "seed": 1})
    assert r.status_code == 200, r.text
    starts = r.json()["diffusion"]["first_forward"]
    assert len(starts) == 8 and all(isinstance(s, int) for s in starts), starts
    assert len(set(starts)) == 1, starts


def test_generate_list_starts_in_one_forward(server) -> None:
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(16)]
    r = _post(server, "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 40}})
    assert r.status_code == 200, r.text
    starts = {out["meta_info"]["first_forward"] for out in r.json()}
    assert len(starts) == 1, starts


def test_a_refused_prompt_refuses_the_whole_request(server) -> None:
    too_long = list(range(5, 5 + 5000))  # longer than the tiny model's context
    # the good prompt would run for seconds: had it been admitted, it would still be running below
    long_run = {"max_new_tokens": 2000, "ignore_eos": True}
    r = _post(server, "/generate", {"input_ids": [[5, 6, 7], too_long], "sampling_params": long_run})
    assert r.status_code == 400, r.text
    info = httpx.get(server.url + "/server_info", timeout=30, trust_env=False).json()
    assert info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0, info
    ok = _post(server, "/generate", {"input_ids": [[5, 6, 7]], "sampling_params": {"max_new_tokens": 8}})
    assert ok.status_code == 200, ok.text


def test_engine_admits_all_or_none(ckpt) -> None:
    with redraft.Engine(str(ckpt)) as engine:
        core = engine.core
        good = SamplingParams(max_new_tokens=8)
        with pytest.raises(RequestError) as err:
            core.add_requests([("a", [5, 6, 7], good), ("b", [], good), ("c", [8, 9], good)])
        assert err.value.param == "input_ids"
        assert not core.has_work() and not core.scheduler.waiting
        with pytest.raises(RequestError) as dup:
            core.add_requests([("a", [5, 6, 7], good), ("a", [8, 9], good)])
        assert dup.value.code == "duplicate_request_id"
        accepted = core.add_requests([("a", [5, 6, 7], good), ("c", [8, 9], good)])  # the ids are free again
        assert [a.rid for a in accepted] == ["a", "c"]
        items = core.scheduler.schedule()
        assert sorted(it.req.rid for it in items) == ["a", "c"]  # both in the first iteration
