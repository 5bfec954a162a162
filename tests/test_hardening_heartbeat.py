"""Hardening III, item 5 (issue 37): a hung engine is detected. With the engine process stopped (SIGSTOP: alive,
silent) past --engine-heartbeat-timeout, /live turns 503, the requests in flight end with a 503 (an SSE error
event for a stream) naming the reason, the engine is killed and restarted as after a crash, and a bystander's
answer after the restart is the one it got before."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from bystanders import ask
from live_server import RedraftServer, assert_error_shape, still_running, proc_stat

TIMEOUT_S = 3.0
RESTART_S = 180.0  # a new engine process starts in 5-35 s on a shared 2-core machine


@pytest.fixture
def srv(request, tmp_path) -> RedraftServer:
    server = RedraftServer(None, tmp_path, ["--cpu-threads", "1", "--engine-heartbeat-timeout", str(TIMEOUT_S)])
    request.addfinalizer(server.stop)
    return server.start()


def _stream_events(url: str, out: list) -> None:
    body = {"model": "demo_model", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 900, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out.append((events, time.monotonic() - t0))


@pytest.mark.slow
def test_a_stopped_engine_is_detected_failed_fast_and_restarted(srv) -> None:
    with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        reference = ask(c, 3)[0]
        assert c.get("/live").status_code == 200
        time.sleep(2 * TIMEOUT_S)  # idle: the heartbeats keep a quiet engine alive
        assert c.get("/live").status_code == 200 and c.get("/health").status_code == 200
        engine = srv.engine_pid()
        started = proc_stat(engine)[1]
        streamed: list = []
        stream = threading.Thread(target=_stream_events, args=(srv.url, streamed))
        stream.start()
        time.sleep(1.0)  # the stream is running
        os.kill(engine, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            r = c.post("/v1/chat/completions", json={"model": "demo_model", "max_tokens": 8,
                                                     "messages": [{"role": "user", "content": "hi"}]})
            err = assert_error_shape(r, 503)  # it waited for the deadline, not forever
            assert err["code"] == "engine_unavailable" and "--engine-heartbeat-timeout" in err["message"], err
            assert time.monotonic() - stopped_at < TIMEOUT_S + 5
            stream.join(30)
            assert not stream.is_alive(), "the stream in flight hangs"
            events, _ = streamed[0]
            assert events[-1].get("error", {}).get("code") == "engine_unavailable", events[-2:]
            lives = []
            deadline = time.monotonic() + RESTART_S
            while time.monotonic() < deadline:  # /live is 503 until the new engine is ready, then 200
                lives.append(c.get("/live").status_code)
                if lives[-1] == 200 and 503 in lives:
                    break
                time.sleep(0.1)
            assert 503 in lives and lives[-1] == 200, lives
        finally:
            if still_running(engine, started):
                os.kill(engine, signal.SIGCONT)
        assert not still_running(engine, started), "the stopped engine was not killed"
        deadline = time.monotonic() + RESTART_S
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.2)
        assert srv.engine_pid() != engine
        assert ask(c, 3)[0] == reference  # the bystander's answer after the restart
    log = srv.log_tail(10**6)
    assert "(--engine-heartbeat-timeout 3): killing it" in log and "the engine is back (restart 1)" in log, log
