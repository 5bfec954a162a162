"""One chain of defaults for every entry point (protocol/sampling_params.resolve): the request, then the
operator's explicit flags, then the checkpoint's generation_config.json, then the mode preset and built-ins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer
from redraft.engine.text.tokenizer import Tokenizer
from redraft.protocol.sampling_params import PRESETS, Defaults, SamplingParams, resolve

GEN = Defaults(threshold=0.95, edit_threshold=0.05, max_post_steps=1, temperature=0.0, max_new_tokens=40)


def decoding(r) -> tuple:
    return r.mode, r.threshold, r.edit_threshold, r.max_post_steps


def test_request_beats_flags_beats_generation_config_beats_preset() -> None:
    assert decoding(resolve(SamplingParams())) == ("Q", *PRESETS["Q"])
    assert decoding(resolve(SamplingParams(), [Defaults(), GEN])) == ("Q", 0.95, 0.05, 1)
    flags = Defaults(threshold=0.6)
    assert decoding(resolve(SamplingParams(), [flags, GEN])) == ("Q", 0.6, 0.05, 1)
    assert decoding(resolve(SamplingParams(threshold=0.2), [flags, GEN])) == ("Q", 0.2, 0.05, 1)


def test_a_mode_hides_the_thresholds_of_lower_levels() -> None:
    # a request (or an operator flag) naming S gets S's preset, not generation_config.json's thresholds
    assert decoding(resolve(SamplingParams(mode="S"), [Defaults(), GEN])) == ("S", *PRESETS["S"])
    assert decoding(resolve(SamplingParams(), [Defaults(mode="S"), GEN])) == ("S", *PRESETS["S"])
    # ... but its own explicit thresholds still win over its mode
    assert decoding(resolve(SamplingParams(mode="S", threshold=0.9), [Defaults(), GEN])) == ("S", 0.9, 0.0, 16)
    assert resolve(SamplingParams(mode="auto", domain="math"), [Defaults(mode="Q")]).mode == "S"


def test_max_new_tokens_defaults_are_capped_by_the_context() -> None:
    assert resolve(SamplingParams(), prompt_len=10, max_model_len=100).max_new_tokens == 90
    assert resolve(SamplingParams(), [Defaults(max_new_tokens=7)], prompt_len=10, max_model_len=100).max_new_tokens == 7
    # what the request itself asks for is never cut: too long is the engine's 400
    assert resolve(SamplingParams(max_new_tokens=500), prompt_len=10, max_model_len=100).max_new_tokens == 500


def test_generation_config_spellings() -> None:
    d = Defaults.from_generation_config({"editing_threshold": 0.3, "top_k": 0, "block_length": 32, "eos_token_id": 1})
    assert (d.edit_threshold, d.top_k) == (0.3, -1)
    with pytest.raises(ValueError, match="generation_config.json"):
        Defaults.from_generation_config({"threshold": 3.0})


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint, tmp_path_factory) -> Path:
    # a copy: this module rewrites generation_config.json
    path = shutil.copytree(tiny_checkpoint(seed=3), tmp_path_factory.mktemp("gencfg") / "tiny")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 1, "threshold": GEN.threshold, "editing_threshold": GEN.edit_threshold,
         "max_post_steps": GEN.max_post_steps, "temperature": 0.0}))
    return path


PROMPTS = [[20 + i, 30 + 2 * i, 40, 50 + i] for i in range(6)]


@pytest.mark.slow
def test_generation_config_decodes_the_same_through_engine_generate_and_completions(ckpt, tmp_path) -> None:
    import redraft

    engine = redraft.Engine(str(ckpt), progress=False)
    try:
        plain = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 40})]
        explicit = {"max_new_tokens": 40, "threshold": 0.95, "edit_threshold": 0.05, "max_post_steps": 1}
        want = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=explicit)]
        preset = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                            sampling_params={"max_new_tokens": 40, "mode": "Q"})]
    finally:
        engine.shutdown()
    assert plain == want, "the offline Engine applies generation_config.json"
    assert preset != want, "the checkpoint's thresholds must change some output, else this test shows nothing"

    srv = RedraftServer(ckpt, tmp_path, []).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as http:
            native = [http.post("/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 40}}
                                ).json()["output_ids"] for p in PROMPTS]
            completions = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 40}).json()
                           for p in PROMPTS]
    finally:
        srv.stop()
    assert native == want
    # completions answer text: the same ids give the same text, token count and finish
    tok = Tokenizer.from_pretrained(ckpt)
    for r, ids in zip(completions, want):
        choice = r["choices"][0]
        assert choice["text"] == tok.decode(ids)
        assert r["usage"]["completion_tokens"] == len(ids)
        assert choice["finish_reason"] == ("stop" if ids and ids[-1] == tok.eos_token_id else "length")
