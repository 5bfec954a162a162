"""The likelihood routes through a live server: echo + logprobs on /v1/completions (lm-eval's loglikelihood
requests), SGLang's input_token_logprobs on /generate, /score, and the tokenizer routes; values equal to the
offline engine's."""

from __future__ import annotations

import httpx
import pytest

import redraft
from live_server import RedraftServer, assert_error_shape


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = redraft.Engine(str(ckpt), progress=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def http(request, ckpt, tmp_path_factory):
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("lk-log"), [])
    request.addfinalizer(srv.stop)
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        yield c


PROMPT = [20 + (7 * i) % 300 for i in range(45)]


def test_echo_is_lm_evals_loglikelihood_request(http, engine) -> None:
    """lm-eval local-completions sends token ids, echo, logprobs 1, max_tokens 1 and sums
    token_logprobs[ctxlen:-1]: P entries for the prompt (the first None) and one for the generated token."""
    want = engine.prompt_logprobs(PROMPT, start=1, top_k=1)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1,
                                           "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(PROMPT) + 1 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(PROMPT)] == pytest.approx([w[0] for w in want[1:]], abs=1e-4)
    for token, value, top in zip(lp["tokens"][1 : len(PROMPT)], lp["token_logprobs"][1 : len(PROMPT)],
                                 lp["top_logprobs"][1 : len(PROMPT)]):
        # the best and the prompt's own token (always there, as in OpenAI's and vLLM's); == when it is the argmax
        assert 1 <= len(top) <= 2 and token in top and max(top.values()) >= value - 1e-9
    greedy = [i for i in range(1, len(PROMPT)) if want[i][1][0][0] == PROMPT[i]]
    for i in greedy:
        assert lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())
    # scoring alone (max_tokens 0), batched, and from logprob_start_len
    r = http.post("/v1/completions", json={"prompt": [PROMPT, PROMPT[:20]], "echo": True, "logprobs": 0,
                                           "max_tokens": 0, "logprob_start_len": 10})
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["token_logprobs"]) for c in choices] == [45, 20]
    assert choices[0]["logprobs"]["token_logprobs"][:10] == [None] * 10
    assert choices[0]["logprobs"]["token_logprobs"][10:] == pytest.approx([w[0] for w in want[10:]], abs=1e-4)
    assert choices[1]["logprobs"]["token_logprobs"][10:] == pytest.approx([w[0] for w in want[10:20]], abs=1e-4)
    assert r.json()["usage"]["completion_tokens"] == 0


def test_generate_returns_input_token_logprobs(http, engine) -> None:
    want = engine.prompt_logprobs(PROMPT, start=1, top_k=2)
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                                     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}).json()
    inp = r["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == PROMPT and inp[0][0] is None
    assert [v for v, _, _ in inp[1:]] == pytest.approx([w[0] for w in want[1:]], abs=1e-4)
    assert all(len(alts) == 2 for alts in r["meta_info"]["input_top_logprobs"][1:])
    assert len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"])


def test_score_route_equals_the_engine(http, engine) -> None:
    items = [(PROMPT[:30], PROMPT[30:]), (PROMPT[:5], PROMPT[5:9])]
    for kw in ({"estimator": "elbo", "num_timesteps": 4, "masking": "count", "seed": 3},
               {"estimator": "staircase"}, {"estimator": "exact"}):
        if kw["estimator"] == "exact":
            items_kw = items[1:]
        else:
            items_kw = items
        r = http.post("/score", json={"items": [{"prompt": p, "response": q} for p, q in items_kw], **kw})
        assert r.status_code == 200, r.text
        want = engine.score(items_kw, **kw)
        got = r.json()["results"]
        assert [g["estimate"] for g in got] == pytest.approx([w["estimate"] for w in want], abs=1e-3)
        assert [[t["masked"] for t in g["terms"]] for g in got] == [[t["masked"] for t in w["terms"]] for w in want]
    bad = http.post("/score", json={"items": [{"prompt": PROMPT[:5], "response": PROMPT[5:40]}], "estimator": "exact"})
    assert assert_error_shape(bad, 400)["param"] == "estimator"


def test_score_for_trainers_token_terms_client_masks_and_the_weight_version(http) -> None:
    """docs/rl.md: return_token_logprobs lists every term's tokens; the same masks sent by the client give the
    same values; require_weight_version is a 409 when the server holds another version."""
    item = {"prompt": PROMPT[:30], "response": PROMPT[30:]}
    r = http.post("/score", json={"items": [item], "estimator": "elbo", "num_timesteps": 3, "seed": 5,
                                  "return_token_logprobs": True, "require_weight_version": "default"})
    assert r.status_code == 200 and r.json()["weight_version"] == "default", r.text
    terms = r.json()["results"][0]["terms"]
    for t in terms:
        assert len(t["positions"]) == t["masked"] == len(t["token_logprobs"])
        assert sum(t["token_logprobs"]) == pytest.approx(t["logprob_sum"], abs=1e-9)
    masks = [[p for t in terms if t["timestep"] == n for p in t["positions"]] for n in range(3)]
    masks = [m for m in masks if m]
    r = http.post("/score", json={"items": [item], "masks": [masks], "return_token_logprobs": True})
    assert r.status_code == 200 and r.json()["estimator"] == "masks", r.text
    got = [(tuple(t["positions"]), t["token_logprobs"]) for t in r.json()["results"][0]["terms"]]
    want = [(tuple(t["positions"]), t["token_logprobs"]) for t in terms if t["positions"]]
    assert sorted(got) == sorted(want)
    bad = http.post("/score", json={"items": [item], "masks": [[[0, 99]]]})
    assert assert_error_shape(bad, 400)["param"] == "masks"
    stale = http.post("/score", json={"items": [item], "require_weight_version": "step-7"})
    err = assert_error_shape(stale, 409)
    assert err["code"] == "weight_version_mismatch" and err["param"] == "require_weight_version"


def test_tokenizer_routes_in_vllms_shapes(http, engine) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == engine.tokenizer.eos_token and "chat_template" in info
    tok = http.post("/tokenize", json={"prompt": "the small cat", "add_special_tokens": False}).json()
    assert tok["tokens"] == engine.tokenizer.encode("the small cat") and tok["count"] == len(tok["tokens"])
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "the small cat"
    assert_error_shape(http.post("/tokenize", json={}), 400)
