"""Grammar checks in worker processes: llguidance is native code, and a hostile constraint can overflow its stack
(a segfault), exhaust memory or take seconds. A process that serves anyone else (the HTTP process, the engine)
never compiles a constraint the sandbox has not passed: `GrammarSandbox.check` runs Grammars.check (compile,
build the matcher, play the forced tokens, read the first bitmask: everything decoding does at the start) in a
small pool of workers, each under a memory limit (RLIMIT_AS) and a time limit per job. A worker that crashes or
runs out of time is killed and replaced on the next job; its request gets a GrammarError ("the grammar could
not be compiled: ..."). Verdicts, good and bad, are cached (LRU), so a repeated constraint costs nothing.

Torch-free. Workers are plain `python -m redraft.engine.text.grammar_sandbox` processes (started on the first
check, not before) talking length-prefixed JSON over their stdin/stdout; each exits when its parent does.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redraft.engine.text.grammar import GrammarError, cache_key, check_bounds

log = logging.getLogger("redraft.grammar")

WORKERS = 2  # concurrent checks; more wait for a free worker
JOB_TIMEOUT_S = 10.0  # a check that takes longer is refused (a schema that makes llguidance crawl)
START_TIMEOUT_S = 60.0  # a worker's start: Python, llguidance and the tokenizer's vocabulary
MEMORY_LIMIT_BYTES = 4 * 2**30  # address space of a worker
CACHE_SIZE = 512  # verdicts remembered
_HEADER = struct.Struct(">I")  # a frame: 4-byte big-endian length, then that much JSON


class WorkerFailed(Exception):
    """The worker died or ran out of time; it has been killed and will be replaced."""


# ---- the parent's side ---------------------------------------------------------------------------------------
class _Worker:
    """One worker process and its pipes; used by one thread at a time."""

    def __init__(self, init: bytes, memory_bytes: int):
        env = dict(os.environ, REDRAFT_GRAMMAR_WORKER_MEMORY=str(memory_bytes))
        self.proc = subprocess.Popen([sys.executable, "-m", "redraft.engine.text.grammar_sandbox"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        self.jobs = 0
        try:
            _write_frame(self.proc.stdin, init)
            reply = self.request(None, START_TIMEOUT_S)
        except (OSError, WorkerFailed) as exc:
            self.kill()
            raise WorkerFailed(f"a grammar worker did not start: {exc}") from exc
        if not reply.get("ready"):
            self.kill()
            raise WorkerFailed(f"a grammar worker did not start: {reply.get('error')}")

    def request(self, job: bytes | None, timeout: float) -> dict[str, Any]:
        """Send `job` (None: only read, the start-up answer) and wait for the answer; WorkerFailed (and the
        worker killed) on a crash or after `timeout` seconds."""
        try:
            if job is not None:
                _write_frame(self.proc.stdin, job)
            deadline = time.monotonic() + timeout
            header = self._read(_HEADER.size, deadline)
            return json.loads(self._read(_HEADER.unpack(header)[0], deadline))
        except TimeoutError:
            self.kill()
            raise WorkerFailed(f"it took longer than {timeout:g}s") from None
        except (OSError, ValueError) as exc:  # a broken pipe: it died before reading the job
            self.kill()
            raise WorkerFailed(self._death()) from exc
        except WorkerFailed:
            self.kill()
            raise

    def _read(self, n: int, deadline: float) -> bytes:
        fd, data = self.proc.stdout.fileno(), b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(data))
            if not chunk:  # EOF: the worker is gone
                raise WorkerFailed(self._death())
            data += chunk
        return data

    def _death(self) -> str:
        try:
            code = self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return "the compiler stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the compiler crashed ({name})"
        return f"the compiler exited with status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


_LIVE: "weakref.WeakSet[GrammarSandbox]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for sandbox in list(_LIVE):
        sandbox.close()


class GrammarSandbox:
    """Checks constraints for one tokenizer in worker processes (see the module's docstring). Thread-safe;
    `check` blocks its caller (the HTTP process calls it from a thread, off the event loop)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int, workers: int = WORKERS,
                 timeout_s: float = JOB_TIMEOUT_S, memory_bytes: int = MEMORY_LIMIT_BYTES,
                 cache_size: int = CACHE_SIZE):
        self._init = json.dumps({"tokenizer_json": tokenizer_json, "vocab_size": vocab_size,
                                 "eos_id": eos_id}).encode()
        self.timeout_s, self.memory_bytes, self.cache_size = timeout_s, memory_bytes, cache_size
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # key -> None (passed) or why not
        self._closed = False
        # acheck's threads, one per worker: checks waiting for a worker wait in its queue, not in a thread (the
        # event loop's default executor, which tokenizes, never fills up with them)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-check")
        self.started = self.crashed = 0  # workers started, and of those the ones that crashed or timed out
        _LIVE.add(self)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, **kwargs: Any) -> "GrammarSandbox":
        """From a redraft Tokenizer (engine/text/tokenizer.py)."""
        return cls(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_id, **kwargs)

    async def acheck(self, field: str, source: Any) -> None:
        """`check` for an event loop: a remembered verdict at once, anything else on the sandbox's own threads."""
        if self._cached(field, source):
            return
        if self._closed:  # shutting down: no new worker, no new thread
            raise GrammarError("the grammar checker is shut down", field)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.check, field, source)

    def check(self, field: str, source: Any) -> None:
        """GrammarError (naming `field`) unless the constraint passes the bounds and a worker's Grammars.check."""
        if self._cached(field, source):
            return
        check_bounds(field, source)  # cheap, in Python: common attacks never reach native code
        key = cache_key(field, source)
        error = self._run(field, source)
        with self._lock:
            self._verdicts[key] = error
            if len(self._verdicts) > self.cache_size:
                self._verdicts.popitem(last=False)
        if error is not None:
            raise GrammarError(error, field)

    def _cached(self, field: str, source: Any) -> bool:
        """True when the constraint passed before; GrammarError when it was refused before; False: unknown."""
        key = cache_key(field, source)
        with self._lock:
            if key not in self._verdicts:
                return False
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        if error is not None:
            raise GrammarError(error, field)
        return True

    def _run(self, field: str, source: Any, bounds: bool = True) -> str | None:
        """One job on a worker: None when it passed, else the message of the GrammarError to raise. `bounds`:
        False skips the worker's bounds (tests reach the native code with it)."""
        job = json.dumps({"field": field, "source": source, "bounds": bounds}).encode()
        with self._slots:
            worker = self._take()
            try:
                reply = worker.request(job, self.timeout_s)
            except WorkerFailed as exc:
                self.crashed += 1
                log.warning("grammar worker %d failed on a %s constraint (%s); it is replaced",
                            worker.proc.pid, field, exc)
                return f"invalid {field}: the grammar could not be compiled: {exc}"
            self._give_back(worker)
        return reply.get("error")

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise GrammarError("the grammar checker is shut down", "")
            if self._idle:
                return self._idle.pop()
        worker = _Worker(self._init, self.memory_bytes)
        self.started += 1
        with self._lock:
            if self._closed:
                worker.kill()
                raise GrammarError("the grammar checker is shut down", "")
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._idle]

    def close(self) -> None:
        """Stop the idle workers; a busy one is stopped when its job returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        self._executor.shutdown(wait=False, cancel_futures=True)
        for worker in idle:
            worker.kill()


def _write_frame(stream: Any, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


# ---- the worker's side ---------------------------------------------------------------------------------------
def _read_frame(stream: Any) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the parent closed the pipe: exit
    return stream.read(_HEADER.unpack(header)[0])


def _exit_with_parent() -> None:
    """A worker never outlives its parent, whatever kills the parent (EOF on stdin covers an idle worker; this,
    a busy one)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main() -> None:
    import resource

    # a Ctrl-C or SIGTERM to the whole process group: the parent decides when a worker ends (and a check in
    # flight is not cut short into a false "crashed" verdict)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    # frames go out on a private copy of stdout; anything printed goes to stderr (the server's log)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    limit = int(os.environ.get("REDRAFT_GRAMMAR_WORKER_MEMORY", MEMORY_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    raw = _read_frame(inp)
    if raw is None:
        return
    from redraft.engine.text.grammar import Grammars

    try:
        init = json.loads(raw)
        grammars = Grammars(init["tokenizer_json"], init["vocab_size"], init["eos_id"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which gives up on this worker
        _write_frame(out, json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}).encode())
        return
    _write_frame(out, b'{"ready": true}')
    while (raw := _read_frame(inp)) is not None:
        job = json.loads(raw)
        try:
            grammars.check(job["field"], job["source"], bounds=job.get("bounds", True))
            reply: dict[str, Any] = {}
        except GrammarError as exc:
            reply = {"error": str(exc)}
        except MemoryError:
            reply = {"error": f"invalid {job['field']}: the grammar could not be compiled: it needs too much memory"}
        except Exception as exc:  # noqa: BLE001 - any failure of the compiler is this constraint's fault
            reply = {"error": f"invalid {job['field']}: the grammar could not be compiled: {type(exc).__name__}: "
                              f"{str(exc)[:500]}"}
        _write_frame(out, json.dumps(reply).encode())


if __name__ == "__main__":
    _worker_main()
