"""The offline `redraft.Engine` contract: inputs, outputs, stops, errors, and the CLI around it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import redraft
from redraft.protocol.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def engine(ckpt: Path):
    eng = redraft.Engine(str(ckpt), progress=False)
    yield eng
    eng.shutdown()


def test_text_prompt_returns_text_ids_and_meta(engine):
    out = engine.generate(prompt="The cat sees the river", sampling_params={"max_new_tokens": 40, "mode": "Q"})
    meta = out["meta_info"]
    assert set(meta) >= {"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "steps"}
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The cat sees the river"))
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 40
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])
    assert meta["steps"] >= 1 and meta["mode"] == "Q"
    if meta["finish_reason"]["type"] == "length":
        assert len(out["output_ids"]) == 40
    else:
        assert out["output_ids"][-1] == engine.tokenizer.eos_token_id


def test_messages_are_rendered_with_the_chat_template(engine):
    chat = [{"role": "user", "content": "The cat sees the river"}]
    params = {"max_new_tokens": 24}
    out = engine.generate(messages=chat, sampling_params=params)
    assert out == {**engine.generate(input_ids=engine.tokenizer.encode_chat(chat), sampling_params=params),
                   "meta_info": out["meta_info"]}
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode_chat(chat))
    other = [{"role": "user", "content": "one two"}]
    outs = engine.generate(messages=[chat, other], sampling_params=params)  # a list of chats: a list of answers
    assert [o["output_ids"] for o in outs] == [out["output_ids"],
                                               engine.generate(messages=other, sampling_params=params)["output_ids"]]
    with pytest.raises(ValueError, match="exactly one of"):
        engine.generate(messages=chat, prompt="x")


def test_list_in_list_out_in_order(engine):
    prompts = ["one two", "three", "four five six"]
    outs = engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 8})
    assert isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs):
        assert o["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(p))


def test_max_new_tokens_one_cuts_the_decoded_block(engine):
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1, "ignore_eos": True})
    assert len(out["output_ids"]) == 1
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ids_end_after_the_block_and_cut_at_the_token(engine):
    params = {"max_new_tokens": 96, "mode": "S", "ignore_eos": True}
    free = engine.generate(input_ids=[11, 12, 13, 14], sampling_params=params)["output_ids"]
    stop = free[40]  # a token in the second block
    first = free.index(stop)
    out = engine.generate(input_ids=[11, 12, 13, 14], sampling_params={**params, "stop_token_ids": [stop]})
    assert out["output_ids"] == free[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_string_is_cut_from_the_text(engine):
    params = {"max_new_tokens": 96, "mode": "S", "ignore_eos": True}
    free = engine.generate(input_ids=[21, 22, 23], sampling_params=params)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = engine.generate(input_ids=[21, 22, 23], sampling_params={**params, "stop": [stop]})
    assert out["text"] == text[: text.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_input_errors_are_clear(engine):
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate(prompt="x", input_ids=[1])
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(input_ids=[10**9])
    with pytest.raises(ValueError, match="maximum context length"):
        engine.generate(input_ids=[5] * 100, sampling_params={"max_new_tokens": engine.max_model_len})
    with pytest.raises(ValueError, match="2 sampling_params for 1"):
        engine.generate(input_ids=[[5]], sampling_params=[{}, {}])
    with pytest.raises(SamplingParamsError, match="unsupported"):
        engine.generate(input_ids=[5], sampling_params={"best_of": 2})
    with pytest.raises(SamplingParamsError, match="frequency_penalty"):
        engine.generate(input_ids=[5], sampling_params={"frequency_penalty": 2.5})


def test_pages_are_returned_after_every_call(engine):
    sched = engine.core.scheduler
    engine.generate(input_ids=[[5] * 70, [6] * 3], sampling_params={"max_new_tokens": 50})
    # finished requests hand their exact blocks to the prefix cache and hold nothing themselves
    assert sched.cache.cached_pages > 0
    assert sched.pool.num_used == sched.cache.cached_pages and sched.cache.protected_pages == 0
    with pytest.raises(ValueError):
        engine.generate(input_ids=[[5], [10**9]])
    assert sched.pool.num_used == sched.cache.cached_pages
    assert sched.flush_cache() and sched.pool.num_used == 0


def test_engine_without_a_model_serves_the_bundled_demo_model():
    from redraft.engine.text.model_path import BUNDLED_MODEL_DIR, default_model_path

    assert (BUNDLED_MODEL_DIR / "config.json").is_file(), "the demo model is package data: is it installed?"
    assert default_model_path() == BUNDLED_MODEL_DIR


def test_without_a_bundled_model_a_tiny_random_one_and_a_warning(tmp_path, monkeypatch, caplog):
    import redraft.engine.text.model_path as model_path

    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path))
    monkeypatch.setattr(model_path, "BUNDLED_MODEL_DIR", tmp_path / "not-installed")
    eng = redraft.Engine(progress=False)
    try:
        out = eng.generate(prompt="hello", sampling_params={"max_new_tokens": 4})
    finally:
        eng.shutdown()
    assert len(out["output_ids"]) <= 4
    assert "tiny RANDOM checkpoint" in caplog.text
    assert (tmp_path / ".cache" / "redraft" / "tiny-random-seed0" / "config.json").is_file()


def test_cli_generate_and_make_tiny(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "redraft", "make-tiny", str(tmp_path / "m"), "--seed", "2"],
                   check=True, env=env, capture_output=True)
    res = subprocess.run(
        [sys.executable, "-m", "redraft", "generate", "--model", str(tmp_path / "m"), "--max-new-tokens", "5",
         "--json", "--log-level", "warning", "Hi"],
        check=True, env=env, capture_output=True, text=True,
    )
    out = json.loads(res.stdout)
    assert len(out["output_ids"]) <= 5 and "steps" in out["meta_info"]
    bad = subprocess.run([sys.executable, "-m", "redraft", "generate", "--model", str(tmp_path / "nope"), "x"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
