"""The engine process: an `EngineCore` in a loop, fed by the HTTP process over ZMQ.

Each iteration: take every pending message (new requests, aborts, flushes, pings, likelihood jobs), run one
core step (one forward for the whole batch, and a bounded chunk of likelihood work), then send back one list:
acceptances, rejections, what each request committed since its last message, finished likelihood jobs. A failure
that concerns one request ends that request (an error finish, a 500 for that message), never this loop.
Idle, it blocks on the socket instead of spinning. It exits on ShutdownReq, or by itself when its parent process
is gone, so no orphan is ever left behind. SIGINT/SIGTERM sent to the whole process group are ignored: the HTTP
process drains its requests first, then stops this one (protocol/processes.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from redraft.protocol.processes import end_children, parent_alive, shield_from_group_signals
from redraft.protocol.errors import RequestError
from redraft.protocol.messages import (
    HEARTBEAT_INTERVAL_S, AbortReq, ControlResult, EngineFailed, EngineReady, FlushCacheReq, FlushCacheResult,
    GenerateBatchReq, GenerateReq, GenerationControlReq, Heartbeat, PingReq, Pong, Rejected, ScoreAbortReq, ScoreReq,
    ScoreResult, ShutdownReq, WeightGroupReq, WeightUpdateReq,
)
from redraft.protocol.log_safety import install_log_safety
from redraft.protocol.server_args import ServerArgs

log = logging.getLogger("redraft.engine_process")

LOG_INTERVAL_S = 5.0
CONTROL_MESSAGES = (WeightUpdateReq, WeightGroupReq, GenerationControlReq)


def serve_engine(args: ServerArgs, recv_addr: str, send_addr: str) -> None:
    """The engine process's main (entered through engine/text/launch.py `run_engine_process`): an EngineCore
    behind these sockets until ShutdownReq or its parent's end."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_safety(("",))  # request ids and refusal reasons come from clients: one bounded line each
    parent = shield_from_group_signals()  # the HTTP process drains, then shuts us down; we die with it
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    asked_to_stop, linger_ms = False, 0
    try:
        try:
            from redraft.engine.runtime.core import EngineCore

            core = EngineCore(args.replace(progress=False))
        except Exception as exc:  # report why (once: the HTTP process prints it), then die
            log.debug("engine failed to start", exc_info=True)
            send.send_pyobj(EngineFailed(f"{type(exc).__name__}: {exc}"))
            linger_ms = 1000  # that message must get out
            return
        send.send_pyobj(EngineReady(info=core.info()))
        log.info("engine ready: %s", core.model_path)
        loop = EngineLoop(core, recv, send, parent)
        loop.run()
        asked_to_stop = loop.asked_to_stop
        if asked_to_stop:
            core.shutdown()  # tensor parallel: the ranks stop and are joined
    finally:
        # Ranks ignore SIGTERM, so multiprocessing's exit hook (SIGTERM, then join) would wait on them forever:
        # every child still here (a failed start, a crash, the parent gone) is killed now.
        end_children(grace_s=2.0 if asked_to_stop else 0.0)
        ctx.destroy(linger=linger_ms)


class EngineLoop:
    def __init__(self, core, recv: zmq.Socket, send: zmq.Socket, parent_pid: int):
        self.core = core
        self.recv, self.send = recv, send
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(recv, zmq.POLLIN)
        self.outbox: list[Any] = []
        self.running = True
        self.asked_to_stop = False  # ShutdownReq (else the parent is gone, or a step raised)
        self._last_log = time.monotonic()
        self._forwards_at_log = 0
        self._tokens_since_log = 0
        self._last_sent = time.monotonic()

    def run(self) -> None:
        while self.running:
            if not parent_alive(self.parent_pid):
                log.warning("parent process is gone: exiting")
                return
            self._drain_messages(block_ms=0 if self.core.has_work() else 100)
            self._flush()  # admissions are answered now, not after the forward
            # A failure of one request ends that request (an error finish) inside step; what escapes is the
            # engine's own fault, and ends this process.
            for out in self.core.step():
                self._tokens_since_log += len(out.new_ids)
                self.outbox.append(out)
            self.outbox.extend(self.core.take_score_results())
            self.outbox.extend(self.core.weights.poll())  # a weight update that waited for the running requests
            self._flush()
            self._maybe_log()

    def _flush(self) -> None:
        """Send what this iteration produced; when it produced nothing for a while, a Heartbeat (from this loop,
        not a thread: a loop stuck in a forward or stopped must fall silent)."""
        if not self.outbox and time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S:
            self.outbox.append(Heartbeat())
        if self.outbox:
            self.send.send_pyobj(self.outbox)
            self.outbox = []
            self._last_sent = time.monotonic()

    def _drain_messages(self, block_ms: int) -> None:
        if block_ms and not self.poller.poll(block_ms):
            return
        while True:
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(msg)
            except Exception as exc:  # noqa: BLE001 - one message's failure must not end the loop
                self._handle_failed(msg, exc)

    def _handle_failed(self, msg: Any, exc: Exception) -> None:
        """An unexpected failure handling one message: answered as a 500 for that message alone."""
        name = getattr(msg, "rid", None) or getattr(msg, "token", None)
        from redraft.scheduler.scheduler import describe

        log.error("handling %s %s failed: %s", type(msg).__name__, name, describe(exc))
        log.debug("handling %s %s failed", type(msg).__name__, name, exc_info=True)
        text = f"internal error: {describe(exc)}"
        if isinstance(msg, (GenerateReq, GenerateBatchReq)):
            for req in msg.reqs if isinstance(msg, GenerateBatchReq) else [msg]:
                self.outbox.append(Rejected(req.rid, 500, text, "internal_error"))
        elif isinstance(msg, ScoreReq):
            self.outbox.append(ScoreResult(msg.token, None, 500, text, "internal_error"))
        elif isinstance(msg, CONTROL_MESSAGES):
            self.outbox.append(ControlResult(msg.token, False, text, {"status": 500}))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, (GenerateReq, GenerateBatchReq)):
            reqs = msg.reqs if isinstance(msg, GenerateBatchReq) else [msg]
            try:  # all or none; every answer goes out before the next forward (run: `_flush`)
                self.outbox.extend(self.core.add_requests([(r.rid, r.input_ids, r.params) for r in reqs]))
            except RequestError as exc:
                self.outbox.extend(Rejected.of(r.rid, exc) for r in reqs)
        elif isinstance(msg, AbortReq):
            self.core.abort(msg.rid, msg.finish, msg.keep_tokens)
        elif isinstance(msg, ScoreReq):  # a job: advanced one chunk per iteration (core.step), its result later
            try:
                self.core.add_score_job(msg.token, msg.sequences, msg.variants, msg.top_k)
            except RequestError as exc:
                self.outbox.append(ScoreResult.failed(msg.token, exc))
        elif isinstance(msg, ScoreAbortReq):
            self.core.cancel_score(msg.token)
        elif isinstance(msg, FlushCacheReq):
            ok = self.core.flush_cache()
            text = "" if ok else "cannot flush the cache while requests are running"
            self.outbox.append(FlushCacheResult(msg.token, ok, text))
        elif isinstance(msg, CONTROL_MESSAGES):  # the training control plane (engine/runtime/weight_update.py)
            self.outbox.extend(self.core.weights.handle(msg))
        elif isinstance(msg, PingReq):
            self.outbox.append(Pong(msg.token, self.core.stats()))
        elif isinstance(msg, ShutdownReq):
            self.running, self.asked_to_stop = False, True
        else:
            log.error("unknown message %r", type(msg).__name__)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        forwards = self.core.num_forwards - self._forwards_at_log
        if forwards:
            s = self.core.stats()
            dt = now - self._last_log
            log.info(
                "running %d, queued %d, KV %.1f%%, cache hit %.1f%%, %.1f forwards/s, %.1f committed tokens/s",
                s["num_running_reqs"], s["num_queue_reqs"], 100 * s["token_usage"], 100 * s["cache_hit_rate"],
                forwards / dt, self._tokens_since_log / dt,
            )
        self._last_log = now
        self._forwards_at_log = self.core.num_forwards
        self._tokens_since_log = 0
