"""Hardening of the engine loop (issue 24, items 3 and 6): a failure inside a step ends only the request it concerns
(an error finish; the others' tokens are those of a run without it; the engine process lives on), and likelihood
work is a job the loop advances in bounded chunks between decoding iterations, dropped when its client leaves.

Failures are injected at each stage: in-process by setting the core's FaultInjector (engine/runtime/faults.py), through a
live server by REDRAFT_FAULT_INJECT (read once at engine start)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

import redraft
from redraft.engine.runtime.faults import FaultInjector, InjectedFault
from redraft.engine.text.likelihood import staircase_variants
from redraft.protocol.errors import RequestError
from redraft.protocol.sampling_params import SamplingParams
from tests.live_server import RedraftServer, assert_error_shape

PROMPTS = {"ok-a": [11, 12, 13, 14, 15], "ok-b": [40, 41, 42], "ok-c": [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}
GREEDY = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True, "mode": "Q"}


@pytest.fixture(scope="module")
def engine(ckpt: Path):
    eng = redraft.Engine(str(ckpt), progress=False)
    yield eng
    eng.shutdown()


def run_core(core, requests: dict[str, tuple[list[int], dict]], max_steps: int = 2000) -> dict[str, dict]:
    """Add every request, step until all finished; per rid: output ids, finish json."""
    outs = {rid: {"ids": [], "finish": None} for rid in requests}
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, SamplingParams.from_dict(params))
    for _ in range(max_steps):
        if not core.has_work():
            break
        for o in core.step():
            outs[o.rid]["ids"] += o.new_ids
            if o.finished:
                outs[o.rid]["finish"] = o.finish_reason
    assert not core.has_work(), "the requests did not finish in time"
    return outs


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, list[int]]:
    """Each bystander's greedy output when it runs by itself, no fault anywhere: the reference."""
    return {rid: run_core(engine.core, {rid: (ids, GREEDY)})[rid]["ids"] for rid, ids in PROMPTS.items()}


# The bad request of each stage, with what makes that stage run for it.
BAD = {
    "pre_forward": {},
    "begin_block": {"regex": "[0-9]{1,40}"},
    "controls": {"logit_bias": {"5": 3.0}},
    "sweep": {"regex": "[0-9]{1,40}"},
    "forward": {},
    "output": {},
}


@pytest.mark.parametrize("stage", sorted(BAD))
def test_a_failure_in_one_stage_ends_that_request_alone(engine, alone, stage) -> None:
    core = engine.core
    core.faults = core.runner.faults = core.scheduler.fault_hook = FaultInjector([(stage, "bad")])
    try:
        requests = {"bad-1": ([21, 22, 23, 24], {**GREEDY, **BAD[stage]})}
        requests.update({rid: (ids, GREEDY) for rid, ids in PROMPTS.items()})
        outs = run_core(core, requests)
    finally:
        core.faults = core.runner.faults = core.scheduler.fault_hook = FaultInjector([])
    finish = outs["bad-1"]["finish"]
    assert finish is not None and finish["type"] == "error", (stage, finish)
    assert "injected fault" in finish["message"] and stage in finish["message"], finish
    for rid in PROMPTS:  # the bystanders: exactly what they produce alone
        assert outs[rid]["finish"]["type"] == "length", (stage, rid, outs[rid]["finish"])
        assert outs[rid]["ids"] == alone[rid], (stage, rid)
    s = core.scheduler
    assert not s.running and not s.waiting and not core._requests
    assert core.scoring.leases.count == 0
    s.cache.check_invariants()
    # every page is free or held by the radix tree (none leaked to the failed request)
    assert s.pool.num_free + s.cache.cached_pages == s.pool.capacity, (stage, s.pool.num_free, s.cache.cached_pages)


def test_the_engine_keeps_serving_after_failures(engine, alone) -> None:
    out = engine.generate(input_ids=PROMPTS["ok-a"], sampling_params=GREEDY)
    assert out["output_ids"] == alone["ok-a"]


def test_a_forward_that_fails_for_every_request_alike_is_an_engine_fault(engine) -> None:
    """What fails for every request on its own is no request's fault: it propagates (the process then exits and
    the HTTP side restarts it) instead of failing the requests one by one forever."""
    from redraft.engine.runtime.core import EngineFault

    core = engine.core
    core.faults = core.runner.faults = core.scheduler.fault_hook = FaultInjector([("forward", "")])
    try:
        for i in range(4):
            core.add_request(f"any-{i}", [30 + i, 31, 32], SamplingParams.from_dict(GREEDY))
        with pytest.raises(EngineFault):
            for _ in range(50):
                core.step()
    finally:
        core.faults = core.runner.faults = core.scheduler.fault_hook = FaultInjector([])
        for i in range(4):
            core.abort(f"any-{i}")
        core.step()
    assert not core.has_work()


def test_an_admission_failure_leaves_nothing_behind(engine) -> None:
    core = engine.core
    core.faults = FaultInjector([("admit", "bad")])
    try:
        with pytest.raises(InjectedFault):
            core.add_request("bad-admit", [1, 2, 3], SamplingParams.from_dict(GREEDY))
    finally:
        core.faults = FaultInjector([])
    assert "bad-admit" not in core._requests and not core.has_work()


# ---- likelihood jobs -------------------------------------------------------------------------------------------
def _staircase(n_tokens: int, seed: int = 3) -> tuple[list[int], list]:
    ids = [20 + (seed * 7 + 13 * i) % 300 for i in range(n_tokens)]
    return ids, staircase_variants(0, len(ids), 1, 32)


def test_a_score_job_interleaves_with_decoding_and_gives_the_idle_values(engine, alone) -> None:
    core = engine.core
    seqs, variants = [], []
    for k in range(3):  # 3 x 1100 positions: 3300 block forwards, 103 chunks of 1024 tokens and prefill ones
        ids, vs = _staircase(1100, seed=k)
        seqs.append(ids)
        variants += [type(v)(k, v.block, v.masked, v.targets) for v in vs]
    idle = core.score_variants(seqs, variants, top_k=2)  # run at once, nothing else in the engine
    solo_steps = _steps_to_finish(core)
    core.flush_cache()
    core.add_score_job("job-1", seqs, variants, top_k=2)
    got, results, steps, finished_at, job_done_at = [], None, 0, None, None
    core.add_request("ok-a", PROMPTS["ok-a"], SamplingParams.from_dict(GREEDY))
    while core.has_work() and steps < 2000:
        steps += 1
        for o in core.step():
            got += o.new_ids
            if o.finished:
                finished_at = steps
        for r in core.take_score_results():
            assert r.token == "job-1" and r.status == 200, r
            results, job_done_at = r.results, steps
    assert results == idle  # interleaving with decoding changes no value
    assert got == alone["ok-a"]
    # the job was spread over many iterations, and the request kept its pace: as many iterations as alone
    assert job_done_at is not None and job_done_at >= 50, job_done_at
    assert finished_at == solo_steps, (finished_at, solo_steps)
    assert core.scoring.leases.count == 0


def _steps_to_finish(core) -> int:
    core.flush_cache()
    core.add_request("ok-a", PROMPTS["ok-a"], SamplingParams.from_dict(GREEDY))
    for n in range(1, 2000):
        if any(o.finished for o in core.step()):
            return n
    raise AssertionError("did not finish")


def test_a_cancelled_score_job_releases_its_pages_at_once(engine) -> None:
    core = engine.core
    core.flush_cache()
    pool = core.scheduler.pool
    free = pool.num_free
    ids, variants = _staircase(2000, seed=5)
    core.add_score_job("job-2", [ids], variants)
    assert pool.num_free < free and core.scoring.leases.count == 1  # the prefix is leased
    core.step()  # one chunk
    assert core.has_work()
    assert core.cancel_score("job-2") and not core.cancel_score("job-2")
    assert core.scoring.leases.count == 0 and not core.has_work() and not core.take_score_results()
    assert pool.num_free + core.scheduler.cache.cached_pages == pool.capacity


def test_likelihood_jobs_beyond_the_queue_bound_are_503s(engine, monkeypatch) -> None:
    """--max-queued-requests bounds running likelihood jobs too (each holds KV pages while it runs): one more is
    a 503 queue_full that leases nothing; a finished or cancelled job makes room."""
    core = engine.core
    core.flush_cache()
    monkeypatch.setattr(core.scheduler, "config", dataclasses.replace(core.scheduler.config, max_queued_requests=2))
    ids, variants = _staircase(200, seed=6)
    core.add_score_job("bound-1", [ids], variants)
    core.add_score_job("bound-2", [ids], variants)
    leases = core.scoring.leases.count
    with pytest.raises(RequestError) as err:
        core.add_score_job("bound-3", [ids], variants)
    assert (err.value.status, err.value.code) == (503, "queue_full") and "2 likelihood jobs" in err.value.message
    assert core.scoring.leases.count == leases and set(core.scoring.jobs) == {"bound-1", "bound-2"}
    assert core.cancel_score("bound-2")
    core.add_score_job("bound-3", [ids], variants)
    for rid in ("bound-1", "bound-3"):
        core.cancel_score(rid)
    assert core.scoring.leases.count == 0


def test_a_failing_score_job_ends_alone_with_an_error(engine, alone) -> None:
    core = engine.core
    ids, variants = _staircase(200, seed=7)
    core.faults = FaultInjector([("score", "bad")])
    try:
        core.add_score_job("bad-job", [ids], variants)
        outs = run_core(core, {"ok-b": (PROMPTS["ok-b"], GREEDY)})
    finally:
        core.faults = FaultInjector([])
    res = core.take_score_results()
    assert len(res) == 1 and res[0].token == "bad-job" and res[0].status == 500 and res[0].results is None
    assert "injected fault" in res[0].message
    assert outs["ok-b"]["ids"] == alone["ok-b"]
    assert core.scoring.leases.count == 0


# ---- through a live server -------------------------------------------------------------------------------------
FAULTS = "forward:crash,output:kaput,controls:ctl,pre_forward:pre,admit:adm"
BYSTANDERS = [[50 + 3 * i + k for k in range(6)] for i in range(6)]
BYSTANDER_PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True, "mode": "Q"}


@pytest.fixture(scope="module")
def faulty(request, ckpt, tmp_path_factory):
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("hard-engine-log"), [], env={"REDRAFT_FAULT_INJECT": FAULTS})
    request.addfinalizer(srv.stop)
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        yield srv, c


def _sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _bad_requests(c: httpx.Client) -> dict[str, httpx.Response | list]:
    """One request per injected stage and route: what each got back."""
    out: dict = {}
    out["generate"] = c.post("/generate", json={"input_ids": [5, 6, 7], "rid": "crash-1",
                                                "sampling_params": {"max_new_tokens": 40}})
    with c.stream("POST", "/generate", json={"input_ids": [5, 6, 7, 8], "rid": "kaput-2", "stream": True,
                                             "sampling_params": {"max_new_tokens": 70, "ignore_eos": True}}) as r:
        out["generate_stream"] = (r.status_code, _sse_events(r))
    out["completions"] = c.post("/v1/completions", headers={"X-Request-Id": "ctl-3"},
                                json={"prompt": [9, 10, 11], "max_tokens": 20, "logit_bias": {"5": 2.0}})
    with c.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "pre-4"},
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}) as r:
        out["chat_stream"] = (r.status_code, _sse_events(r))
    out["admit"] = c.post("/generate", json={"input_ids": [5, 6], "rid": "adm-5", "sampling_params": {}})
    return out


def test_live_failures_end_their_request_alone(faulty) -> None:
    srv, c = faulty
    pid = srv.engine_pid()
    alone = [c.post("/generate", json={"input_ids": ids, "sampling_params": BYSTANDER_PARAMS}).json()["output_ids"]
             for ids in BYSTANDERS]
    got: list = [None] * len(BYSTANDERS)

    def bystander(i: int) -> None:
        got[i] = c.post("/generate", json={"input_ids": BYSTANDERS[i], "sampling_params": BYSTANDER_PARAMS})

    threads = [threading.Thread(target=bystander, args=(i,)) for i in range(len(BYSTANDERS))]
    for t in threads:
        t.start()
    time.sleep(0.2)  # the bystanders are in flight when the faulty requests arrive
    bad = _bad_requests(c)
    for t in threads:
        t.join(120)
    for r, ref in zip(got, alone):  # the bystanders: exactly what they produce alone
        assert r is not None and r.status_code == 200, r and r.text
        assert r.json()["output_ids"] == ref
    for name in ("generate", "completions", "admit"):  # non-streamed: a 500 in OpenAI's shape naming the reason
        err = assert_error_shape(bad[name], 500)
        assert err["code"] == "internal_error" and "injected fault" in err["message"], (name, err)
    for name in ("generate_stream", "chat_stream"):  # streamed: its chunks, then an error event, then [DONE]
        status, events = bad[name]
        assert status == 200 and events[-1] == "[DONE]", (name, events)
        err = events[-2].get("error")
        assert err and err["code"] == "internal_error" and "injected fault" in err["message"], (name, events)
        assert all("error" not in e for e in events[:-2]), (name, events)
    assert srv.engine_pid() == pid, "the engine process was restarted"
    log = srv.log_tail(200_000)
    for rid, stage in (("crash-1", "forward"), ("kaput-2", "output"), ("ctl-3-0", "controls"),
                       ("pre-4", "pre_forward")):
        assert f"request {rid}" in log and f"in {stage}" in log, (rid, stage, log[-3000:])
    assert "restarting the engine" not in log
    info = c.get("/server_info").json()
    assert info["num_request_failures"] >= 3 and info["num_running_reqs"] == 0, info


@pytest.fixture(scope="module")
def plain(request, tmp_path_factory):
    """The bundled demo model (the issue's measurements were taken with it)."""
    srv = RedraftServer(None, tmp_path_factory.mktemp("hard-engine-lk"), [])
    request.addfinalizer(srv.stop)
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        yield srv, c


CANARY = {"input_ids": [31, 32, 33, 34, 35], "sampling_params": {"max_new_tokens": 4}}
# the largest /score the caps allow: 256 items x 256 timesteps, each response inside one block (65,536 forwards)
MAX_SCORE = {"items": [{"prompt": [40 + i % 50, 41, 42, 43], "response": [60 + (i * 7 + k) % 200 for k in range(20)]}
                       for i in range(256)], "estimator": "elbo", "num_timesteps": 256}
# the echo request: 64 prompts of 960 tokens, echo, logprobs 5, no generation (61,376 forwards)
MAX_ECHO = {"prompt": [[20 + (p * 11 + 7 * i) % 300 for i in range(960)] for p in range(64)], "echo": True,
            "logprobs": 5, "max_tokens": 0}


def _canary(c: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = c.post("/generate", json=CANARY)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def _abandoned(url: str, route: str, body: dict, seconds: float) -> str:
    """Send `body` to `route` and give up after `seconds` (the client closes the connection)."""
    try:
        with httpx.Client(base_url=url, timeout=seconds, trust_env=False) as c:
            r = c.post(route, json=body)
            return f"answered {r.status_code} within {seconds}s"
    except httpx.TimeoutException:
        return "abandoned"


@pytest.mark.parametrize("route,body", [("/score", MAX_SCORE), ("/v1/completions", MAX_ECHO)], ids=["score", "echo"])
def test_a_canary_keeps_its_pace_during_and_after_a_maximal_likelihood_request(plain, route, body) -> None:
    srv, c = plain
    pid = srv.engine_pid()
    _canary(c)  # warm
    idle = max(_canary(c) for _ in range(3))
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(_abandoned(srv.url, route, body, 6.0)))
    t.start()
    time.sleep(1.5)  # the job is running
    during = [_canary(c) for _ in range(4)]
    t.join(60)
    assert result == ["abandoned"], result  # (else the request was too small to hold the engine for 6 s)
    after = [_canary(c) for _ in range(4)]
    deadline = time.monotonic() + 5.0  # the abandoned job is dropped at once, its pages released
    while c.get("/server_info").json()["num_score_jobs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    info = c.get("/server_info").json()
    msg = (f"{route}: canary /generate of 4 tokens: idle {idle:.3f}s, during {[round(x, 3) for x in during]}, "
           f"after abandon {[round(x, 3) for x in after]}")
    print(msg)
    assert info["num_score_jobs"] == 0, (msg, info)
    assert max(during) < 1.0 and max(after) < 1.0, msg
    assert srv.engine_pid() == pid


def test_likelihood_caps_are_400s_naming_the_field(plain) -> None:
    _, c = plain
    too_many = {"prompt": [[20 + (p + 3 * i) % 300 for i in range(1000)] for p in range(70)], "echo": True,
                "logprobs": 0, "max_tokens": 0}
    err = assert_error_shape(c.post("/v1/completions", json=too_many), 400)
    assert err["param"] == "prompt" and "65536" in err["message"], err
    native = {"input_ids": too_many["prompt"], "return_logprob": True, "logprob_start_len": 0,
              "sampling_params": {"max_new_tokens": 1}}
    err = assert_error_shape(c.post("/generate", json=native), 400)
    assert err["param"] == "logprob_start_len" and "65536" in err["message"], err
    # responses of two blocks: twice the maximal plan, refused before it is built
    doubled = [dict(it, response=it["response"] * 2) for it in MAX_SCORE["items"]]
    err = assert_error_shape(c.post("/score", json={**MAX_SCORE, "items": doubled}), 400)
    assert err["param"] == "num_timesteps" and "65536" in err["message"], err


def test_a_grammar_that_fails_mid_decoding_ends_its_request_not_the_engine(faulty) -> None:
    """Issue 24 item 3: an object schema with 499 optional properties passed the HTTP checks and then raised inside
    the engine's step (llguidance: `Current row has 2003 items; max is 2000`), killing the engine process. Now: a 4xx
    (if the HTTP side learns to refuse it) or an error finish (500 naming the reason); the engine lives on."""
    srv, c = faulty
    pid = srv.engine_pid()
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(499)}}
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "json"}], "max_tokens": 40,
                                             "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code in (400, 500), r.text
    err = assert_error_shape(r)
    if r.status_code == 500:
        assert err["code"] == "internal_error" and "grammar" in err["message"], err
    ok = c.post("/generate", json={"input_ids": BYSTANDERS[0], "sampling_params": BYSTANDER_PARAMS})
    assert ok.status_code == 200 and srv.engine_pid() == pid
