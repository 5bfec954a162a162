"""`redraft serve`: start the engine process, then the HTTP server in this process.

SIGINT/SIGTERM stop uvicorn gracefully; its shutdown hook stops the engine process (and kills it if it
does not stop in time). The engine process also exits by itself if this process disappears.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import uvicorn

from redraft.engine.defaults import resolve_model_path
from redraft.engine.tokenizer import Tokenizer
from redraft.protocol.server_args import ServerArgs
from redraft.server.common import ServerState
from redraft.server.engine_client import EngineClient, ServerDraining
from redraft.server.http_server import create_app
from redraft.server.metrics import parse_domains

log = logging.getLogger("redraft.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before it stops: the first SIGTERM/SIGINT stops admitting (503 in OpenAI's shape,
    /health 503), lets running requests finish for up to `drain_timeout` seconds, ends the rest with a 503 (or
    an SSE error event), then lets uvicorn shut down. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        client = self.state.client
        log.info("draining: %d requests in flight, up to %.0fs to finish", client.num_in_flight, self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        ended = await client.end_in_flight(ServerDraining("the server is shutting down"))
        if ended:
            log.warning("drain time over: ended %d requests with 503", ended)
            await asyncio.sleep(0.5)  # their handlers write the error responses
        self.should_exit = True


def serve(args: ServerArgs) -> int:
    domains = parse_domains(args.domains)  # before the engine starts: a bad flag fails at once
    model_path = resolve_model_path(args.model_path, args.revision)  # a hub id is fetched (or found) here, once
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint (config.json) in {model_path}")
    # the name clients use: the repo id for a hub model (its snapshot folder is a commit hash), else the folder's
    hub_id = args.model_path is not None and not Path(args.model_path).expanduser().is_dir()
    name = args.served_model_name or (args.model_path if hub_id else model_path.name)
    args = args.replace(model_path=str(model_path))
    tokenizer = Tokenizer.from_pretrained(model_path, args.chat_template)
    log.info("starting the engine process for %s", model_path)
    client = EngineClient(args, max_restarts=args.engine_restarts)
    client.start()
    info = client.info
    log.info(
        "engine ready: %.1fM params, %s on %s, KV cache %d tokens, context %d",
        info["num_params"] / 1e6, info["dtype"], info["device"], info["max_total_tokens"], info["max_model_len"],
    )
    state = ServerState(client, tokenizer, name, str(model_path), args.api_key, args.max_body_bytes, domains=domains,
                        max_choices=args.max_choices_per_request, admin_keys=args.admin_api_key)
    app = create_app(state)
    log.info("serving %r on http://%s:%d", name, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, state, args.shutdown_timeout)
    client.on_fatal.append(lambda: setattr(server, "should_exit", True))  # the engine is gone for good
    try:
        server.run()
    finally:
        if client.proc is not None and client.proc.is_alive():
            client.proc.kill()
    if client.failed:
        log.error("exiting: the engine process died and could not be restarted")
        return 1
    return 0
