"""Watching the decoding (docs/denoise.md), in the offline Engine: `stream_denoise` gives one event per forward
that ends on the answer and never revises a committed block, `return_step_maps` replays onto an all-mask canvas
to the output, and neither changes what is decoded. Over S, Q, MBE windows, structured output, several prompts
at once, sampling, and a stop string that ends the request early (an abort from the output side)."""

from __future__ import annotations

from pathlib import Path

import pytest

import redraft

MASK_STATE = "mask"


@pytest.fixture(scope="module")
def tiny(ckpt: Path):
    """The tiny random checkpoint: it drafts badly and edits a lot, so events and maps have edits to show."""
    eng = redraft.Engine(model_path=str(ckpt), device="cpu", dtype="float32", progress=False)
    yield eng
    eng.shutdown()


def check_events(out: dict, index: int = 0) -> None:
    """The must-holds of one request's events (each from an independent angle: meta_info's step count, the
    answer's text and ids)."""
    meta = out["meta_info"]
    assert all(e["index"] == index for e in out["denoise"])
    assert out["denoise"][-1]["committed_text"] == out["text"]
    assert out["denoise"][-1]["committed_tokens"] == len(out["output_ids"])
    assert all(e["event"] == "commit" for e in out["denoise"] if e["event"] != "forward")
    events = [e for e in out["denoise"] if e["event"] == "forward"]
    assert len(events) == meta["steps"] > 0
    assert [e["forward"] for e in events] == list(range(1, meta["steps"] + 1))
    for a, b in zip(out["denoise"], out["denoise"][1:]):  # a committed block never changes afterwards
        assert b["committed_text"].startswith(a["committed_text"])
        assert b["committed_tokens"] >= a["committed_tokens"]
        if "window" in b:
            assert b["window"]["offset"] >= a["committed_tokens"]  # no later window reaches into it
    for e in events:
        w = e["window"]
        n = len(w["tokens"])
        assert len(w["states"]) == len(w["confidence"]) == len(w["pieces"]) == len(w["replaced"]) == n
        for tok, state, conf, old in zip(w["tokens"], w["states"], w["confidence"], w["replaced"]):
            assert state in ("mask", "drafted", "edited", "kept")
            assert (state == "edited") == (old is not None)
            if state in ("kept", "mask"):
                assert conf is None
        # the window's tokens after the last forward are the answer's wherever they are output
    last = events[-1]["window"]
    for i, tok in enumerate(last["tokens"]):
        pos = last["offset"] + i
        if pos < len(out["output_ids"]):
            assert tok == out["output_ids"][pos]


def replay(maps: dict, n_out: int) -> list[int]:
    """Apply the step maps' placements and edits, forward by forward, to an all-mask canvas."""
    mask = maps["mask_id"]
    canvas = [mask] * n_out
    changes = [(f, pos, mask, tok) for pos, (f, tok) in enumerate(maps["placed"])]
    changes += [(f, pos, old, new) for pos, f, old, new in maps["edits"]]
    for f, pos, old, new in sorted(changes, key=lambda c: c[0]):
        assert canvas[pos] == old, f"forward {f}, position {pos}: the map says it held {old}, not {canvas[pos]}"
        canvas[pos] = new
    return canvas


def check_maps(out: dict) -> None:
    maps, meta = out["meta_info"]["step_maps"], out["meta_info"]
    assert len(maps["placed"]) == len(out["output_ids"])
    assert replay(maps, len(out["output_ids"])) == out["output_ids"]
    forwards = [p[0] for p in maps["placed"]] + [e[1] for e in maps["edits"]]
    assert all(1 <= f <= meta["steps"] for f in forwards)
    for first, last in maps["blocks"]:
        assert 1 <= first <= last <= meta["steps"]


CASES = [dict(mode="S"), dict(mode="Q"), dict(mode="Q", mbe_window=3), dict(mode="S", mbe_window=2),
         dict(mode="Q", temperature=0.8, seed=5), dict(threshold=0.9, edit_threshold=0.3, regex=r"[a-z ]{4,40}\.")]


@pytest.mark.parametrize("params", CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items())[:40])
def test_events_and_maps_hold_and_change_nothing(tiny, params: dict) -> None:
    prompts = [[5, 17, 33, 9], list(range(40, 75))]  # one short, one crossing a block boundary
    base = dict(params, max_new_tokens=70)
    plain = tiny.generate(input_ids=prompts, sampling_params=base)
    seen: list[dict] = []
    got = tiny.generate(input_ids=prompts, sampling_params=dict(base, stream_denoise=True, return_step_maps=True),
                        on_event=seen.append)
    for i, (g, p) in enumerate(zip(got, plain)):
        assert (g["output_ids"], g["meta_info"]["steps"]) == (p["output_ids"], p["meta_info"]["steps"])
        assert g["text"] == p["text"]
        assert "step_maps" not in p["meta_info"] and "denoise" not in p
        check_events(g, index=i)
        check_maps(g)
    assert len(seen) == sum(len(g["denoise"]) for g in got)  # on_event saw each as it came


def test_the_tiny_model_drafts_and_edits(tiny) -> None:
    """The checks above are not vacuous: the events show masks, drafts with confidences and edits with the
    token they replaced, and the maps hold edits."""
    out = tiny.generate(input_ids=[5, 17, 33, 9], sampling_params=dict(mode="Q", max_new_tokens=64, stream_denoise=True,
                                                                      return_step_maps=True))
    forwards = [e for e in out["denoise"] if e["event"] == "forward"]
    states = [s for e in forwards for s in e["window"]["states"]]
    assert {"mask", "drafted", "edited", "kept"} <= set(states)
    confs = [c for e in forwards for c in e["window"]["confidence"] if c is not None]
    assert confs and all(0.0 < c <= 1.0 for c in confs)
    assert out["meta_info"]["step_maps"]["edits"]
    assert out["meta_info"]["edits"] > 0


def test_a_stop_string_cuts_the_events_where_it_cuts_the_answer(tiny) -> None:
    """The output side ends the request at a stop string (an abort with the tokens to keep): the last event's
    committed text is the answer's, cut there; every forward the engine ran has its event."""
    full = tiny.generate(input_ids=[5, 17, 33, 9], sampling_params=dict(mode="S", max_new_tokens=96))
    text = full["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    assert stop.strip() and text.index(stop) < len(text) - 2
    params = dict(mode="S", max_new_tokens=96, stop=[stop])
    plain = tiny.generate(input_ids=[5, 17, 33, 9], sampling_params=params)
    got = tiny.generate(input_ids=[5, 17, 33, 9], sampling_params=dict(params, stream_denoise=True))
    assert got["text"] == plain["text"] and len(got["text"]) < len(text)
    assert len([e for e in got["denoise"] if e["event"] == "forward"]) == got["meta_info"]["steps"]
    assert got["denoise"][-1]["committed_text"] == plain["text"]


def test_show_steps_draws_each_forward(tiny) -> None:
    """The terminal view: one line per forward where stdout is no terminal; on a terminal each forward redraws
    the picture in place (cursor back up, erase) and the picture is gone at the end."""
    import io

    from redraft.show_steps import StepPrinter

    params = dict(mode="Q", max_new_tokens=64, stream_denoise=True)
    out = tiny.generate(input_ids=[5, 17, 33, 9], sampling_params=params)
    plain, tty = io.StringIO(), io.StringIO()
    lines, drawn = StepPrinter(plain, tty=False), StepPrinter(tty, tty=True)
    for e in out["denoise"]:
        lines(e)
        drawn(e)
    drawn.finish()
    rows = plain.getvalue().splitlines()
    assert len(rows) == len(out["denoise"]) and all(r.startswith("forward") for r in rows)
    assert "[" in "".join(rows) and ">" in "".join(rows)  # edits as [old>new]
    assert tty.getvalue().count("\x1b[J") == len(out["denoise"])  # every picture after the first, and the end


def test_generate_command_shows_steps(tmp_path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "redraft", "generate", "Count from 7 to 30.", "--show-steps"],
                       capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                         "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("7 8 9")
    forwards = [ln for ln in r.stderr.splitlines() if ln.startswith("forward")]
    summary = next(ln for ln in r.stderr.splitlines() if ln.startswith("["))
    assert forwards and f"{len([f for f in forwards if 'without a forward' not in f])} forwards" in summary


def test_preemption_rolls_the_maps_back_and_renumbers_the_forwards(ckpt: Path, tiny) -> None:
    """A KV cache far too small for the batch: blocks are preempted and start over. The step maps are those of
    the roomy engine (what a preempted block recorded is dropped), and the events, kept last per forward number,
    are the roomy engine's."""
    prompts = [[5 + k, 17, 33, 9 + k] for k in range(6)]
    params = dict(mode="Q", max_new_tokens=96, ignore_eos=True, return_step_maps=True, stream_denoise=True)
    small = redraft.Engine(model_path=str(ckpt), device="cpu", dtype="float32", progress=False,
                           max_total_tokens=8 * 32)
    try:
        got = small.generate(input_ids=prompts, sampling_params=params)
        assert small.core.scheduler.num_preemptions > 0, "the cache was large enough: nothing was preempted"
    finally:
        small.shutdown()
    want = tiny.generate(input_ids=prompts, sampling_params=params)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["step_maps"] == w["meta_info"]["step_maps"]
        last = {e["forward"]: e for e in g["denoise"] if e["event"] == "forward"}
        roomy = [e for e in w["denoise"] if e["event"] == "forward"]
        assert sorted(last) == [e["forward"] for e in roomy]
        for a, b in zip((last[f] for f in sorted(last)), roomy):
            # the same decoding; p in float32 differs in the last digits with the batch's make-up
            assert {**a["window"], "confidence": None} == {**b["window"], "confidence": None}
            assert [c is None for c in a["window"]["confidence"]] == [c is None for c in b["window"]["confidence"]]
            assert all(abs(x - y) < 1e-3 for x, y in zip(a["window"]["confidence"], b["window"]["confidence"])
                       if x is not None)
            assert (a["committed_tokens"], a["committed_text"]) == (b["committed_tokens"], b["committed_text"])
        assert g["denoise"][-1]["committed_text"] == g["text"]


def test_without_the_flags_nothing_more_is_read_or_recorded(tiny, monkeypatch) -> None:
    """No stream_denoise row in a batch: the step's device read has no confidence columns (denoise_columns is never
    called) and no request holds a recorder."""
    import redraft.engine.runtime.output as runner_module
    from redraft.scheduler.request import Request

    def refuse(*_: object) -> None:
        raise AssertionError("confidences read back for a batch that did not ask")

    traces: list[object] = []
    apply_step = Request.apply_step
    monkeypatch.setattr(runner_module, "denoise_columns", refuse)
    monkeypatch.setattr(Request, "apply_step", lambda self, *a, **k: (traces.append(self.state.trace),
                                                                      apply_step(self, *a, **k))[1])
    out = tiny.generate(input_ids=[[5, 17, 33, 9], list(range(40, 75))], sampling_params=dict(max_new_tokens=40))
    assert all(o["output_ids"] for o in out) and traces and all(t is None for t in traces)


def test_an_aborted_request_ends_its_events_on_what_it_committed(tiny) -> None:
    """The engine ends a request mid-decoding (/abort_request, a client gone): its events still number every
    forward it ran, and the last one's committed text is the aborted answer's."""
    from redraft.engine.text.output_stream import OutputStream
    from redraft.protocol.sampling_params import SamplingParams

    core = tiny.core
    params = SamplingParams(mode="Q", max_new_tokens=160, ignore_eos=True, stream_denoise=True)
    core.add_request("abort-me", [5, 17, 33, 9], params)
    stream = OutputStream("abort-me", tiny.tokenizer)
    stream.denoise = True
    events: list[dict] = []
    for _ in range(400):
        if stream.ids:  # mid-decoding, with a block committed
            core.abort("abort-me")
        for out in core.step():
            stream.add(out)
            events += stream.new_events
        if stream.finished:
            break
    assert stream.finished and stream.finish_reason["type"] == "abort"
    forwards = [e for e in events if e["event"] == "forward"]
    assert 0 < len(forwards) == stream.meta["steps"]
    assert 0 < len(stream.ids) < 160
    assert events[-1]["committed_text"] == stream.text


@pytest.mark.parametrize("mode", ["S", "Q"])
def test_levenshtein_rows_stream_and_replay(tiny_checkpoint, mode: str) -> None:
    """LLaDA2.2's step moves positions (DELETE, SPLIT): events and maps describe the window position by position,
    and still count every forward, end on the answer and replay to it."""
    eng = redraft.Engine(model_path=str(tiny_checkpoint(0, llada22=True)), device="cpu", dtype="float32",
                         progress=False)
    try:
        prompts = [[5, 17, 33, 9], list(range(40, 75))]
        base = dict(mode=mode, max_new_tokens=64)
        plain = eng.generate(input_ids=prompts, sampling_params=base)
        got = eng.generate(input_ids=prompts, sampling_params=dict(base, stream_denoise=True, return_step_maps=True))
    finally:
        eng.shutdown()
    assert sum(p["meta_info"]["deletions"] + p["meta_info"]["insertions"] for p in plain) > 0  # edits happened
    for i, (g, p) in enumerate(zip(got, plain)):
        assert (g["output_ids"], g["meta_info"]["steps"]) == (p["output_ids"], p["meta_info"]["steps"])
        check_events(g, index=i)
        check_maps(g)
