"""A live `redraft serve` for tests: a free 127.0.0.1 port, the log in a file (shown when something fails),
SIGTERM on stop, with the exit status checked and every process the server started gone afterwards; and the
OpenAI error shape every refused request must have."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 30.0


# ---- processes (/proc only) ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process, None if there is none with this pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], fields[19]  # state (field 3), starttime (field 22)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (the children files, else every process's parent pid)."""
    files = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if files:
        kids: list[int] = []
        for f in files:
            try:
                kids += [int(x) for x in f.read_text().split()]
            except OSError:
                pass
        return kids
    kids = []  # kernels without CONFIG_PROC_CHILDREN: scan every process's parent pid
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                raw = (d / "stat").read_text()
            except OSError:
                continue
            if int(raw[raw.rindex(")") + 2 :].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant (the start time tells a reused pid apart)."""
    out: dict[int, str] = {}
    stack = [pid]
    while stack:
        for kid in child_pids(stack.pop()):
            st = proc_stat(kid)
            if st is not None and kid not in out:
                out[kid] = st[1]
                stack.append(kid)
    return out


def still_running(pid: int, start_time: str) -> bool:
    st = proc_stat(pid)
    return st is not None and st[1] == start_time and st[0] != "Z"


def kill_if_running(pid: int, start_time: str) -> None:
    if still_running(pid, start_time):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def assert_error_shape(resp: httpx.Response, status: int | None = None) -> dict:
    """An error answer in OpenAI's shape ({"error": {message, type, param, code}}), with `status` if given."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


# ---- the server ----------------------------------------------------------------------------------------------
class RedraftServer:
    """`python -m redraft serve` on a free 127.0.0.1 port, its log in a file (shown when something fails).
    model None: no --model flag (the bundled demo model). env: added to the environment (None removes)."""

    def __init__(self, model: Path | None, log_dir: Path, extra_args: list[str],
                 env: dict[str, str | None] | None = None, new_session: bool = False):
        self.model, self.extra_args = model, extra_args
        self.new_session = new_session  # its own process group (pgid = its pid), as a supervisor would start it
        self.env_changes = env or {}
        self.log_path = log_dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.seen_descendants: dict[int, str] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def children(self) -> list[int]:
        return list(self.seen_descendants)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> "RedraftServer":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key, value in self.env_changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        model = ["--model", str(self.model)] if self.model is not None else []
        for _ in range(3):  # a free port can be taken between free_port() and the bind: try another
            self.port = free_port()
            cmd = [sys.executable, "-m", "redraft", "serve", *model, "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning", *self.extra_args]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=self.new_session)
            if self._wait_healthy():
                self.record_descendants()
                return self
            if self.proc.poll() is None:
                break  # alive but not healthy in time: not a port clash
        self.stop(check=False)
        pytest.fail(f"`redraft serve` did not become healthy; log:\n{self.log_tail()}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def record_descendants(self) -> dict[int, str]:
        if self.proc is not None and self.proc.poll() is None:
            self.seen_descendants.update(descendants(self.proc.pid))
        return self.seen_descendants

    def engine_pid(self) -> int:
        engines = [p for p in child_pids(self.proc.pid) if b"spawn_main" in cmdline(p)]
        assert len(engines) == 1, f"expected one engine process among the children, got {engines}"
        return engines[0]

    def stop(self, check: bool = True) -> None:
        """SIGTERM; the server must exit in time, and every process it started must be gone."""
        if self.proc is None:
            return
        self.record_descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            for pid, start in self.seen_descendants.items():
                kill_if_running(pid, start)
            if check:
                pytest.fail(f"the server did not exit within {SHUTDOWN_TIMEOUT_S}s of SIGTERM; log:\n{self.log_tail()}")
            return
        deadline = time.monotonic() + 15.0  # orphans are reparented and reaped; give them a moment
        left = dict(self.seen_descendants)
        while left and time.monotonic() < deadline:
            left = {p: s for p, s in left.items() if still_running(p, s)}
            time.sleep(0.1)
        for pid, start in left.items():  # never leave a stray process behind, even when failing
            kill_if_running(pid, start)
        if check:
            # uvicorn re-raises the signal after its graceful shutdown: -SIGTERM is a clean exit too
            assert code in (0, -signal.SIGTERM), f"server exit code {code}; log:\n{self.log_tail()}"
            assert not left, (f"processes left behind by the server: "
                              f"{ {p: cmdline(p) for p in left} }; log:\n{self.log_tail()}")
