"""The command lines SGLang's and vLLM's users already type: their flag names as aliases of redraft's, a
positional model, accepted no-ops said at start-up, refusals that name the flag, API keys from the environment,
and mistakes (port, log level, template) caught before any weight is read."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer
from redraft.cli import build_parser, engine_args

TEMPLATE = ("{% for m in messages %}CUSTOM[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}CUSTOM[assistant]:{% endif %}")


def _args(*argv: str):
    return engine_args(build_parser().parse_args(["serve", *argv]))


def test_their_names_set_our_fields(monkeypatch) -> None:
    monkeypatch.delenv("REDRAFT_API_KEY", raising=False)
    a = _args("/models/x", "--tensor-parallel-size", "2", "--max-model-len", "512", "--gpu-memory-utilization",
              "0.7", "--max-num-seqs", "12", "--max-num-batched-tokens", "2048", "--random-seed", "5",
              "--trust-remote-code", "--enable-metrics", "--tool-call-parser", "qwen25", "--log-level", "WARNING")
    assert (a.model_path, a.tp_size, a.context_length, a.mem_fraction_static) == ("/models/x", 2, 512, 0.7)
    assert (a.max_running_requests, a.chunked_prefill_size, a.random_seed, a.log_level) == (12, 2048, 5, "warning")
    assert _args("--context-length", "64").context_length == 64
    assert _args("--disable-overlap-schedule").disable_overlap and not _args().disable_overlap  # SGLang's spelling


def test_api_keys_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("REDRAFT_API_KEY", "k1, k2")
    monkeypatch.setenv("REDRAFT_ADMIN_API_KEY", "adm")
    a = _args()
    assert a.api_key == ("k1", "k2") and a.admin_api_key == ("adm",)
    assert _args("--api-key", "flag").api_key == ("flag",), "a flag wins over the environment"


def test_two_models_are_an_error() -> None:
    with pytest.raises(ValueError, match="two models"):
        _args("/a", "--model", "/b")


@pytest.mark.parametrize("argv,says", [
    (["--port", "99999"], "--port: 99999 is outside 0..65535"),
    (["--port", "http"], "is not a port number"),
    (["--log-level", "debugg"], "--log-level: invalid choice: 'debugg'"),
    (["--dp-size", "2"], "--dp-size is not supported: data parallelism is replicas behind smg"),
    (["--enable-lora"], "--enable-lora is not supported"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: no such file"),
    (["--chat-template", "{% for m in messages %}"], "--chat-template does not compile"),
])
def test_mistakes_fail_in_a_second_with_one_line(ckpt: Path, argv: list[str], says: str) -> None:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "redraft", "serve", str(ckpt), *argv], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert says in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert time.monotonic() - t0 < 20


def test_serve_as_sglang_and_vllm_users_write_it(ckpt: Path, tmp_path: Path) -> None:
    template = tmp_path / "custom.jinja"
    template.write_text(TEMPLATE)
    srv = RedraftServer(None, tmp_path, [str(ckpt), "--context-length", "512", "--chat-template", str(template),
                                         "--tensor-parallel-size", "1", "--trust-remote-code", "--log-level", "info"])
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as http:
            info = http.get("/get_server_info").json()
            assert info["max_model_len"] == 512 and info["default_mode"] == "Q", info
            too_long = http.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 20})
            assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
            no_room = http.post("/v1/completions", json={"prompt": [5] * 600}).json()["error"]
            assert no_room["param"] == "prompt" and "the prompt alone has 600" in no_room["message"], no_room
            ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
            text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
            assert text == "CUSTOM[user]: hi\nCUSTOM[assistant]:", text
            ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 4})
            assert ok.status_code == 200, ok.text
        assert "--trust-remote-code: accepted, no effect" in srv.log_tail(200_000)
    finally:
        srv.stop()


def test_context_longer_than_the_checkpoint_is_refused(ckpt: Path) -> None:
    import redraft

    with pytest.raises(ValueError, match="longer than this checkpoint's max_position_embeddings"):
        redraft.Engine(str(ckpt), context_length=10**7, progress=False)


def test_a_busy_port_or_a_bad_host_fails_before_anything_loads(ckpt: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, says in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: Address already in use"),
                           (["--host", "0.0.0.0.0"], "--host '0.0.0.0.0' is not an address")):
            t0 = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "redraft", "serve", str(ckpt), "--log-level", "info", *argv],
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 2 and says in res.stderr, res.stderr
            assert "starting the engine" not in res.stderr and "Traceback" not in res.stderr, res.stderr
            assert time.monotonic() - t0 < 15, "the failure waited for something"
