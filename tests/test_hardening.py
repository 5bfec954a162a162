"""Hardening of `redraft serve`, each defect a real server showed, with real processes and sockets, bounded in
time: admin routes behind their own key, and an admin-aborted OpenAI request that ends with a valid finish
reason and an error."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer, assert_error_shape

KEY, ADMIN = "sk-user-123", "sk-admin-456"
ENDLESS = {"max_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed(request, ckpt: Path, tmp_path_factory) -> RedraftServer:
    srv = RedraftServer(ckpt, tmp_path_factory.mktemp("hard-log"), ["--api-key", KEY, "--admin-api-key", ADMIN])
    request.addfinalizer(srv.stop)
    return srv.start()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_admin_routes_need_the_admin_key(keyed) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30, trust_env=False) as http:
        for path, body in (("/flush_cache", None), ("/abort_request", {"rid": "x"})):
            assert_error_shape(http.post(path, json=body, headers=_auth(KEY)), 403)  # a user key is not enough
            assert_error_shape(http.post(path, json=body), 401)
            assert http.post(path, json=body, headers=_auth(ADMIN)).status_code == 200
        # and the admin key is no user key
        assert_error_shape(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                     headers=_auth(ADMIN)), 401)


def test_admin_routes_are_off_without_an_admin_key(ckpt, tmp_path) -> None:
    srv = RedraftServer(ckpt, tmp_path, ["--api-key", KEY]).start()
    try:
        r = httpx.post(srv.url + "/abort_request", json={"rid": "someone-else"}, headers=_auth(KEY), timeout=30,
                       trust_env=False)
        assert assert_error_shape(r, 403)["code"] == "admin_disabled"
    finally:
        srv.stop()


def _abort_soon(url: str, rid: str, delay: float = 1.0) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        for _ in range(50):
            httpx.post(url + "/abort_request", json={"rid": rid}, headers=_auth(ADMIN), timeout=10, trust_env=False)
            time.sleep(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.slow
def test_an_admin_abort_ends_with_a_valid_finish_and_an_error(keyed) -> None:
    with httpx.Client(base_url=keyed.url, timeout=60, trust_env=False, headers=_auth(KEY)) as http:
        # non-streamed: an error in OpenAI's shape, not a 200 with finish_reason "abort"
        t = _abort_soon(keyed.url, "cut-plain-0")
        r = http.post("/v1/completions", json={"prompt": "hi", **ENDLESS}, headers={"X-Request-Id": "cut-plain"})
        t.join(15)
        assert assert_error_shape(r, 503)["code"] == "request_aborted"
        # streamed: a chunk with finish_reason "stop", then an error event, then [DONE]
        t = _abort_soon(keyed.url, "cut-stream-0")
        events, reasons = [], []
        with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "cut-stream"},
                         json={"messages": [{"role": "user", "content": "hi"}], "stream": True, **ENDLESS}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    events.append(ev)
                    reasons += [c["finish_reason"] for c in ev.get("choices", []) if c.get("finish_reason")]
                elif line == "data: [DONE]":
                    events.append("[DONE]")
        t.join(15)
        assert reasons == ["stop"] and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "request_aborted"


# ---- a dead engine heals ---------------------------------------------------------------------------------------
def test_a_killed_engine_is_restarted_in_place(ckpt, tmp_path) -> None:
    import os
    import signal

    srv = RedraftServer(ckpt, tmp_path, []).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as http:
            body = {"input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 4}}
            assert http.post("/generate", json=body).status_code == 200
            first = srv.engine_pid()
            os.kill(first, signal.SIGKILL)
            time.sleep(0.5)
            down = http.post("/generate", json=body)
            assert assert_error_shape(down, 503)["code"] == "engine_unavailable"
            assert down.headers.get("retry-after") == "2"
            assert http.get("/live").status_code == 200, "the process heals itself: liveness stays up"
            metrics = http.get("/metrics").text
            assert "sglang:num_running_reqs{" in metrics and 'redraft:engine_up{model_name="tiny"} 0.0' in metrics
            deadline = time.monotonic() + 90
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the engine did not come back"
                time.sleep(0.3)
            assert srv.engine_pid() != first
            again = http.post("/generate", json=body)
            assert again.status_code == 200 and again.json()["output_ids"]
            assert 'redraft:engine_up{model_name="tiny"} 1.0' in http.get("/metrics").text
    finally:
        srv.stop()


@pytest.mark.slow
def test_an_engine_that_cannot_restart_makes_the_server_exit_non_zero(ckpt, tmp_path) -> None:
    import os
    import shutil
    import signal

    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    srv = RedraftServer(model, tmp_path, ["--engine-restarts", "2"]).start()
    try:
        (model / "config.json").unlink()  # every restart now fails to load the checkpoint
        os.kill(srv.engine_pid(), signal.SIGKILL)
        code = srv.proc.wait(60)  # pauses of 1 s and 2 s, two failed starts, then exit
        assert code == 1, srv.log_tail()
        assert "could not be restarted" in srv.log_tail()
    finally:
        srv.stop(check=False)


# ---- graceful drain --------------------------------------------------------------------------------------------
def test_sigterm_drains_then_ends_the_rest_in_openai_shape(ckpt, tmp_path) -> None:
    import signal
    from concurrent.futures import ThreadPoolExecutor

    srv = RedraftServer(ckpt, tmp_path, ["--shutdown-timeout", "3"]).start()
    url = srv.url

    def plain(max_tokens: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True},
                          timeout=60, trust_env=False)

    def streamed() -> list:
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, trust_env=False,
                          json={"prompt": "hi", "stream": True, **ENDLESS}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
        return events

    try:
        with ThreadPoolExecutor(4) as pool:
            long_plain = pool.submit(plain, 2000)
            long_stream = pool.submit(streamed)
            time.sleep(1.0)  # both running
            short = pool.submit(plain, 40)
            time.sleep(0.2)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:
                late = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10,
                                  trust_env=False)
                assert assert_error_shape(late, 503)["code"] == "shutting_down"  # admitted no more
            except httpx.TransportError:
                pass  # or the listener is already closed: refused, never a 5xx text page
            assert short.result(30).status_code == 200, "a request that fits the drain time finishes"
            cut = long_plain.result(30)
            assert assert_error_shape(cut, 503)["code"] == "shutting_down"
            events = long_stream.result(30)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
        code = srv.proc.wait(30)
        assert time.monotonic() - t0 < 15
        assert code in (0, -signal.SIGTERM), srv.log_tail()
        assert "leaked semaphore" not in srv.log_tail()
    finally:
        srv.stop()


# ---- the event loop stays free ---------------------------------------------------------------------------------
def _live_latency(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10, trust_env=False) as c:
        while not stop.is_set():
            t = time.monotonic()
            c.get(url + "/live")
            out.append(time.monotonic() - t)
            time.sleep(0.05)


SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.slow
def test_huge_prompts_and_slow_templates_never_block_the_loop(ckpt, tmp_path) -> None:
    import shutil
    import signal
    from concurrent.futures import ThreadPoolExecutor

    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": SLOW_TEMPLATE}))
    srv = RedraftServer(model, tmp_path, ["--max-body-bytes", str(16 * 2**20)]).start()
    stop, lat = threading.Event(), []
    watcher = threading.Thread(target=_live_latency, args=(srv.url, stop, lat), daemon=True)
    try:
        watcher.start()
        with ThreadPoolExecutor(4) as pool:
            huge = [pool.submit(httpx.post, srv.url + "/v1/completions", timeout=60, trust_env=False,
                                json={"prompt": "word " * 1_400_000, "max_tokens": 1}) for _ in range(2)]
            slow = pool.submit(httpx.post, srv.url + "/v1/chat/completions", timeout=60, trust_env=False,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            for f in huge:  # 7 million characters: refused before tokenizing
                assert assert_error_shape(f.result(30), 400)["code"] == "context_length_exceeded"
            t0 = time.monotonic()
            assert "took longer" in assert_error_shape(slow.result(30), 400)["message"]
            assert time.monotonic() - t0 < 10
        stop.set()
        watcher.join(10)
        assert lat and max(lat) < 0.5, f"/live took up to {max(lat):.2f}s"
        # and a slow template in flight does not keep SIGTERM from stopping the server
        pool = ThreadPoolExecutor(1)
        pool.submit(httpx.post, srv.url + "/v1/chat/completions", timeout=60, trust_env=False,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) in (0, -signal.SIGTERM)
        pool.shutdown(wait=False)
    finally:
        stop.set()
        srv.stop(check=False)


# ---- start failures: one clear line, nothing left behind ----------------------------------------------------
@pytest.mark.slow
def test_start_failures_print_one_line_and_leave_nothing(ckpt, tmp_path) -> None:
    import os
    import shutil
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(ckpt, model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}
    for cmd in (["serve", "--port", "0"], ["generate", "hi"]):
        res = subprocess.run([sys.executable, "-m", "redraft", *cmd, "--model", str(model)], capture_output=True,
                             text=True, timeout=120, env=env)
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr, res.stderr
        assert [ln for ln in res.stderr.splitlines() if ln.startswith("redraft: error:")] == \
            [ln for ln in res.stderr.splitlines() if "error" in ln.lower()], res.stderr
        assert "pickle" in res.stderr and "safetensors" in res.stderr
        assert not list(scratch.glob("redraft-*")), "the socket folder was left behind"
    (model / "model.safetensors").write_bytes(b"not a safetensors file at all")
    res = subprocess.run([sys.executable, "-m", "redraft", "generate", "hi", "--model", str(model)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "not a valid safetensors file" in res.stderr


# ---- Hugging Face repo ids -------------------------------------------------------------------------------------
def _hub_cache(root: Path, repo: str, refs: dict[str, Path]) -> Path:
    """A cache laid out the way huggingface_hub lays it out: models--org--name/{refs,snapshots,blobs}."""
    import hashlib
    import shutil

    base = root / ("models--" + repo.replace("/", "--"))
    for ref, source in refs.items():
        commit = hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in source.iterdir():
            blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return root


def test_hub_repo_ids_resolve_from_the_cache_offline(ckpt, tiny_checkpoint, tmp_path, monkeypatch) -> None:
    import redraft
    from redraft.engine.text.model_path import resolve_model_path

    other = tiny_checkpoint(seed=5)
    cache = _hub_cache(tmp_path / "hub", "inclusionAI/LLaDA2.1-tiny", {"main": ckpt, "v2": other})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main = resolve_model_path("inclusionAI/LLaDA2.1-tiny")
    assert (main / "config.json").read_text() == (ckpt / "config.json").read_text()
    v2 = resolve_model_path("inclusionAI/LLaDA2.1-tiny", revision="v2")
    assert (v2 / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes() and v2 != main
    with pytest.raises(FileNotFoundError, match="cache"):
        resolve_model_path("inclusionAI/not-there")
    engine = redraft.Engine(model_path="inclusionAI/LLaDA2.1-tiny", progress=False)
    try:
        assert engine.generate(input_ids=[20, 21], sampling_params={"max_new_tokens": 4})["output_ids"]
    finally:
        engine.shutdown()
    # a local directory of the same name wins
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "inclusionAI" / "LLaDA2.1-tiny"
    local.parent.mkdir()
    local.symlink_to(other)
    assert resolve_model_path("inclusionAI/LLaDA2.1-tiny") == Path("inclusionAI/LLaDA2.1-tiny")


def test_serve_takes_a_hub_repo_id(ckpt, tmp_path) -> None:
    cache = _hub_cache(tmp_path / "hub", "inclusionAI/LLaDA2.1-tiny", {"main": ckpt})
    srv = RedraftServer(None, tmp_path, ["--model", "inclusionAI/LLaDA2.1-tiny"],
                        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}).start()
    try:
        models = httpx.get(srv.url + "/v1/models", timeout=30, trust_env=False).json()
        assert models["data"][0]["id"] == "inclusionAI/LLaDA2.1-tiny"
    finally:
        srv.stop()
