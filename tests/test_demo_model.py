"""The bundled demo model (engine/demo_model, package data): what it is, and that it answers.

The expected answers come from the task generator (training/tasks.py, correct by construction), never from the
model. FIXED are problems a user would try (they happen to fall in the training split); the accuracy tests use
held-out problems (the evaluation split), checked here to be so.
"""

from __future__ import annotations

import json

import openai
import pytest

import redraft
import redraft.engine.tokenizer
from live_server import RedraftServer
from redraft.engine.defaults import BUNDLED_MODEL_DIR
from redraft.training.tasks import (CODE_WORDS, FAMILIES, eval_set, is_correct, make_chat, make_code, make_math, make_reverse,
                                    make_sort, render_prompt, split_of)

MAX_BYTES = 25 * 1024 * 1024
# Two fixed problems per family (12 + 30 is the README's example).
FIXED = [make_math(12, "+", 30), make_math(7, "-", 64), make_reverse("planet"), make_reverse("xqz"),
         make_sort([42, 7, 99, 13]), make_sort([5, 81, 23]), make_code("combine_data", "sum"),
         make_code("pick_best", "maximum"), make_chat("zebra", 0), make_chat("owl", 0)]


@pytest.fixture(scope="module")
def engine():
    eng = redraft.Engine(progress=False, cpu_threads=1)  # no model: the bundled one
    yield eng
    eng.shutdown()


def _answer(eng, examples, **params):
    prompts = [eng.tokenizer.encode(render_prompt(ex, eng.tokenizer)) for ex in examples]
    return eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 64, "temperature": 0.0, **params})


def test_bundled_files_are_a_small_llada2_moe():
    files = {p.name: p.stat().st_size for p in BUNDLED_MODEL_DIR.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert name in files, f"{name} missing from {BUNDLED_MODEL_DIR}"
    assert sum(files.values()) <= MAX_BYTES
    cfg = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe"
    assert cfg["num_experts"] >= 8 and cfg["n_group"] > 1 and cfg["score_function"] == "sigmoid"
    assert "chat_template" in json.loads((BUNDLED_MODEL_DIR / "tokenizer_config.json").read_text())


def test_engine_without_a_model_answers_fixed_problems(engine):
    """The model is ~95% right on held-out problems (README), so one miss in ten is allowed; 12 + 30 must be right."""
    code_words = [w for ex in FIXED if ex.family == "code" for w in ex.user.split()[5].split("_")]
    assert set(code_words) <= set(CODE_WORDS)  # fixed problems come from the task distribution
    outs = _answer(engine, FIXED)
    got = [o["text"] for o in outs]
    assert outs[0]["text"].strip() == "42", got
    right = [is_correct(ex, o["text"]) for ex, o in zip(FIXED, outs)]
    assert sum(right) >= len(FIXED) - 1, list(zip([ex.user for ex in FIXED], got))


@pytest.mark.parametrize("mode", ["Q", "S"])
def test_held_out_accuracy_per_family(engine, mode):
    """A small slice of `redraft eval-demo` (which runs 200 per family): issue 5's per-family floor of 75%."""
    exs = eval_set(seed=4242, per_family=20)
    assert all(split_of(ex.key, ex.family) == "eval" for ex in exs)
    outs = _answer(engine, exs, mode=mode)
    for family in FAMILIES:
        pairs = [(ex, o) for ex, o in zip(exs, outs) if ex.family == family]
        acc = sum(is_correct(ex, o["text"]) for ex, o in pairs) / len(pairs)
        assert acc >= 0.75, (family, acc, [(ex.user, o["text"]) for ex, o in pairs if not is_correct(ex, o["text"])])


def test_s_mode_fills_more_tokens_per_forward_than_q(engine):
    exs = eval_set(seed=4242, per_family=20)
    tpf = {}
    for mode in ("Q", "S"):
        outs = _answer(engine, exs, mode=mode)
        tpf[mode] = sum(o["meta_info"]["completion_tokens"] for o in outs) / sum(o["meta_info"]["steps"] for o in outs)
    assert tpf["S"] > tpf["Q"], tpf


def test_serve_with_no_arguments_answers_through_the_openai_api(request, tmp_path_factory):
    srv = RedraftServer(None, tmp_path_factory.mktemp("demo-serve"), [])
    request.addfinalizer(srv.stop)
    srv.start()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        model = client.models.list().data[0].id
        for extra in ({}, {"mode": "S"}):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 12 + 30?"}],
                                               temperature=0, extra_body=extra)
            assert r.choices[0].message.content.strip() == "42", (extra, r)
            assert r.choices[0].finish_reason == "stop"
    finally:
        client.close()


def test_fp8_tokens_agree_with_bf16_on_the_demo_model(capsys):
    """Issue 7's criterion, on a trained model (the random tiny one amplifies any rounding): greedy outputs of
    quantization="fp8" against bf16 over a fixed prompt set (held-out task problems), Q and S."""
    from redraft.clients.bench_moe import fp8_agreement

    res = fp8_agreement(n_prompts=40, max_new_tokens=64, path=BUNDLED_MODEL_DIR)
    assert res["prompts"] == 40
    with capsys.disabled():
        print("\n  demo model, 40 held-out prompts: FP8 vs bf16 token agreement "
              + ", ".join(f"{m} {100 * res[f'{m}:fp8_vs_bf16']['agreement']:.1f}%" for m in ("S", "Q")))
    for mode in ("S", "Q"):
        assert res[f"{mode}:fp8_vs_bf16"]["agreement"] >= 0.9, res
        assert res[f"{mode}:fp8"]["tokens"] > 0


def test_fp8_layers_on_real_activations():
    """Issue 7's layer criterion on a trained model: every W8A8 layer (qkv, o_proj, dense MLP, MoE with its
    shared expert) against the unquantised layer on the model's own activations: cosine >= 0.999, rel L2 < 5%."""
    from redraft.clients.bench_moe import fp8_layer_errors

    eng_tok = redraft.engine.tokenizer.Tokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    prompts = [eng_tok.encode(render_prompt(ex, eng_tok)) for ex in eval_set(seed=7, per_family=2)]
    rows = fp8_layer_errors(BUNDLED_MODEL_DIR, prompts)
    assert {r["kind"] for r in rows} >= {"Fp8Linear", "Fp8DenseMLP", "MoE"}
    for r in rows:
        assert r["cosine"] >= 0.999 and r["rel_l2"] < 0.05, r
