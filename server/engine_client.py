"""The HTTP process's handle on the engine process: starts it, talks to it over ZMQ, watches it die, heals it.

Every in-flight request has an asyncio queue that the receive loop fills with the engine's progress
messages. If the engine process exits, every waiting request is failed at once with EngineDead and
`alive` turns False, so routes answer 503 (with Retry-After) instead of hanging; then the engine is started
again in place, up to `--engine-restarts` times with a growing pause. If that fails too, `failed` turns True and
the `on_fatal` callbacks run (the server then exits non-zero, so that its supervisor restarts the pod).
Once shutdown has begun (`begin_shutdown`, at the first SIGTERM/SIGINT) nothing is restarted any more.

The two ZMQ ipc sockets live in a private folder (mode 0700: only this user may connect, and the engine
unpickles what arrives) named after this process, `$TMPDIR/redraft-<pid>-<start time>-<random>`. It is removed
on every exit this process controls; the folders of servers that died without that (SIGKILL, a segfault) are
removed by the next server that starts (`remove_stale_ipc_dirs`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import logging
import multiprocessing as mp
import os
import re
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from redraft.protocol.processes import group_signals_blocked
from redraft.engine.text.launch import run_engine_process
from redraft.protocol.errors import RequestError, duplicate_request_id
from redraft.protocol.messages import (
    Accepted, AbortReq, ControlResult, EngineFailed, EngineReady, FlushCacheReq, FlushCacheResult, GenerateBatchReq,
    GenerateReq, PingReq, Pong, Rejected, RequestOutput, ScoreAbortReq, ScoreReq, ScoreResult, ShutdownReq,
    WeightGroupReq, WeightUpdateReq,
)
from redraft.protocol.server_args import ServerArgs

log = logging.getLogger("redraft.client")


OVERFLOW_GRACE_S = 10.0  # a stream past its backlog limit whose reader takes nothing this long is cut off


class EngineDead(RuntimeError):
    """The engine process is gone."""


class EngineHung(EngineDead):
    """The engine process is alive but sent nothing (not even a heartbeat) for --engine-heartbeat-timeout."""


class ServerDraining(EngineDead):
    """The server is shutting down and its drain time is over: the request is ended (503)."""


class WeightsLost(EngineDead):
    """The engine died after a weight update whose weights cannot be loaded again: it is not restarted (that
    would silently serve the launch checkpoint); every request is refused with this reason (docs/rl.md)."""


# ---- the socket folder ----------------------------------------------------------------------------------------
_SOCKETS = ("to-engine", "from-engine")
_IPC_DIR = re.compile(r"redraft-(\d+)-(\d+)-[A-Za-z0-9_]+")


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), which tells a reused pid apart; None
    without /proc or without such a process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_gone(pid: int, start: str) -> bool:
    if not _pid_alive(pid):
        return True
    now = _start_time(pid)
    return start != "0" and now is not None and now != start  # the pid was reused by another process


def _socket_listened_on(path: Path) -> bool:
    """Whether a process still accepts connections on this unix socket (a live server in another pid namespace
    sharing /tmp looks dead by its pid)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        return True


# A unix socket's path has at most 107 bytes on Linux (103 on macOS): a $TMPDIR too long for it falls back to /tmp.
_MAX_SOCKET_PATH = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 103


def _ipc_roots() -> list[str]:
    """Where socket folders may be: $TMPDIR (tempfile's choice), and /tmp for a $TMPDIR too long."""
    return list(dict.fromkeys([tempfile.gettempdir()] + (["/tmp"] if os.path.isdir("/tmp") else [])))


def new_ipc_dir() -> str:
    """A private folder (0700) for this process's sockets, named after it for `remove_stale_ipc_dirs`."""
    pid = os.getpid()
    prefix = f"redraft-{pid}-{_start_time(pid) or 0}-"
    root = tempfile.gettempdir()
    longest = os.path.join(root, prefix + "x" * 8, max(_SOCKETS, key=len))  # mkdtemp adds 8 characters
    if len(os.fsencode(longest)) > _MAX_SOCKET_PATH and os.path.isdir("/tmp"):
        root = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=root)


def remove_ipc_dir(path: str | Path) -> bool:
    """Remove a socket folder that holds nothing but our sockets (anything else: left alone). True if gone."""
    for name in _SOCKETS:
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def remove_stale_ipc_dirs(roots: list[str] | None = None) -> list[str]:
    """Remove the socket folders of this user's servers that are gone (a SIGKILL or a crash left them): the
    owner pid in the name no longer runs (or is another process now) and no one listens on its sockets.
    Returns the folders removed."""
    removed = []
    for path in [p for root in roots or _ipc_roots() for p in Path(root).glob("redraft-*")]:
        m = _IPC_DIR.fullmatch(path.name)
        try:
            if not m or not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _owner_gone(int(m.group(1)), m.group(2)):
            continue
        try:
            if any(child.name not in _SOCKETS for child in path.iterdir()):
                continue  # not only our sockets: not ours to remove
        except OSError:
            continue
        if any(_socket_listened_on(path / name) for name in _SOCKETS):
            continue
        if remove_ipc_dir(path):
            removed.append(str(path))
    return removed


class StreamBacklogExceeded(RequestError):
    """A stream's reader fell too far behind: the undelivered messages were dropped and the request ended."""

    def __init__(self, limit: int):
        super().__init__(f"the client read this stream too slowly: more than {limit} blocks and forward events were "
                         "waiting for it, the limit "
                         "(--max-stream-backlog); the request was ended", status=429, code="stream_backlog_exceeded")


def backlog_units(msg: Any) -> int:
    """What a message counts toward --max-stream-backlog: one for its committed block (at most a block of ids and
    their logprobs), one more per forward event it carries (stream_denoise): each unit is bounded in size."""
    if isinstance(msg, RequestOutput):
        return 1 + len(msg.denoise or ())
    return 0


@dataclass
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    backlog: int = 0  # undelivered units in the queue (backlog_units)
    overflowed: bool = False  # its reader fell too far behind: nothing more is queued for it
    consumer: asyncio.Task | None = None  # the task reading it (cancelled if the overflow is never read)


class EngineStream:
    """The messages of one engine request: Accepted (or the RequestError of its refusal), then its progress, the
    last one finished. `aclose` frees its id and, when it did not finish, aborts it in the engine (the consumer
    went away): every stream must be closed, iterated to its end or not."""

    def __init__(self, client: "EngineClient", rid: str, pending: _Pending):
        self.client, self.rid, self.pending = client, rid, pending
        self._closed = False

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self) -> Accepted | RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        self.pending.consumer = asyncio.current_task()
        msg = await self.pending.queue.get()
        self.pending.backlog -= backlog_units(msg)
        if isinstance(msg, Exception):  # the engine died, or the reader fell too far behind
            await self.aclose()
            raise msg
        if isinstance(msg, Rejected):
            self.pending.finished = True
            await self.aclose()
            raise msg.error()
        if isinstance(msg, RequestOutput) and msg.finished:
            self.pending.finished = True
            await self.aclose()  # the next call ends the iteration
        return msg

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.client._pending.get(self.rid) is self.pending:
            del self.client._pending[self.rid]
        if not self.pending.finished and self.client.alive:  # client gone, cancelled or failed: free its pages now
            await self.client.abort(self.rid)


class EngineClient:
    def __init__(self, args: ServerArgs, startup_timeout: float = 600.0):
        self.args = args
        self.startup_timeout = startup_timeout
        self.max_restarts = args.engine_restarts  # restarts in place before the server gives up
        self.max_backlog = args.max_stream_backlog  # undelivered messages one request may have
        self.heartbeat_timeout = args.engine_heartbeat_timeout
        self.last_heard = time.monotonic()  # the engine's last message (a heartbeat at least every second)
        self.hung = False  # it fell silent past the timeout: killed, and not yet replaced
        self.failed = False  # the engine died and could not be restarted: the server should exit
        self.restarts = 0  # engine restarts so far
        self._ready: asyncio.Future | None = None  # set by the receive loop when a restarted engine is ready
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.alive = False
        self.closing = False  # an exit we asked for is not a death
        self.shutting_down = False  # a SIGTERM/SIGINT arrived: never restart the engine again
        self.proc: mp.process.BaseProcess | None = None
        self._pending: dict[str, _Pending] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._aborts: set[asyncio.Task] = set()  # score aborts in flight (a reference keeps each task alive)
        for path in remove_stale_ipc_dirs():
            log.info("removed the socket folder of a server that is gone: %s", path)
        self._ipc_dir = new_ipc_dir()
        atexit.register(self._remove_ipc_dir)  # the last resort: an exit that skipped close()
        self._to_engine_addr = f"ipc://{self._ipc_dir}/to-engine"
        self._from_engine_addr = f"ipc://{self._ipc_dir}/from-engine"
        self.on_finished: list = []  # callbacks(RequestOutput) for metrics
        self.on_submit: list = []  # callbacks(rid, SamplingParams) as a request is sent (metrics: start, labels)
        self.on_message: list = []  # callbacks(Accepted | RequestOutput | Rejected) (metrics: per block timing)
        self.on_down: list = []  # callbacks() when the engine dies (metrics: engine gauges to zero)
        self.on_fatal: list = []  # callbacks() when it cannot be restarted (the server: exit non-zero)
        # After a weight update (server/rl_api.py): why a restart must not happen (the served weights cannot be
        # loaded again), else None; a restart loads what `args` says, kept up to date by `weights_changed`.
        self.restart_refusal: str | None = None
        # weight loads and group joins in flight: the engine loop blocks in them (a trainer may take minutes to
        # join or send), so its silence then is no hang (_check_heartbeat)
        self.weight_ops = 0
        self.refused: WeightsLost | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine process and wait (blocking) until it has loaded the model; on failure nothing is left
        behind (process, sockets, the socket folder) and RuntimeError says why in one line."""
        try:
            self._start()
        except BaseException as exc:
            if self.proc is not None and self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self._sync_ctx.destroy(linger=0)
            self._remove_ipc_dir()
            if isinstance(exc, zmq.ZMQError):
                raise RuntimeError(f"cannot open the engine's sockets in {self._ipc_dir}: {exc}") from None
            raise

    def _start(self) -> None:
        self._sync_ctx = zmq.Context()
        pull = self._sync_ctx.socket(zmq.PULL)
        pull.bind(self._from_engine_addr)
        self._push_sync = self._sync_ctx.socket(zmq.PUSH)
        self._push_sync.bind(self._to_engine_addr)
        self._spawn()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if pull.poll(200):
                msg = pull.recv_pyobj()
                if isinstance(msg, EngineReady):
                    self.info = msg.info
                    break
                if isinstance(msg, EngineFailed):
                    self.proc.join(5)
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("the engine did not become ready in time")
        pull.close(linger=0)
        self._push_sync.close(linger=0)
        self._sync_ctx.term()
        self.alive, self.last_heard = True, time.monotonic()

    def _spawn(self) -> None:
        proc = mp.get_context("spawn").Process(
            target=run_engine_process,
            args=(self.args, self._to_engine_addr, self._from_engine_addr),
            name="redraft-engine",
            # A daemonic process may not start processes: with tensor parallelism the engine starts its ranks.
            # It still exits when this process goes (it watches its parent) and close() ends it.
            daemon=self.args.tp_size == 1,
        )
        with group_signals_blocked():  # a SIGTERM to the group while it starts up is ours to handle, not its
            proc.start()
        self.proc = proc

    async def connect(self) -> None:
        """Open the asyncio sockets and start the receive and watchdog loops (inside the server's loop)."""
        self._ctx = zmq.asyncio.Context()
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(self._from_engine_addr)
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.bind(self._to_engine_addr)
        self._dead = asyncio.Event()  # set by the watchdog: sends stop waiting for a peer that is gone
        self._no_restarts = asyncio.Event()  # set by begin_shutdown: a restart's pause ends, and so does it
        self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watchdog())]

    async def close(self) -> None:
        """Ask the engine to stop, wait a little, then make sure it is gone."""
        self.closing = True
        if self.proc is not None and self.proc.is_alive():
            try:
                await self._send.send_pyobj(ShutdownReq())
            except Exception:  # noqa: BLE001 - best effort, we kill below anyway
                pass
            for _ in range(50):
                if not self.proc.is_alive():
                    break
                await asyncio.sleep(0.1)
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
        self.alive = False
        for task in self._tasks:
            task.cancel()
        if hasattr(self, "_ctx"):
            self._ctx.destroy(linger=0)
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        remove_ipc_dir(self._ipc_dir)

    def begin_shutdown(self) -> None:
        """The server is stopping (its first SIGTERM/SIGINT): the engine is never restarted from now on, and a
        restart already under way is abandoned (its new process killed) by `_restart` itself."""
        self.shutting_down = True  # the signal handler has set it already; this also serves other callers
        if hasattr(self, "_no_restarts"):
            self._no_restarts.set()

    def kill_now(self) -> None:
        """Stop at once (a second signal): SIGKILL the engine (it ignores SIGTERM; its ranks die with it) and
        remove the socket folder; nothing more is sent to it. Safe in a signal handler; then, in the event loop,
        `end_all` ends the requests that were running."""
        self.shutting_down = self.closing = True
        self.alive = False
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        self._remove_ipc_dir()

    def end_all(self, reason: EngineDead) -> None:
        """After kill_now (in the event loop): every request still waiting ends with `reason` at once."""
        if hasattr(self, "_dead"):
            self._fail_in_flight(reason)

    def release(self) -> None:
        """After the event loop has ended: close the asyncio sockets at once (a message queued for a dead engine
        must not hold the exit) and remove the socket folder. close() does this on an orderly shutdown."""
        if hasattr(self, "_ctx") and not self._ctx.closed:
            self._ctx.destroy(linger=0)
        self._remove_ipc_dir()

    # ---- loops --------------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            batch = await self._recv.recv_pyobj()
            self.last_heard = time.monotonic()
            # one list per engine iteration; EngineReady / EngineFailed come alone (from a restarted engine)
            for msg in batch if isinstance(batch, list) else [batch]:
                try:
                    self._dispatch(msg)
                except Exception:  # noqa: BLE001 - one bad message must not stop every request's progress
                    log.exception("dispatching %s failed", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, (Accepted, RequestOutput, Rejected)):
            pending = self._pending.get(msg.rid)
            if pending is not None and not pending.overflowed:
                pending.backlog += backlog_units(msg)
                if pending.backlog > self.max_backlog:
                    self._overflow(msg.rid, pending)
                else:
                    pending.queue.put_nowait(msg)
            for callback in self.on_message:
                callback(msg)
            if isinstance(msg, RequestOutput) and msg.finished:
                for callback in self.on_finished:
                    callback(msg)
        elif isinstance(msg, (EngineReady, EngineFailed)):  # a restarted engine reporting in
            if self._ready is not None and not self._ready.done():
                if isinstance(msg, EngineReady):
                    self._ready.set_result(msg.info)
                else:
                    self._ready.set_exception(RuntimeError(msg.message))
        elif isinstance(msg, (Pong, FlushCacheResult, ScoreResult, ControlResult)):
            if isinstance(msg, Pong):
                self.stats = msg.stats
            waiter = self._waiters.pop(msg.token, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)

    def _overflow(self, rid: str, pending: _Pending) -> None:
        """A reader over `max_backlog` units behind: its messages are dropped (the memory returns), the request is
        ended in the engine, and the reader's next read is the error. A reader that never reads again (its
        connection stalled) has its task cancelled after OVERFLOW_GRACE_S, which closes the connection."""
        pending.overflowed, pending.backlog = True, 0
        if self._pending.get(rid) is pending:  # no longer in flight: a drain does not wait for its reader
            del self._pending[rid]
        while not pending.queue.empty():
            pending.queue.get_nowait()
        error = StreamBacklogExceeded(self.max_backlog)
        pending.queue.put_nowait(error)
        log.warning("request %s: its reader is over %d units behind (--max-stream-backlog): ended", rid,
                    self.max_backlog)
        self._background(self.abort(rid))

        def cut_if_unread() -> None:
            if pending.queue.qsize() and pending.consumer is not None and not pending.consumer.done():
                log.warning("request %s: its reader took nothing for %.0fs: the connection is closed", rid,
                            OVERFLOW_GRACE_S)
                pending.consumer.cancel()

        asyncio.get_running_loop().call_later(OVERFLOW_GRACE_S, cut_if_unread)

    def _background(self, coro: Any) -> None:
        """Run `coro` as a task whose reference is kept until it ends (and whose error is retrieved)."""
        task = asyncio.ensure_future(coro)
        self._aborts.add(task)
        task.add_done_callback(lambda t: (self._aborts.discard(t), t.cancelled() or t.exception()))

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self._check_heartbeat()
            if self.proc is not None and not self.proc.is_alive():
                if self.closing:
                    return
                log.error("the engine process died (exit code %s): failing every request", self.proc.exitcode)
                self._fail_in_flight()
                if self.restart_refusal is not None and not self.shutting_down:
                    # (the server stays up, refusing with the reason: a supervisor restarting it would revert)
                    self.refused = WeightsLost(self.restart_refusal)
                    log.error("the engine is not restarted: %s", self.restart_refusal)
                    return
                if self.shutting_down:
                    log.warning("the server is shutting down: the engine is not restarted")
                    return
                if await self._restart():
                    continue
                if not self.closing and not self.shutting_down:
                    log.error("the engine could not be restarted after %d attempts: the server exits",
                              self.max_restarts)
                    self.failed = True
                    for callback in self.on_fatal:
                        callback()
                return

    def _check_heartbeat(self) -> None:
        """An engine alive but silent past --engine-heartbeat-timeout (stopped, deadlocked, stuck in a forward) is
        killed: the watchdog then fails its requests and restarts it as after a crash."""
        silent = time.monotonic() - self.last_heard
        if (not self.alive or self.closing or self.hung or self.proc is None or not self.proc.is_alive()
                or silent <= self.heartbeat_timeout or self.weight_ops):
            return
        log.error("the engine sent nothing for %.0fs (--engine-heartbeat-timeout %g): killing it", silent,
                  self.heartbeat_timeout)
        self.hung = True
        self._fail_in_flight(EngineHung(f"the engine stopped answering (nothing for {silent:.0f}s, "
                                        "--engine-heartbeat-timeout); it is being restarted"))
        self.proc.kill()

    def _fail_in_flight(self, reason: EngineDead | None = None) -> None:
        """The engine is gone: every request and waiter fails at once with `reason` (a death by default)."""
        reason = reason or EngineDead("the engine process died")
        self.alive = False
        self._dead.set()
        for pending in self._pending.values():
            pending.queue.put_nowait(reason)
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(reason)
        self._waiters.clear()
        for callback in self.on_down:
            callback()

    async def end_in_flight(self, reason: Exception) -> int:
        """End every request still in flight with `reason` (their routes answer with it) and abort them in the
        engine. Returns how many there were."""
        rids = list(self._pending)
        for rid in rids:
            pending = self._pending.get(rid)
            if pending is not None:
                pending.queue.put_nowait(reason)
            await self.abort(rid)
        return len(rids)

    async def _restart(self) -> bool:
        """Start a new engine process in place (growing pauses between attempts). True once one is ready."""
        for attempt in range(1, self.max_restarts + 1):
            pause = min(2.0 ** (attempt - 1), 10.0)
            log.warning("restarting the engine in %.0fs (attempt %d of %d)", pause, attempt, self.max_restarts)
            with contextlib.suppress(asyncio.TimeoutError):  # the pause ends early when shutdown begins
                await asyncio.wait_for(self._no_restarts.wait(), pause)
            if self.closing or self.shutting_down:
                log.warning("restart cancelled: the server is shutting down")
                return False
            self._ready = asyncio.get_running_loop().create_future()
            self._spawn()
            deadline = time.monotonic() + self.startup_timeout
            while (not self._ready.done() and self.proc.is_alive() and time.monotonic() < deadline
                   and not self.shutting_down):
                await asyncio.wait({self._ready}, timeout=0.2)
            if self.shutting_down:  # a signal came while the new engine started: it is not wanted any more
                log.warning("restart cancelled: the server is shutting down")
                self._ready.cancel()  # whatever the new engine reports now is of no interest
                if self.proc.is_alive():
                    self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5)
                return False
            if self._ready.done() and self._ready.exception() is None:
                self.info = self._ready.result()
                self.restarts += 1
                self.hung, self.last_heard = False, time.monotonic()
                self._dead.clear()
                self.alive = True
                log.warning("the engine is back (restart %d)", self.restarts)
                return True
            if self._ready.done():
                log.error("the restarted engine failed to start: %s", self._ready.exception())
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
        return False

    # ---- requests -----------------------------------------------------------------------------------
    async def submit(self, reqs: list[GenerateReq]) -> list["EngineStream"]:
        """Send every engine request of one HTTP request in one message (admitted together, all or none, in one
        iteration: GenerateBatchReq) and return their streams: each yields Accepted (or raises the refusal's
        RequestError), then its progress messages, the last one finished. Close every stream (`aclose`)."""
        if not self.alive:
            raise self.refused or EngineDead("the engine is not running")
        seen: set[str] = set()
        for r in reqs:
            if r.rid in self._pending or r.rid in seen:  # its progress would go to the request already in flight
                raise duplicate_request_id(r.rid)
            seen.add(r.rid)
        streams = [EngineStream(self, r.rid, self._pending.setdefault(r.rid, _Pending())) for r in reqs]
        for r in reqs:
            for callback in self.on_submit:
                callback(r.rid, r.params)
        try:
            await self._send_msg(reqs[0] if len(reqs) == 1 else GenerateBatchReq(list(reqs)))
        except BaseException:
            for stream in streams:
                stream.pending.finished = True  # never admitted: nothing to abort
                await stream.aclose()
            raise
        return streams

    async def abort(self, rid: str, finish: dict[str, Any] | None = None, keep_tokens: int | None = None) -> None:
        """End a request (see AbortReq: `finish` and `keep_tokens` end it at a stop string)."""
        if self.alive:
            await self._send_msg(AbortReq(rid, finish, keep_tokens))

    async def _request(self, msg: Any, timeout: float | None) -> Any:
        if not self.alive:
            raise self.refused or EngineDead("the engine is not running")
        future = asyncio.get_running_loop().create_future()
        self._waiters[msg.token] = future
        try:
            await self._send_msg(msg)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiters.pop(msg.token, None)
            if future.done() and not future.cancelled():
                future.exception()  # the watchdog may have failed it while the send failed: retrieved

    async def _send_msg(self, msg: Any) -> None:
        """Send to the engine, or raise EngineDead once it is known dead. A PUSH socket whose peer is gone
        blocks a send forever (and every later send queues behind it), so a request that arrives between
        the engine's death and the watchdog's next look must not wait on the send alone."""
        send = asyncio.ensure_future(self._send.send_pyobj(msg))
        if send.done():
            return send.result()
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait({send, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not send.done():
                send.cancel()
        if not send.cancelled() and send.done():
            return send.result()
        raise EngineDead("the engine process died")

    async def ping(self, timeout: float = 5.0) -> dict[str, Any]:
        pong = await self._request(PingReq(uuid.uuid4().hex), timeout)
        return pong.stats

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheResult:
        return await self._request(FlushCacheReq(uuid.uuid4().hex), timeout)

    async def control(self, msg: Any, timeout: float | None = None) -> ControlResult:
        """A training control message (protocol/messages.py; server/rl_api.py); no timeout by default: an update
        waits for the running requests, a broadcast for the trainer. Those, and a memory release or resume (host
        copies of the weights, CUDA graph capture), may keep the engine loop silent past the heartbeat timeout."""
        blocking = isinstance(msg, (WeightUpdateReq, WeightGroupReq)) or \
            getattr(msg, "op", None) in ("release_memory", "resume_memory")
        self.weight_ops += blocking
        try:
            return await self._request(msg, timeout)
        finally:
            self.weight_ops -= blocking
            self.last_heard = max(self.last_heard, time.monotonic()) if blocking else self.last_heard

    def weights_changed(self, data: dict[str, Any]) -> None:
        """An update succeeded: what the routes report, and what a restarted engine must load (or that it must
        not be restarted at all)."""
        for key in ("weight_version", "serving_path", "weights_recoverable"):
            if key in data:
                self.info[key] = data[key]
        if data.get("weights_recoverable", True):
            self.args = self.args.replace(model_path=data.get("serving_path", self.args.model_path),
                                          weight_version=data.get("weight_version", self.args.weight_version))
            self.restart_refusal = None
        else:
            self.restart_refusal = ("the weights served since the last update came from a trainer's broadcast and "
                                    "were not kept (start the server with --weight-spool-dir to keep them): "
                                    "restarting would silently serve the launch checkpoint instead")

    async def score(self, sequences: list[list[int]], variants: list, top_k: int = 0, timeout: float = 3600.0) -> list:
        """Log-probabilities of masked variants (ScoreReq); a RequestError when the engine refuses. Cancelled
        (the client left) or timed out, the engine drops the job and frees its pages at once."""
        # variants as plain tuples: a maximal request's 65,536 pickle in a fifth of the time (the engine reads them
        # positionally, as likelihood.Variant's fields)
        msg = ScoreReq(uuid.uuid4().hex, sequences, [tuple(v) for v in variants], top_k)
        try:
            res = await self._request(msg, timeout)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            self._abort_score(msg.token)
            raise
        if res.results is None:
            raise res.error()
        return res.results

    def _abort_score(self, token: str) -> None:
        """Send ScoreAbortReq from a task of its own (the caller is being cancelled and must not wait)."""
        if not self.alive:
            return
        self._background(self._send_msg(ScoreAbortReq(token)))

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def in_flight_rids(self) -> list[str]:
        """The engine ids of the requests in flight (the admin's /abort_request finds a client's id among them)."""
        return list(self._pending)
