"""The engine process: scheduler + model runner in a loop, fed by the HTTP process over ZMQ.

Each iteration: take every pending message (new requests, aborts, flushes, pings), run one scheduler step
(one forward for the whole batch), then send back one list with the progress of every request that
committed a block or finished. Idle, it blocks on the socket instead of spinning. It exits on ShutdownReq,
or by itself when its parent process is gone, so no orphan is ever left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import zmq

from redraft.scheduler.messages import (
    Accepted, AbortReq, EngineFailed, EngineReady, FlushCacheReq, FlushCacheResult, GenerateReq, PingReq, Pong, RejectReq,
    RequestOutput, ShutdownReq,
)
from redraft.scheduler.scheduler import QueueFull

log = logging.getLogger("redraft.engine_process")

LOG_INTERVAL_S = 5.0


def run_engine_process(engine_kwargs: dict[str, Any], recv_addr: str, send_addr: str, log_level: str = "INFO") -> None:
    """Entry point of the child process (multiprocessing 'spawn'). This module imports no torch at the top,
    so that the HTTP process can name this function without loading the model stack."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the HTTP process, which shuts us down
    parent = os.getppid()
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    try:
        from redraft.engine.engine import Engine

        engine = Engine(progress=False, **engine_kwargs)
    except Exception as exc:  # report why, then die: the HTTP process exits with the message
        log.exception("engine failed to start")
        send.send_pyobj(EngineFailed(f"{type(exc).__name__}: {exc}"))
        return
    send.send_pyobj(EngineReady(info=engine_info(engine)))
    log.info("engine ready: %s", engine.model_path)
    EngineLoop(engine, recv, send, parent).run()
    ctx.destroy(linger=0)


def engine_info(engine) -> dict[str, Any]:
    cfg = engine.config
    return {
        "model_path": str(engine.model_path),
        "max_model_len": engine.max_model_len,
        "max_total_tokens": engine.scheduler.pool.capacity * engine.scheduler.config.block_size,
        "block_size": engine.scheduler.config.block_size,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "kernel_backend": cfg.kernel_backend,
        "default_mode": cfg.default_mode,
        "max_running_requests": engine.scheduler.config.max_running_requests,
        "max_queued_requests": engine.scheduler.config.max_queued_requests,
        "num_params": engine.model_config.num_params(),
        "vocab_size": engine.model_config.vocab_size,
    }


class EngineLoop:
    def __init__(self, engine, recv: zmq.Socket, send: zmq.Socket, parent_pid: int):
        self.engine = engine
        self.sched = engine.scheduler
        self.recv, self.send = recv, send
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(recv, zmq.POLLIN)
        self.outbox: list[Any] = []
        self.running = True
        self._last_log = time.monotonic()
        self._tokens_since_log = 0
        self._forwards_since_log = 0
        self._steps_since_log = 0
        # Queue time for metrics: when each request reached the engine, until its first admission.
        self._enqueued: dict[str, float] = {}
        self._queue_time: dict[str, float] = {}

    def run(self) -> None:
        while self.running:
            if os.getppid() != self.parent_pid:
                log.warning("parent process is gone: exiting")
                return
            idle = not self.sched.has_work()
            self._drain_messages(block_ms=100 if idle else 0)
            if self.sched.has_work():
                self._step()
            self._collect_updates()
            self._flush()
            self._maybe_log()

    def _drain_messages(self, block_ms: int) -> None:
        if block_ms and not self.poller.poll(block_ms):
            return
        while True:
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            try:
                req = self.engine.make_request(msg.input_ids, msg.params, rid=msg.rid)
                self.sched.add_request(req)
                self._enqueued[msg.rid] = time.monotonic()
                self.outbox.append(Accepted(msg.rid))
            except QueueFull as exc:
                self.outbox.append(RejectReq(msg.rid, 503, str(exc), "queue_full"))
            except ValueError as exc:
                self.outbox.append(RejectReq(msg.rid, 400, str(exc)))
        elif isinstance(msg, AbortReq):
            self.sched.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = self.sched.flush_cache()
            text = "" if ok else "cannot flush the cache while requests are running"
            self.outbox.append(FlushCacheResult(msg.token, ok, text))
        elif isinstance(msg, PingReq):
            self.outbox.append(Pong(msg.token, self.sched.stats()))
        elif isinstance(msg, ShutdownReq):
            self.running = False
        else:
            log.error("unknown message %r", type(msg).__name__)

    def _step(self) -> None:
        items = self.sched.schedule()
        now = time.monotonic()
        for it in items:  # a request's first batch is its admission
            start = self._enqueued.pop(it.req.rid, None)
            if start is not None:
                self._queue_time[it.req.rid] = now - start
        if items:
            out = self.engine.runner.run(items)
            self.sched.update(items, out)
            self._forwards_since_log += 1
            self._steps_since_log += len(out.tokens)

    def _collect_updates(self) -> None:
        from redraft.engine.engine import finish_reason_json, logprob_meta, request_meta  # loaded in this process

        for req in self.sched.drain_updates():
            ids = req.output_ids()
            if req.finished:
                self._tokens_since_log += len(ids)
            if req.finished:
                self._enqueued.pop(req.rid, None)  # aborted while waiting: never admitted
                meta = request_meta(req) | {"queue_time": self._queue_time.pop(req.rid, None)}
            else:
                meta = {"steps": req.stats.steps, "blocks": req.stats.blocks} | logprob_meta(req)
            self.outbox.append(RequestOutput(req.rid, ids, req.finished, finish_reason_json(req), meta))

    def _flush(self) -> None:
        if self.outbox:
            self.send.send_pyobj(self.outbox)
            self.outbox = []

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        if self._forwards_since_log:
            s = self.sched.stats()
            dt = now - self._last_log
            log.info(
                "running %d, queued %d, KV %.1f%%, cache hit %.1f%%, %.1f forwards/s, %.1f finished tokens/s",
                s["num_running_reqs"], s["num_queue_reqs"], 100 * s["token_usage"], 100 * s["cache_hit_rate"],
                self._forwards_since_log / dt, self._tokens_since_log / dt,
            )
        self._last_log = now
        self._tokens_since_log = self._forwards_since_log = self._steps_since_log = 0
