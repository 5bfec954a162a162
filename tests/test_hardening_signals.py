"""Signals and process hygiene of `redraft serve`, against real servers started in their own process group the
way a supervisor starts them (systemd's `KillMode=control-group`, `timeout`, `kill -- -PGID` signal the whole
group): the first SIGTERM/SIGINT drains (running streams finish or end with an error event), nothing restarts
the engine during shutdown, the server exits 0, no process of the group is left and no socket folder either;
a second signal stops at once; a SIGKILLed server leaves no engine, and its socket folder goes at the next start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer, cmdline, descendants, proc_stat, still_running

DRAIN_S = 5.0  # --shutdown-timeout of every server here
MARGIN_S = 4.0  # what a stream may take past the drain time to end (the error event, a busy 2-core machine)
EXIT_MARGIN_S = 10.0  # what the exit may take past the drain time (uvicorn's shutdown, the engine's stop)
LONG, SHORT = 8, 3  # streams still running when the signal arrives / streams that finish during the drain


# ---- processes and folders -------------------------------------------------------------------------------------
def kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of the group (all at once: no race with a member exiting meanwhile)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def group_members(pgid: int) -> dict[int, bytes]:
    """pid -> command line of every live process (zombies aside) in process group `pgid`, from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out[int(d.name)] = cmd
    return out


def wait_group_gone(pgid: int, timeout: float) -> dict[int, bytes]:
    deadline = time.monotonic() + timeout
    left = group_members(pgid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = group_members(pgid)
    return left


def socket_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("redraft-*"))


@pytest.fixture
def scratch():
    """The servers' own $TMPDIR, where their socket folders live: short (a unix socket's path has at most 107
    bytes, and pytest's folders are long), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(ckpt: Path, tmp_path: Path, scratch: Path, name: str, extra: list[str] | None = None) -> RedraftServer:
    """A server in its own process group, with `scratch` as its temporary folder."""
    logs = tmp_path / f"log-{name}"
    logs.mkdir()
    return RedraftServer(ckpt, logs, ["--shutdown-timeout", str(DRAIN_S), *(extra or [])],
                         env={"TMPDIR": str(scratch)},
                         new_session=True).start()


# ---- streams -----------------------------------------------------------------------------------------------------
def chat_stream(url: str, max_tokens: int, out: list, started: threading.Event) -> None:
    """A streamed chat; appends (events, when it ended, when its last text arrived) to `out`, events being the
    parsed `data:` lines ("[DONE]" as is) or, if the connection broke, the exception's repr last."""
    events: list = []
    last_text = 0.0
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": max_tokens,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60, trust_env=False) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if isinstance(events[-1], dict) and (events[-1].get("choices") or [{}])[0].get("delta", {}).get(
                            "content"):
                        last_text = time.monotonic()
                    started.set()
    except httpx.HTTPError as exc:
        events.append(repr(exc))
    out.append((events, time.monotonic(), last_text))


def launch_streams(url: str) -> tuple[list[threading.Thread], list, list]:
    """LONG endless streams and SHORT ones, all with their first chunk received (running in the engine)."""
    long_out: list = []
    short_out: list = []
    threads = []
    for n, out in [(2000, long_out)] * LONG + [(60, short_out)] * SHORT:
        started = threading.Event()
        t = threading.Thread(target=chat_stream, args=(url, n, out, started), daemon=True)
        t.start()
        assert started.wait(30), "a stream got no first chunk"
        threads.append(t)
    return threads, long_out, short_out


def finish_of(events: list) -> str | None:
    reasons = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")
               and e["choices"][0].get("finish_reason")]
    assert len(reasons) <= 1, f"more than one finish: {reasons}"
    return reasons[0] if reasons else None


def assert_ended_cleanly(events: list) -> None:
    """Ended by the protocol: a finish (then [DONE]) or a `shutting_down` error event (then [DONE]); never a
    broken connection, and nothing after the finish but [DONE]."""
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {events[-3:]}"
    last = events[-2]
    if isinstance(last, dict) and "error" in last:
        assert last["error"]["code"] == "shutting_down", last
        assert last["error"]["message"], last
    else:
        assert finish_of(events) is not None, f"no finish and no error: {events[-3:]}"
        assert last["choices"][0]["finish_reason"], "content after the finish"


def assert_log_clean(srv: RedraftServer) -> None:
    log = srv.log_tail(200_000)
    assert "restarting" not in log, log[-4000:]
    assert "died" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]


# ---- the tests ---------------------------------------------------------------------------------------------------
def drain_by_group_signal(srv: RedraftServer, scratch: Path, sig: int, processes: int,
                          short_finish: bool = True) -> None:
    """`processes` of redraft in the group (the HTTP process, the engine, ranks), LONG + SHORT streams running,
    then `sig` to the whole group: the checks of a drain that leaves nothing. `short_finish`: the SHORT streams
    are fast enough to finish within the drain time (not so with ranks on a busy 2-core machine)."""
    pgid = srv.proc.pid
    try:
        assert os.getpgid(pgid) == pgid
        ours = [p for p, cmd in group_members(pgid).items() if b"resource_tracker" not in cmd]
        assert len(ours) == processes, f"expected {processes} processes of redraft in the group: {ours}"
        owned = socket_dirs(scratch)
        assert len(owned) == 1 and re.fullmatch(rf"redraft-{pgid}-\d+-\w+", owned[0].name), owned
        threads, long_out, short_out = launch_streams(srv.url)
        t0 = time.monotonic()
        os.killpg(pgid, sig)
        time.sleep(0.5)
        assert srv.proc.poll() is None, "the server must drain, not stop at once"
        with pytest.raises(httpx.HTTPError):  # no longer admitted: 503 while draining, or the listener is shut
            r = httpx.get(srv.url + "/health", timeout=5, trust_env=False)
            r.raise_for_status()
        for t in threads:
            t.join(DRAIN_S + MARGIN_S + 30)
        code = srv.proc.wait(DRAIN_S + EXIT_MARGIN_S)
        exit_s = time.monotonic() - t0
    finally:
        srv.stop(check=False)
        kill_group(pgid)  # never leave a stray process, even when failing
    assert code == 0, f"exit code {code}; log:\n{srv.log_tail()}"
    assert exit_s < DRAIN_S + EXIT_MARGIN_S
    assert len(long_out) == LONG and len(short_out) == SHORT
    for events, ended, _ in short_out:  # short enough to finish within the drain: they do, normally
        assert_ended_cleanly(events)
        if short_finish:
            assert finish_of(events) == "length", events[-3:]
    cut = 0
    for events, ended, last_text in long_out:
        assert_ended_cleanly(events)
        assert ended - t0 < DRAIN_S + MARGIN_S, f"a stream ended {ended - t0:.1f}s after the signal"
        assert last_text > t0 + 1.0, "a stream stopped progressing at the signal: the engine must run on"
        cut += isinstance(events[-2], dict) and "error" in events[-2]
    assert cut == LONG, "2000-token streams of the tiny model cannot finish in the drain time: ended by it"
    left = wait_group_gone(pgid, 5.0)
    assert not left, f"processes of the group left behind: {left}"
    assert not socket_dirs(scratch), f"socket folder left behind: {socket_dirs(scratch)}"
    assert_log_clean(srv)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_group_drains_the_streams_and_leaves_nothing(ckpt, tmp_path, scratch, sig) -> None:
    drain_by_group_signal(start(ckpt, tmp_path, scratch, sig.name), scratch, sig, processes=2)


@pytest.mark.slow
def test_tensor_parallel_ranks_leave_the_shutdown_to_the_http_process(ckpt, tmp_path, scratch) -> None:
    """With `--tp-size 2` the group holds a rank too: it ignores the signal like the engine, the drain is the
    same; and a SIGKILL of the HTTP process takes the engine and the rank with it."""
    drain_by_group_signal(start(ckpt, tmp_path, scratch, "tp", ["--tp-size", "2"]), scratch, signal.SIGTERM,
                          processes=3, short_finish=False)
    srv = start(ckpt, tmp_path, scratch, "tp-killed", ["--tp-size", "2"])
    try:
        kids = descendants(srv.proc.pid)
        assert len([p for p in kids if b"resource_tracker" not in cmdline(p)]) == 2, kids  # the engine, rank 1
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + 5.0
        while any(still_running(p, s) for p, s in kids.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p, s in kids.items() if still_running(p, s)], "a child outlived the killed server"
    finally:
        srv.stop(check=False)
        for pid in group_members(srv.proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_kills_the_children(ckpt, tmp_path, scratch) -> None:
    srv = start(ckpt, tmp_path, scratch, "twice")
    pgid = srv.proc.pid
    try:
        threads, long_out, short_out = launch_streams(srv.url)
        os.killpg(pgid, signal.SIGTERM)
        time.sleep(1.0)
        assert srv.proc.poll() is None, "the first signal drains"
        t0 = time.monotonic()
        os.killpg(pgid, signal.SIGINT)
        code = srv.proc.wait(DRAIN_S)  # well before the drain time is over
        stop_s = time.monotonic() - t0
        for t in threads:
            t.join(10)
        long_out += short_out
    finally:
        srv.stop(check=False)
        kill_group(pgid)
    assert code == 0, srv.log_tail()
    assert stop_s < 3.0, f"the second signal took {stop_s:.1f}s to stop the server"
    assert len(long_out) == LONG + SHORT
    for events, ended, _ in long_out:  # the short ones finished during the drain, the rest end at the second signal
        assert_ended_cleanly(events)
        assert ended - t0 < 3.0
    left = wait_group_gone(pgid, 5.0)
    assert not left, f"processes of the group left behind: {left}"
    assert not socket_dirs(scratch), f"socket folder left behind: {socket_dirs(scratch)}"
    assert "stopping now" in srv.log_tail()
    assert "restarting" not in srv.log_tail(200_000)


def test_no_restart_once_shutdown_has_begun(ckpt, tmp_path, scratch) -> None:
    """The engine dies with a restart scheduled, then SIGTERM arrives during the restart's pause: the restart
    is cancelled, no new engine is started, and the server still exits 0 with nothing left."""
    srv = start(ckpt, tmp_path, scratch, "restart")
    pgid = srv.proc.pid
    try:
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "restarting the engine in 1s" not in srv.log_tail():  # the watchdog saw it: a restart is due
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.05)
        os.killpg(pgid, signal.SIGTERM)  # within the 1 s pause
        code = srv.proc.wait(DRAIN_S + EXIT_MARGIN_S)
    finally:
        srv.stop(check=False)
        kill_group(pgid)
    log = srv.log_tail(200_000)
    assert code == 0, log
    assert "restart cancelled" in log, log
    assert "the engine is back" not in log and "attempt 2" not in log, log
    left = wait_group_gone(pgid, 5.0)
    assert not left, f"processes of the group left behind: {left}"
    assert not socket_dirs(scratch)


@pytest.mark.slow
def test_an_engine_death_during_the_drain_is_not_restarted(ckpt, tmp_path, scratch) -> None:
    srv = start(ckpt, tmp_path, scratch, "drain-death")
    pgid = srv.proc.pid
    try:
        threads, long_out, _ = launch_streams(srv.url)
        engine = srv.engine_pid()
        os.kill(srv.proc.pid, signal.SIGTERM)  # the HTTP process alone: it drains
        time.sleep(0.5)
        os.kill(engine, signal.SIGKILL)  # and the engine dies meanwhile (an OOM kill, say)
        code = srv.proc.wait(DRAIN_S + EXIT_MARGIN_S)
        for t in threads:
            t.join(10)
    finally:
        srv.stop(check=False)
        kill_group(pgid)
    log = srv.log_tail(200_000)
    assert code == 0, log
    assert "not restarted" in log and "restarting" not in log, log
    for events, _, _ in long_out:  # failed at once by the engine's death: an error event, then [DONE]
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert not wait_group_gone(pgid, 5.0)
    assert not socket_dirs(scratch)


@pytest.mark.slow
def test_sigkill_of_the_server_leaves_no_engine_and_the_next_start_removes_its_folder(
        ckpt, tmp_path, scratch) -> None:
    srv = start(ckpt, tmp_path, scratch, "killed")
    pgid = srv.proc.pid
    # a folder of a live server (this test process, by its pid and start time) must survive the next start
    me = proc_stat(os.getpid())
    alive = scratch / f"redraft-{os.getpid()}-{me[1]}-live"
    alive.mkdir()
    try:
        kids = descendants(srv.proc.pid)
        assert kids, "the engine runs"
        (dead,) = [p for p in socket_dirs(scratch) if p != alive]
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + 5.0  # the kernel's parent-death signal: at once, in practice
        while any(still_running(p, s) for p, s in kids.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: s for p, s in kids.items() if still_running(p, s)}
        assert not left, f"children of the killed server still run: {left}"
        assert dead.is_dir(), "a SIGKILL leaves the folder (nothing can run then)"
    finally:
        srv.stop(check=False)
        kill_group(pgid)
    nxt = RedraftServer(ckpt, tmp_path, ["--shutdown-timeout", str(DRAIN_S)], env={"TMPDIR": str(scratch)},
                        new_session=True).start()
    try:
        assert not dead.exists(), "the next server removes the folder of the dead one"
        assert alive.is_dir(), "a live process's folder is left alone"
        mine = [p for p in socket_dirs(scratch) if p != alive]
        assert len(mine) == 1 and mine[0].name.startswith(f"redraft-{nxt.proc.pid}-"), mine
    finally:
        nxt.stop()
    assert socket_dirs(scratch) == [alive]


def test_stale_socket_folders_are_told_apart_from_live_ones(scratch) -> None:
    """In-process, each case of `remove_stale_ipc_dirs`: only folders of this user's dead servers go."""
    import socket
    import subprocess
    import sys

    from redraft.server.engine_client import remove_stale_ipc_dirs

    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    gone_start = proc_stat(gone.pid)[1]
    gone.wait(10)
    me = f"{os.getpid()}-{proc_stat(os.getpid())[1]}"

    def folder(name: str, *files: str) -> Path:
        path = scratch / name
        path.mkdir(mode=0o700)
        for f in files:
            (path / f).touch()
        return path

    dead = folder(f"redraft-{gone.pid}-{gone_start}-abcd1234", "to-engine", "from-engine")
    dead_empty = folder(f"redraft-{gone.pid}-{gone_start}-empty123")
    live = folder(f"redraft-{me}-live1234", "to-engine", "from-engine")
    reused = folder(f"redraft-{os.getpid()}-1-reused12", "to-engine")  # our pid, another start time: a dead owner
    extra = folder(f"redraft-{gone.pid}-{gone_start}-extra123", "to-engine", "notes.txt")
    other = folder("redraft-abcdefgh", "to-engine")  # not named by this scheme: not ours to judge
    listened = folder(f"redraft-{gone.pid}-{gone_start}-listen12")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(listened / "from-engine"))  # someone (another pid namespace?) still serves on it
        server.listen(1)
        removed = remove_stale_ipc_dirs([str(scratch)])
    assert sorted(removed) == sorted(str(p) for p in (dead, dead_empty, reused))
    assert not dead.exists() and not dead_empty.exists() and not reused.exists()
    assert live.is_dir() and extra.is_dir() and other.is_dir() and listened.is_dir()
    assert sorted(p.name for p in extra.iterdir()) == ["notes.txt", "to-engine"], "left as it was"


def test_a_signal_during_start_up_stops_cleanly(ckpt, tmp_path, scratch) -> None:
    """SIGTERM to the group while the engine loads (the socket folder exists, /health does not answer yet): the
    start-up ends, exit 0, no process and no socket folder left."""
    import subprocess
    import sys

    from live_server import free_port

    log_path = tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "redraft", "serve", "--model", str(ckpt), "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not socket_dirs(scratch):  # the engine is being started
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        time.sleep(0.3)
        members = group_members(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in group_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
    log = log_path.read_text()
    assert len([p for p, cmd in members.items() if b"resource_tracker" not in cmd]) == 2, members  # with the engine
    assert code == 0, log
    assert "SIGTERM: stopped at once" in log, log
    assert not wait_group_gone(proc.pid, 5.0)
    assert not socket_dirs(scratch), "the socket folder was left behind"
