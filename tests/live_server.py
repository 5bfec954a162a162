"""A live `redraft serve` for tests: a free 127.0.0.1 port, the log in a file (shown when something fails),
SIGTERM on stop with the exit status and the engine process checked."""

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (the children files, else every process's parent pid)."""
    files = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if files:
        out = []
        for f in files:
            try:
                out += [int(x) for x in f.read_text().split()]
            except OSError:
                pass
        return out
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


class RedraftServer:
    """`python -m redraft serve` on a free 127.0.0.1 port, its log in a file (shown when something fails).
    model None: no --model flag (the bundled demo model)."""

    def __init__(self, model: Path | None, log_dir: Path, extra_args: list[str],
                 env: dict[str, str | None] | None = None):
        self.model, self.extra_args = model, extra_args
        self.env_changes = env or {}  # added to the environment; a None value removes the variable
        self.log_path = log_dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.children: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        for _ in range(3):  # the free port may be taken before the server binds it: try another
            self.port = _free_port()
            model = ["--model", str(self.model)] if self.model is not None else []
            cmd = [sys.executable, "-m", "redraft", "serve", *model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--log-level", "warning", *self.extra_args]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if self._wait_healthy():
                self.children = _child_pids(self.proc.pid)
                return self
            if self.proc.poll() is None:
                break  # running but never healthy: not a port clash
        self.stop(check=False)
        pytest.fail(f"`redraft serve` did not become healthy; log:\n{self.log_tail()}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0, trust_env=False).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def stop(self, check: bool = True) -> None:
        """SIGTERM; the server must exit in time with a clean status, and its engine process with it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.children = sorted(set(self.children) | set(_child_pids(self.proc.pid)))
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            code = None
        deadline = time.monotonic() + 15.0
        while any(_alive(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in self.children if _alive(p)]
        for pid in left:  # never leave a stray engine behind, even when failing
            os.kill(pid, signal.SIGKILL)
        if check:
            assert code is not None, f"the server ignored SIGTERM for {SHUTDOWN_TIMEOUT_S}s; log:\n{self.log_tail()}"
            assert code in (0, -signal.SIGTERM), f"server exit code {code}; log:\n{self.log_tail()}"
            assert not left, f"processes outlived the server: {left}; log:\n{self.log_tail()}"
