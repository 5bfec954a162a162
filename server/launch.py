"""`redraft serve`: start the engine process, then the HTTP server in this process.

This process alone acts on SIGINT/SIGTERM, also when a supervisor signals the whole process group (the engine
and its ranks ignore both: protocol/processes.py): the first signal drains (`DrainingServer`), then uvicorn's
shutdown hook stops the engine process (ShutdownReq; killed if it does not stop in time); a second signal stops
at once and kills the children. On the way out every child process still there is ended and the socket folder
removed, whatever the exit path. The engine also dies by itself if this process disappears (a SIGKILL).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import multiprocessing as mp
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from redraft.protocol.processes import end_children
from redraft.engine.text.model_path import resolve_model_path
from redraft.engine.text.tokenizer import Tokenizer
from redraft.protocol.log_safety import RateLimitedLoopErrors, install_log_safety
from redraft.protocol.server_args import ServerArgs
from redraft.server.common import ServerState
from redraft.server.connections import ACCEPT_BATCH, ConnectionLimits, effective_max_connections, guarded_protocol
from redraft.server.engine_client import EngineClient, ServerDraining
from redraft.server.host_check import default_allowed_hosts
from redraft.server.http_server import create_app
from redraft.server.metrics import parse_domains

log = logging.getLogger("redraft.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before it stops: the first SIGTERM/SIGINT stops admitting (503 in OpenAI's shape,
    /health 503) and ends engine restarts, lets running requests finish for up to `drain_timeout` seconds, ends
    the rest with a 503 (or an SSE error event), then lets uvicorn shut down. A second signal stops at once: it
    kills the engine and ends the running requests the same way. No signal is re-raised after the shutdown
    (uvicorn's habit): the exit code is 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping_now = False  # a second signal came

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(RateLimitedLoopErrors())  # accept() out of fds: not a line per loop turn
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:
            return super().handle_exit(sig, frame)
        if self.state.draining:
            return self._stop_now(sig)
        self.state.draining = True
        self.state.client.shutting_down = True  # at once: the watchdog must not restart an engine from now on
        log.info("%s: shutting down", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    def _stop_now(self, sig: int) -> None:
        """A second signal: no more waiting. The engine is killed, the requests still running end at once (503,
        or the SSE error event), and uvicorn stops as soon as they have; a third signal skips even that."""
        client = self.state.client
        if self._stopping_now:
            log.warning("%s again: exiting without waiting for the connections", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self._stopping_now = True
        log.warning("%s again: stopping now (%d requests ended)", signal.Signals(sig).name, client.num_in_flight)
        client.kill_now()
        self._loop.call_soon_threadsafe(client.end_all, ServerDraining("the server is shutting down"))
        self.should_exit = True

    async def _drain(self) -> None:
        client = self.state.client
        client.begin_shutdown()
        log.info("draining: %d requests in flight, up to %.0fs to finish", client.num_in_flight, self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        ended = await client.end_in_flight(ServerDraining("the server is shutting down"))
        if ended:
            log.warning("drain time over: ended %d requests with 503", ended)
            await asyncio.sleep(0.5)  # their handlers write the error responses
        self.should_exit = True


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything is loaded: a wrong --host or a busy --port is an error in a
    second, not after minutes of loading weights. uvicorn listens on it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on ({exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        busy = " (is another server running there? choose another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}{busy}") from None
    return sock


def serve(args: ServerArgs) -> int:
    domains = parse_domains(args.domains)  # before the engine starts: a bad flag fails at once
    listener = bind_listener(args.host, args.port)
    client: EngineClient | None = None
    with _StartupSignals() as startup:
        try:
            args, name = _resolve_model(args)
            tokenizer = Tokenizer.from_pretrained(args.model_path, args.chat_template)
            log.info("starting the engine process for %s", args.model_path)
            client = EngineClient(args)
            client.start()  # on failure it leaves nothing behind
            return _serve(args, client, tokenizer, name, domains, listener)
        except _StoppedDuringStartup as stop:
            log.warning("%s: stopped at once", signal.Signals(stop.sig).name)
            return 0
        finally:
            startup.armed = False  # the cleanup below is bounded: a signal now must not cut it short
            if client is not None:
                _end_children(client)
            listener.close()


def _resolve_model(args: ServerArgs) -> tuple[ServerArgs, str]:
    """The checkpoint's folder (a hub id is fetched, or found in the cache, here, once) and the name clients use:
    the repo id for a hub model (its snapshot folder is a commit hash), else the folder's."""
    model_path = resolve_model_path(args.model_path, args.revision)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint (config.json) in {model_path}")
    hub_id = args.model_path is not None and not Path(args.model_path).expanduser().is_dir()
    name = args.served_model_name or (args.model_path if hub_id else model_path.name)
    return args.replace(model_path=str(model_path)), name


def _serve(args: ServerArgs, client: EngineClient, tokenizer: Tokenizer, name: str, domains: Any,
           listener: socket.socket) -> int:
    info = client.info
    log.info(
        "engine ready: %.1fM params, %s on %s, KV cache %d tokens, context %d",
        info["num_params"] / 1e6, info["dtype"], info["device"], info["max_total_tokens"], info["max_model_len"],
    )
    state = ServerState(client, tokenizer, name, args.model_path, args.api_key, args.max_body_bytes, domains=domains,
                        max_choices=args.max_choices_per_request, admin_keys=args.admin_api_key,
                        allowed_hosts=default_allowed_hosts(args.host, args.allowed_hosts),
                        max_request_items=args.max_request_items)
    app = create_app(state)
    log.info("settings: %s", effective_settings(args, info, name))
    log.info("serving %r on http://%s:%d", name, args.host, listener.getsockname()[1])
    limits = ConnectionLimits(effective_max_connections(args.max_connections), args.header_timeout,
                              args.body_timeout, args.send_buffer_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=5, timeout_keep_alive=args.keep_alive_timeout,
                            backlog=ACCEPT_BATCH,
                            http=guarded_protocol(AutoHTTPProtocol, limits))
    install_log_safety()  # after uvicorn configured its loggers: every record one bounded line
    server = DrainingServer(config, state, args.shutdown_timeout)
    client.on_fatal.append(lambda: setattr(server, "should_exit", True))  # the engine is gone for good
    server.run(sockets=[listener])
    if client.failed:
        log.error("exiting: the engine process died and could not be restarted")
        return 1
    return 0


def effective_settings(args: ServerArgs, info: dict[str, Any], name: str) -> str:
    """One line of what this server runs with, for the start-up log."""
    parts = {
        "model": f"{name} ({info['model_path']})", "device": info["device"], "dtype": info["dtype"],
        "kernels": info["kernel_backend"], "threads": args.cpu_threads or "torch's choice",
        "default mode": info.get("default_mode"), "context": info["max_model_len"],
        "KV cache tokens": info["max_total_tokens"], "max running": info["max_running_requests"],
        "tp": args.tp_size, "auth": "on" if args.api_key else "off",
        "dials through a router": "chat_template_kwargs / metadata / sampling_params.custom_params (docs/scaling.md)",
    }
    return ", ".join(f"{k} {v}" for k, v in parts.items())


class _StoppedDuringStartup(BaseException):  # like KeyboardInterrupt: no `except Exception` may swallow it
    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


class _StartupSignals:
    """From the engine's start (minutes for a large model) until uvicorn's own handlers take over, SIGTERM/SIGINT
    end the start-up by an exception, so that the cleanup runs (the default SIGTERM would skip it and leave the
    socket folder). uvicorn puts this handler back when it stops; from the cleanup on (`armed` False) a signal
    is ignored. Only the main thread may set handlers: elsewhere this does nothing."""

    def __init__(self) -> None:
        self.armed = True
        self._old: dict[int, Any] = {}

    def _handle(self, sig: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            raise _StoppedDuringStartup(sig)
        log.info("%s while stopping: ignored, the cleanup is bounded", signal.Signals(sig).name)

    def __enter__(self) -> "_StartupSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _end_children(client: EngineClient) -> None:
    """On every way out: no child process outlives the server (the engine, its ranks with it, helper pools),
    and the socket folder goes. The engine was asked to stop by uvicorn's shutdown hook, unless the exit skipped
    it (a second signal, an error): it is killed now."""
    client.kill_now()
    client.release()
    log.debug("ending the child processes still running: %s", [c.name for c in mp.active_children()])
    killed = end_children(grace_s=2.0)
    if killed:
        log.warning("killed child processes that did not stop in time: %s", ", ".join(killed))
    log.debug("every child process has ended")
