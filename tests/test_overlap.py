"""The overlap scheduler (engine/runtime/overlap.py) against the serial loop (`disable_overlap`), on the tiny float32
checkpoint: speculative forwards are actually used in a long denoising run and counted nowhere, and every
message the core sends (tokens, finishes, logprobs, steps) is identical with overlap on and off, also when an
abort, an admission or a likelihood job arrives while a speculative forward runs, for a batch mixing sampling,
logprobs, logit controls, a grammar and an MBE window, and with injected per-request failures. A guess that
passed a corrupted check would change the output: the last test shows that these scenarios see it.
(The float64 exactness suites run with overlap on and off too: test_engine_exactness, test_mbe,
test_logit_controls, test_structured_output.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from test_engine_exactness import OVERLAP_ARGS

import redraft
from redraft.engine.runtime import overlap as overlap_module
from redraft.engine.runtime.core import EngineCore
from redraft.engine.text.likelihood import Variant
from redraft.protocol.sampling_params import SamplingParams
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.page_pool import PagePool

Script = dict[int, Callable[[EngineCore], None]]


@pytest.fixture(scope="module", params=["thread", pytest.param("inline", marks=pytest.mark.slow)])
def engines(ckpt: Path, request) -> Iterator[dict[str, Any]]:
    """The overlap engine runs its speculative forward on a worker thread (CPU's way) or, as on CUDA, on the
    calling thread before the host's work (`Overlap.inline`: on CPU that hides nothing, but every decision and
    every drop are the same code as on a GPU)."""
    pair = {o: redraft.Engine(model_path=str(ckpt), progress=False, **OVERLAP_ARGS[o]) for o in ("on", "off")}
    if request.param == "inline":
        core = pair["on"].core
        core.overlap.shutdown()
        core.overlap = overlap_module.Overlap(core.runner, core.scheduler, None, inline=True)
    assert pair["on"].core.overlap.inline == (request.param == "inline")
    yield pair
    for e in pair.values():
        e.shutdown()


def _prompt(k: int, n: int) -> list[int]:
    return [(7 * k + 3 * i) % 300 + 5 for i in range(n)]


def drive(core: EngineCore, reqs: list[tuple[str, list[int], dict]], script: Script | None = None) -> list[tuple]:
    """Submit `reqs`, step the core to the end (running script[k] before step k) and return every message as
    comparable values (no clocks)."""
    core.add_requests([(rid, ids, SamplingParams.from_dict(p)) for rid, ids, p in reqs])
    script, log, k = script or {}, [], 0
    base = core.num_forwards  # first_forward counts the engine's forwards: relative to this run's start
    while core.has_work() or k in script:
        if k in script:
            script[k](core)
        for o in core.step():
            meta = {key: o.meta.get(key) for key in ("steps", "blocks", "completion_tokens", "edits")}
            if o.meta.get("first_forward") is not None:
                meta["first_forward"] = o.meta["first_forward"] - base
            log.append((k, o.rid, list(o.new_ids), o.finished, json.dumps(o.finish_reason), o.new_logprobs,
                        o.new_top_logprobs, meta))
        for r in core.take_score_results():
            log.append((k, r.token, json.dumps(r.results), r.status))
        k += 1
        assert k < 5000
    return log


def both(engines: dict[str, Any], reqs: list[tuple[str, list[int], dict]], script: Script | None = None
         ) -> tuple[list[tuple], list[tuple]]:
    return drive(engines["on"].core, reqs, script), drive(engines["off"].core, reqs, script)


def _long(n: int, new: int = 256) -> list[tuple[str, list[int], dict]]:
    return [(f"r{k}", _prompt(k, 5 + 9 * k), {"max_new_tokens": new, "ignore_eos": True, "mode": "Q"}) for k in range(n)]


def test_speculative_forwards_are_used_and_count_nowhere(engines) -> None:
    on, off = engines["on"].core, engines["off"].core
    assert on.info()["overlap"] == "on" and off.info()["overlap"] == "off: --disable-overlap"
    before = {name: (c.num_forwards, c.num_overlapped_forwards, c.overlap.num_dropped) for name, c in
              (("on", on), ("off", off))}
    got, want = both(engines, _long(4))
    assert got == want  # tokens, finishes and steps of every message
    forwards = on.num_forwards - before["on"][0]
    used = on.num_overlapped_forwards - before["on"][1]
    assert forwards == off.num_forwards - before["off"][0]  # dropped speculative forwards are not forwards
    # all but the first forward (nothing ran before it) and the one after each request's last block, through
    # every block start (8 blocks each): the guesses of new blocks' pages held, and none was dropped
    assert forwards - used <= 1 + 4, f"only {used} of {forwards} forwards were overlapped"
    assert on.overlap.num_dropped == before["on"][2]
    assert off.num_overlapped_forwards == 0 and off.overlap.num_dropped == 0
    assert sum(m[-1]["steps"] for m in got if m[3]) == sum(m[-1]["steps"] for m in want if m[3])


def _first_pending(engine: Any, reqs: list[tuple[str, list[int], dict]], after: int) -> int:
    """The first step index >= after before which the overlap engine has a speculative forward in flight."""
    found: list[int] = []

    def probe(k: int) -> Callable[[EngineCore], None]:
        def check(core: EngineCore) -> None:
            if not found and core.overlap._pending is not None:
                found.append(k)
        return check

    drive(engine.core, reqs, {k: probe(k) for k in range(after, 400)})
    assert found, "no speculative forward was ever in flight"
    return found[0]


def test_abort_while_a_speculative_forward_runs(engines) -> None:
    reqs = _long(3, new=160)
    k = _first_pending(engines["on"], [(r + "x", ids, p) for r, ids, p in reqs], after=6)
    dropped = engines["on"].core.overlap.num_dropped
    got, want = both(engines, reqs, {k: lambda core: core.abort("r1")})
    assert got == want
    assert any(m[1] == "r1" and m[3] and '"abort"' in m[4] for m in got)
    assert engines["on"].core.overlap.num_dropped > dropped


def test_admission_while_a_speculative_forward_runs(engines) -> None:
    reqs = _long(2, new=128)
    k = _first_pending(engines["on"], [(r + "x", ids, p) for r, ids, p in reqs], after=5)
    late = SamplingParams.from_dict({"max_new_tokens": 70, "mode": "S"})
    got, want = both(engines, reqs, {k: lambda core: core.add_request("late", _prompt(9, 40), late)})
    assert got == want
    assert any(m[1] == "late" and m[3] for m in got)


def test_a_likelihood_job_arriving_mid_decode(engines) -> None:
    reqs = _long(2, new=128)
    k = _first_pending(engines["on"], [(r + "x", ids, p) for r, ids, p in reqs], after=4)
    seq = _prompt(4, 70)
    variants = [Variant(0, 1, (40, 41, 42), (40, 41, 42)), Variant(0, 2, (64, 65), (64, 65))]
    got, want = both(engines, reqs, {k: lambda core: core.add_score_job("job", [seq], variants, top_k=2)})
    assert got == want
    assert any(m[1] == "job" and m[-1] == 200 for m in got), "the job did not finish"


def test_mixed_batch_sampling_logprobs_controls_grammar_windows(engines) -> None:
    common = {"max_new_tokens": 96, "mode": "Q"}
    kinds = [
        {},
        {"temperature": 0.9, "seed": 11, "top_k": 20},
        {"temperature": 0.7, "seed": 12, "top_p": 0.9, "mbe_window": 2},
        {"logprobs": True, "top_logprobs": 3},
        {"frequency_penalty": 1.0, "logit_bias": {"40": 4.0}, "min_tokens": 40},
        {"mbe_window": 3, "ignore_eos": True},
        {"json_schema": json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 5})},
        {"regex": "[a-z]{2,6}( [a-z]{2,6}){0,6}", "temperature": 0.5, "seed": 3},
    ]
    reqs = [(f"m{k}", _prompt(k, 3 + 11 * k), dict(common, **extra)) for k, extra in enumerate(kinds)]
    got, want = both(engines, reqs)
    assert got == want
    assert any(m[5] for m in got), "no logprobs came back"


def test_preemption_in_a_tiny_kv_pool(ckpt: Path) -> None:
    reqs = _long(4, new=120)
    outs = {}
    for o in ("on", "off"):
        with redraft.Engine(model_path=str(ckpt), progress=False, **OVERLAP_ARGS[o],
                            max_total_tokens=9 * 32) as eng:
            outs[o] = drive(eng.core, reqs)
            assert eng.core.scheduler.num_preemptions > 0
            if o == "on":
                assert eng.core.num_overlapped_forwards > 0
    assert outs["on"] == outs["off"]


def test_injected_failures(ckpt: Path, monkeypatch) -> None:
    """A request whose forward or sweep fails ends alone (the batch is rerun in halves), with overlap as without."""
    monkeypatch.setenv("REDRAFT_FAULT_INJECT", "forward:bad-fwd,controls:bad-ctl")
    reqs = _long(3, new=96) + [("bad-fwd", _prompt(5, 20), {"max_new_tokens": 64}),
                               ("bad-ctl", _prompt(6, 20), {"max_new_tokens": 64, "frequency_penalty": 0.5})]
    outs = {}
    for o in ("on", "off"):
        with redraft.Engine(model_path=str(ckpt), progress=False, **OVERLAP_ARGS[o]) as eng:
            outs[o] = drive(eng.core, reqs)
    assert outs["on"] == outs["off"]
    assert {m[1] for m in outs["on"] if '"error"' in m[4]} == {"bad-fwd", "bad-ctl"}


def test_only_an_exact_guess_is_used(engines, monkeypatch) -> None:
    """The check compares the whole forward: a guess with one wrong query token is always dropped (and the
    output stays exact); the same guess let through by a check that compares nothing changes the output, so the
    comparisons above would catch a wrong speculation."""
    real = overlap_module.next_iteration

    def corrupted(*args: Any) -> Any:
        guess = real(*args)
        if guess is not None:
            guess[1].input_ids[0] = (guess[1].input_ids[0] + 1) % 300
        return guess

    monkeypatch.setattr(overlap_module, "next_iteration", corrupted)
    on = engines["on"].core
    used = on.num_overlapped_forwards
    got, want = both(engines, _long(2, new=96))
    assert got == want and on.num_overlapped_forwards == used
    monkeypatch.setattr(overlap_module, "same_forward", lambda a, b: True)
    wrong = drive(on, _long(2, new=96))
    assert on.num_overlapped_forwards > used
    assert wrong != want


def test_when_it_is_off() -> None:
    assert overlap_module.off_reason(ServerArgs(tp_size=2)).startswith("tensor parallelism")
    assert overlap_module.off_reason(ServerArgs(disable_overlap=True)) == "--disable-overlap"
    assert overlap_module.off_reason(ServerArgs()).startswith("the default")
    assert overlap_module.off_reason(ServerArgs(device="cuda")).startswith("the default")  # measured slower there
    assert overlap_module.off_reason(ServerArgs(enable_overlap=True)) is None
    assert overlap_module.off_reason(ServerArgs(device="cuda", enable_overlap=True)) is None
    assert overlap_module.off_reason(ServerArgs(enable_overlap=True, disable_overlap=True)) == "--disable-overlap"


def test_the_overlap_scheduler_wraps_the_runner_and_off_costs_nothing(engines) -> None:
    """On, the loop runs each batch through `Overlap.run`; off, through `ModelRunner.run` itself: nothing of the
    overlap scheduler is called per iteration (and replacing it, as the fixture does, rewires the loop)."""
    on, off = engines["on"].core, engines["off"].core
    assert off._run_batch == off.runner.run
    assert on._run_batch != on.runner.run and on.overlap.enabled and not off.overlap.enabled
    calls = []
    run = on.overlap.run
    on.overlap.run = lambda items, busy=False: (calls.append(len(items)), run(items, busy))[1]
    try:
        drive(on, _long(1, new=32))
    finally:
        del on.overlap.run
    assert calls and all(n == 1 for n in calls)


def test_inline_on_cuda_a_thread_on_cpu() -> None:
    """On CUDA the speculative forward is queued from the host's thread (launches are asynchronous); on CPU it
    needs a worker thread. Off, neither."""
    import types

    import torch

    for device, inline in (("cuda", True), ("cpu", False)):
        runner = types.SimpleNamespace(device=torch.device(device))
        ov = overlap_module.Overlap(runner, None, None)
        assert ov.enabled and ov.inline == inline and (ov._pool is None) == inline
        ov.shutdown()
        off = overlap_module.Overlap(runner, None, "--disable-overlap")
        assert not off.enabled and off._pool is None


def test_page_pool_peek_is_the_next_allocations() -> None:
    pool = PagePool(8)
    pool.free(pool.alloc(5)[1:4])  # a free list out of id order
    want = pool.peek(4)
    assert pool.num_free == 6 and pool.peek(7) is None and pool.peek(0) == []
    assert [pool.alloc(1)[0] for _ in range(4)] == want


def test_a_long_prompt_prefilled_in_chunks(ckpt: Path) -> None:
    """A prompt longer than the prefill budget runs as prefill chunks beside decoding requests (no guess then)."""
    reqs = _long(2, new=96) + [("long", _prompt(7, 300), {"max_new_tokens": 64, "mode": "S"})]
    outs = {}
    for o in ("on", "off"):
        with redraft.Engine(model_path=str(ckpt), progress=False, chunked_prefill_size=64, **OVERLAP_ARGS[o]) as eng:
            outs[o] = drive(eng.core, reqs[:2], {6: lambda core: core.add_request(
                "long", reqs[2][1], SamplingParams.from_dict(reqs[2][2]))})
    assert outs["on"] == outs["off"]
    assert any(m[1] == "long" and m[3] for m in outs["on"])
