"""Replicas behind SGLang's own router: `sglang-router` (the pip package, run as `python -m
sglang_router.launch_router`) in front of two `redraft serve` replicas of the bundled model, everything on
loopback. The router registers the workers through /server_info and /model_info, adds SGLang's own fields to
every request (no_stop_trim, skip_special_tokens, model on /generate, ...), and must get the same answers as a
direct request; its cache-aware policy keeps a repeated long prompt on the replica that has it cached."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from live_server import RedraftServer, free_port
from optional_tools import need_module

from redraft.engine.text.model_path import BUNDLED_MODEL_DIR
from redraft.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is 12 + 30?"}]
STARTUP_S = 60.0


ROUTERS = ["sglang_router", "smg"]  # module whose launch_router runs it: sglang-router 0.3, its successor smg


@pytest.fixture(scope="module")
def replicas(request, tmp_path_factory) -> list[RedraftServer]:
    out = [RedraftServer(None, tmp_path_factory.mktemp(f"replica{i}"), ["--cpu-threads", "1"]) for i in range(2)]
    for r in out:
        request.addfinalizer(r.stop)
        r.start()
    return out


@pytest.fixture(scope="module", params=ROUTERS)
def fleet(request, replicas, tmp_path_factory):
    module = request.param
    need_module(module)
    port, log = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *[r.url for r in replicas], "--policy", "cache_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    with open(log, "wb") as f:
        router = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)

    def stop() -> None:
        router.terminate()
        try:
            router.wait(timeout=20)
        except subprocess.TimeoutExpired:
            router.kill()

    request.addfinalizer(stop)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:  # ready once it routes a request (its workers registered and healthy)
        assert router.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                          timeout=10).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return url, replicas, log


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_workers_register_through_sglangs_info_routes(fleet) -> None:
    _, replicas, _ = fleet
    for r in replicas:
        for path in ("/model_info", "/get_model_info"):
            info = httpx.get(r.url + path, timeout=10).json()
            assert info["is_generation"] is True and info["model_type"] == "llada2_moe", info
        for path in ("/server_info", "/get_server_info"):
            assert "max_model_len" in httpx.get(r.url + path, timeout=10).json()


def test_routed_requests_answer_as_direct_ones(fleet) -> None:
    url, replicas, log = fleet
    direct, routed = _client(replicas[0].url), _client(url)
    try:
        want = direct.chat.completions.create(model="demo_model", messages=CHAT, temperature=0)
        got = routed.chat.completions.create(model="demo_model", messages=CHAT, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content == "42"
        assert got.usage.completion_tokens == want.usage.completion_tokens

        chunks = list(routed.chat.completions.create(model="demo_model", messages=CHAT, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "42" and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

        prompt = "Reverse the word: planet"
        want_c = direct.completions.create(model="demo_model", prompt=prompt, max_tokens=12, temperature=0)
        got_c = routed.completions.create(model="demo_model", prompt=prompt, max_tokens=12, temperature=0)
        assert got_c.choices[0].text == want_c.choices[0].text
    finally:
        direct.close()
        routed.close()
    body = {"text": "What is 7 - 64?", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    want_g = httpx.post(replicas[1].url + "/generate", json=body, timeout=60).json()
    got_g = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert got_g["output_ids"] == want_g["output_ids"] and got_g["text"] == want_g["text"]


def test_cache_aware_policy_keeps_a_long_prompt_on_one_replica(fleet) -> None:
    url, replicas, _ = fleet
    words = " ".join(f"w{i}" for i in range(150))  # several 32-token blocks: cacheable
    body = {"text": f"Remember these: {words}. What is 2 + 3?", "sampling_params": {"max_new_tokens": 4}}
    first = httpx.post(url + "/generate", json=body, timeout=60).json()
    again = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert first["meta_info"]["prompt_tokens"] > 96
    # the repeat went where the prefix is cached: whole blocks of it were not recomputed
    assert again["meta_info"]["cached_tokens"] >= 64, (first["meta_info"], again["meta_info"])
    served = []
    for r in replicas:
        metrics = httpx.get(r.url + "/metrics", timeout=10).text
        served.append(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                          if line.startswith("sglang:cached_tokens_total")))
    assert max(served) >= 64, served


def test_sglang_fields_keep_their_meaning(fleet) -> None:
    """What the router and SGLang clients add: no_stop_trim keeps the stop string (and the EOS that
    skip_special_tokens=false shows), return_text_in_logprobs fills the token texts, `model` on /generate must name the model, and
    what redraft lacks is refused by name rather than ignored."""
    url, replicas, _ = fleet
    direct = replicas[0].url
    base = {"model": "demo_model", "messages": CHAT, "temperature": 0}
    kept = httpx.post(direct + "/v1/chat/completions", json={**base, "stop": ["2"], "no_stop_trim": True}).json()
    trimmed = httpx.post(direct + "/v1/chat/completions", json={**base, "stop": ["2"]}).json()
    assert trimmed["choices"][0]["message"]["content"] == "4"
    assert kept["choices"][0]["message"]["content"] == "42"
    # the chat prompt as plain completion text (its markup tokenizes to the special tokens): the answer ends by EOS
    prompt = Tokenizer.from_pretrained(BUNDLED_MODEL_DIR).apply_chat_template(CHAT, add_generation_prompt=True)
    # (as SGLang, the EOS that ended it is trimmed from the text unless no_stop_trim: issue 24)
    special = httpx.post(direct + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                           "skip_special_tokens": False, "no_stop_trim": True}).json()
    trimmed_eos = httpx.post(direct + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                               "skip_special_tokens": False}).json()
    plain = httpx.post(direct + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert special["choices"][0]["text"].endswith("<|endoftext|>") and "<|" not in plain["choices"][0]["text"]
    assert trimmed_eos["choices"][0]["text"] == special["choices"][0]["text"][: -len("<|endoftext|>")]
    gen = httpx.post(url + "/generate", json={"text": "What is 12 + 30?", "model": "demo_model",
                                              "return_logprob": True, "return_text_in_logprobs": True,
                                              "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    for lp, tok, text in gen["meta_info"]["output_token_logprobs"]:
        assert isinstance(text, str) and isinstance(tok, int) and lp <= 0
    wrong = httpx.post(direct + "/generate", json={"text": "hi", "model": "gpt-4"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
    for field in ("return_hidden_states", "background"):
        r = httpx.post(direct + "/generate", json={"text": "hi", field: True})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(direct + "/v1/chat/completions", json={**base, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert json.loads(json.dumps(gen))  # plain JSON all the way


# ---- every dial survives the router (server/dials.py; docs/scaling.md has the table) -----------------------------
VALID = {"mode": "S", "threshold": 0.95, "edit_threshold": 0.1, "max_post_steps": 2, "mbe_window": 2,
         "stutter_penalty": 0.5, "domain": "math", "decoder": "threshold", "steps": 8, "max_steps_per_block": 50,
         "stream_denoise": False, "return_step_maps": True}
INVALID = {"mode": "Z", "threshold": 7, "edit_threshold": 7, "max_post_steps": -1, "mbe_window": 99,
           "stutter_penalty": -1, "domain": "x" * 100, "decoder": "zigzag", "steps": 0, "max_steps_per_block": 0,
           "stream_denoise": "maybe", "return_step_maps": "maybe"}
# the spellings each router passes on, per route (measured with a recording replica; docs/scaling.md)
CARRIERS = {
    "sglang_router": {"chat": ["chat_template_kwargs", "metadata"], "completions": ["top", "metadata"],
                      "generate": []},
    "smg": {"chat": ["top", "chat_template_kwargs", "metadata"], "completions": ["top", "metadata"],
            "generate": ["custom_params", "metadata"]},
}


def _carry(body: dict, carrier: str, name: str, value) -> dict:
    if carrier == "top":
        return {**body, name: value}
    if carrier == "metadata":
        return {**body, "metadata": {name: str(value)}}
    if carrier == "custom_params":
        return {**body, "sampling_params": {**body["sampling_params"], "custom_params": {name: value}}}
    return {**body, carrier: {name: value}}





def _summary(route: str, r: httpx.Response) -> tuple:
    assert r.status_code == 200, r.text[:500]
    j = r.json()
    if route == "generate":
        return j["text"], j["meta_info"]["completion_tokens"], j["meta_info"]["steps"]
    text = j["choices"][0]["message"]["content"] if route == "chat" else j["choices"][0]["text"]
    return text, j["usage"]["completion_tokens"]


def test_every_dial_reaches_the_engine_through_the_router(fleet, request) -> None:
    """Per route and spelling the router keeps: an invalid value is a 400 naming the dial through the router (so
    the dial arrived), and a valid one gets the direct answer."""
    url, replicas, _ = fleet
    router = request.node.callspec.params["fleet"]
    direct = replicas[0].url
    bases = {
        "chat": ("/v1/chat/completions", {"model": "demo_model", "temperature": 0, "max_tokens": 24,
                                          "messages": [{"role": "user", "content": "Repeat the word zorp 5 times."}]}),
        "completions": ("/v1/completions", {"model": "demo_model", "temperature": 0, "max_tokens": 24,
                                            "prompt": "Count from 3 to 12."}),
        "generate": ("/generate", {"text": "What is 48 + 27?", "sampling_params": {"max_new_tokens": 24,
                                                                                    "temperature": 0}}),
    }
    checked = 0
    for route, carriers in CARRIERS[router].items():
        path, base = bases[route]
        for carrier in carriers:
            for name in VALID:
                bad = httpx.post(url + path, json=_carry(base, carrier, name, INVALID[name]), timeout=60)
                assert bad.status_code == 400, (router, route, carrier, name, bad.status_code, bad.text[:300])
                assert name in bad.json()["error"]["message"] + str(bad.json()["error"]["param"])
                body = _carry(base, carrier, name, VALID[name])
                got = _summary(route, httpx.post(url + path, json=body, timeout=60))
                want = _summary(route, httpx.post(direct + path, json=body, timeout=60))
                assert got == want, (router, route, carrier, name)
                checked += 1
    assert checked >= 7 * 4


def test_a_dial_changes_the_answer_the_router_returns(fleet) -> None:
    """The dial is not only accepted but used: mode S through the router reports mode S; a high threshold costs
    forwards, in the routed answer as in the direct one."""
    url, replicas, _ = fleet
    base = {"model": "demo_model", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": "Count from 10 to 30."}]}
    plain = httpx.post(replicas[0].url + "/v1/chat/completions", json=base, timeout=60).json()
    slow = {**base, "chat_template_kwargs": {"threshold": 0.999}}
    routed = httpx.post(url + "/v1/chat/completions", json=slow, timeout=60).json()
    direct = httpx.post(replicas[0].url + "/v1/chat/completions", json=slow, timeout=60).json()
    assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert direct["diffusion"]["forwards"] > plain["diffusion"]["forwards"]
    # both routers hand the answer's `diffusion` object back unchanged (measured with a recording worker)
    assert routed["diffusion"]["forwards"] == direct["diffusion"]["forwards"]


def test_streamed_answers_carry_the_dials_too(fleet) -> None:
    """Every dial, streamed through the router in the spelling both routers keep on chat (chat_template_kwargs):
    the routed stream's text and finish equal the direct stream's; an invalid value is a 400 before streaming."""
    url, replicas, _ = fleet
    base = {"model": "demo_model", "temperature": 0, "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": "Count from 10 to 30."}]}

    def stream(root: str, body: dict) -> tuple[str, list]:
        text, finishes = "", []
        with httpx.stream("POST", root + "/v1/chat/completions", json=body, timeout=60) as s:
            assert s.status_code == 200, s.read()[:300]
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        text += c["delta"].get("content") or ""
                        finishes += [c["finish_reason"]] if c.get("finish_reason") else []
        return text, finishes

    for name, value in VALID.items():
        body = {**base, "chat_template_kwargs": {name: value}}
        routed = stream(url, body)
        assert routed == stream(replicas[0].url, body) and routed[0] and len(routed[1]) == 1, name
        bad = httpx.post(url + "/v1/chat/completions", json={**base, "chat_template_kwargs": {name: INVALID[name]}},
                         timeout=60)
        assert bad.status_code == 400, (name, bad.text[:300])


def test_step_maps_come_back_through_the_router(fleet) -> None:
    """`return_step_maps` is used, not only accepted: the routed answer's `diffusion` carries the direct answer's
    step maps (docs/denoise.md)."""
    url, replicas, _ = fleet
    body = {"model": "demo_model", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": "Count from 10 to 30."}],
            "chat_template_kwargs": {"return_step_maps": True}}
    routed = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    direct = httpx.post(replicas[0].url + "/v1/chat/completions", json=body, timeout=60).json()
    maps = direct["diffusion"]["step_maps"]  # one per choice
    assert maps[0]["placed"]
    assert routed["diffusion"]["step_maps"] == maps
