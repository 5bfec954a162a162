"""Hardening of the engine loop (issue 24, items 3 and 6): a failure inside a step ends only the request it concerns
(an error finish; the others' tokens are those of a run without it; the engine process lives on), and likelihood
work is a job the loop advances in bounded chunks between decoding iterations, dropped when its client leaves.

Failures are injected at each stage: in-process by setting the core's FaultInjector (engine/faults.py), through a
live server by REDRAFT_FAULT_INJECT (read once at engine start)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

import redraft
from redraft.engine.faults import FaultInjector, InjectedFault
from redraft.engine.likelihood import staircase_variants
from redraft.engine.tiny import make_tiny_checkpoint
from redraft.protocol.sampling_params import SamplingParams
from tests.live_server import RedraftServer, assert_error_shape

PROMPTS = {"ok-a": [11, 12, 13, 14, 15], "ok-b": [40, 41, 42], "ok-c": [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}
GREEDY = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True, "mode": "Q"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hard-engine") / "tiny", seed=0)


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
    assert s.num_leases == 0
    s.cache.check_invariants()
    # every page is free or held by the radix tree (none leaked to the failed request)
    assert s.pool.num_free + s.cache.cached_pages == s.pool.capacity, (stage, s.pool.num_free, s.cache.cached_pages)


def test_the_engine_keeps_serving_after_failures(engine, alone) -> None:
    out = engine.generate(input_ids=PROMPTS["ok-a"], sampling_params=GREEDY)
    assert out["output_ids"] == alone["ok-a"]


def test_a_forward_that_fails_for_every_request_alike_is_an_engine_fault(engine) -> None:
    """What fails for every request on its own is no request's fault: it propagates (the process then exits and
    the HTTP side restarts it) instead of failing the requests one by one forever."""
    from redraft.engine.core import EngineFault

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
    for k in range(3):  # 3 x 1100 positions: 3300 block forwards, 13 chunks of 8192 tokens and a prefill one
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
    assert job_done_at is not None and job_done_at >= 10, job_done_at
    assert finished_at == solo_steps, (finished_at, solo_steps)
    assert core.scheduler.num_leases == 0


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
    assert pool.num_free < free and core.scheduler.num_leases == 1  # the prefix is leased
    core.step()  # one chunk
    assert core.has_work()
    assert core.cancel_score("job-2") and not core.cancel_score("job-2")
    assert core.scheduler.num_leases == 0 and not core.has_work() and not core.take_score_results()
    assert pool.num_free + core.scheduler.cache.cached_pages == pool.capacity


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
    assert core.scheduler.num_leases == 0
