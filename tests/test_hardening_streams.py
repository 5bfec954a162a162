"""Hardening III, item 3 (issue 37): slow SSE readers against a live `redraft serve` (demo model). Readers that
take a few bytes a second fall behind; past --max-stream-backlog their stream ends with an error event naming
the flag, their engine request is ended, and the HTTP process's memory returns; a reader that takes nothing at
all is cut off. A bystander's answers and pace are unchanged throughout."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from bystanders import Bystanders
from live_server import RedraftServer

BACKLOG = 16
BYSTANDER_BOUND_S = 20.0  # one 16-token answer on a shared 2-core machine (under 2 s alone)


@pytest.fixture(scope="module")
def srv(request, tmp_path_factory) -> RedraftServer:
    server = RedraftServer(None, tmp_path_factory.mktemp("hard-streams"),
                           ["--cpu-threads", "1", "--max-stream-backlog", str(BACKLOG)])
    request.addfinalizer(server.stop)
    return server.start()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _slow_stream(port: int, rid: str) -> socket.socket:
    """A streamed /generate with an event per forward and cumulative logprobs (about 3 MB in all), from a socket
    with a tiny receive buffer."""
    body = json.dumps({"text": "Count to a thousand:", "rid": rid, "stream": True, "stream_denoise": True,
                       "return_logprob": True, "top_logprobs_num": 5,
                       "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def _read_slowly(s: socket.socket, rate_bps: int, until: threading.Event, out: list) -> None:
    """Read at about `rate_bps` until `until` is set (at most 120 s), then everything left; `out` gets the
    bytes."""
    got, t0 = b"", time.monotonic()
    s.settimeout(60)
    while not until.is_set() and time.monotonic() - t0 < 120:
        chunk = s.recv(max(1, rate_bps // 10))
        if not chunk:
            break
        got += chunk
        time.sleep(0.1)
    while True:
        try:
            chunk = s.recv(1 << 20)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    out.append(got)


def _running(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10, trust_env=False).json()["num_running_reqs"]


@pytest.mark.slow
def test_slow_readers_are_ended_with_an_error_and_their_memory_returns(srv) -> None:
    pid = srv.proc.pid
    with Bystanders(srv.url, n=1) as bystanders:
        rss_before = _rss_mb(pid)
        socks = [_slow_stream(srv.port, f"slow-{i}") for i in range(10)]
        outs: list[bytes] = []
        all_ended = threading.Event()
        readers = [threading.Thread(target=_read_slowly, args=(s, 512, all_ended, outs)) for s in socks]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 120  # they fall behind as fast as the engine (shared CPU) decodes
        while srv.log_tail(10**6).count("(--max-stream-backlog): ended") < 10 and time.monotonic() < deadline:
            time.sleep(0.5)
        rss_after = _rss_mb(pid)
        all_ended.set()
        for t in readers:
            t.join(120)
        deadline = time.monotonic() + 20
        while _running(srv.url) > 1 and time.monotonic() < deadline:  # the bystander's own request may run
            time.sleep(0.2)
        assert _running(srv.url) <= 1, "the slow readers' engine requests were not ended"
    bystanders.check(max_latency_s=BYSTANDER_BOUND_S, min_answers=2)
    for s in socks:
        s.close()
    assert len(outs) == 10
    for raw in outs:
        text = raw.decode("utf-8", "replace")
        assert text.startswith("HTTP/1.1 200"), text[:200]
        errors = [json.loads(line[6:]) for line in text.split("\n") if line.startswith('data: {"error"')]
        assert errors and errors[-1]["error"]["code"] == "stream_backlog_exceeded", text[-600:]
        assert "--max-stream-backlog" in errors[-1]["error"]["message"]
        assert "data: [DONE]" in text[-200:], text[-300:]
    # ten readers at 2 KB/s grew the process by 159 MB before; a bounded backlog keeps it within a few MB each
    assert rss_after - rss_before < 40, (rss_before, rss_after)
    assert srv.log_tail(10**6).count("(--max-stream-backlog): ended") >= 10


@pytest.mark.slow
def test_a_reader_that_takes_nothing_is_cut_off(srv) -> None:
    s = _slow_stream(srv.port, "stalled-1")
    try:
        time.sleep(1.0)
        deadline = time.monotonic() + 60
        while "request stalled-1: its reader took nothing" not in srv.log_tail(10**6):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.5)
        s.settimeout(30)
        got = b""
        while True:  # what was in flight, then the close
            try:
                chunk = s.recv(1 << 20)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
    finally:
        s.close()
    assert _running(srv.url) == 0
    assert httpx.get(srv.url + "/health", timeout=10, trust_env=False).status_code == 200
