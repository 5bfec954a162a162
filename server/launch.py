"""`redraft serve`: start the engine process, then the HTTP server in this process.

SIGINT/SIGTERM stop uvicorn gracefully; its shutdown hook stops the engine process (and kills it if it
does not stop in time). The engine process also exits by itself if this process disappears.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from redraft.engine.defaults import default_model_path
from redraft.engine.tokenizer import Tokenizer
from redraft.protocol.server_args import ServerArgs
from redraft.server.common import ServerState
from redraft.server.engine_client import EngineClient
from redraft.server.http_server import create_app
from redraft.server.metrics import parse_domains

log = logging.getLogger("redraft.serve")


def serve(args: ServerArgs) -> int:
    domains = parse_domains(args.domains)  # before the engine starts: a bad flag fails at once
    model_path = Path(args.model_path) if args.model_path else default_model_path()
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint (config.json) in {model_path}")
    args = args.replace(model_path=str(model_path))
    tokenizer = Tokenizer.from_pretrained(model_path)
    log.info("starting the engine process for %s", model_path)
    client = EngineClient(args, max_restarts=args.engine_restarts)
    client.start()
    info = client.info
    log.info(
        "engine ready: %.1fM params, %s on %s, KV cache %d tokens, context %d",
        info["num_params"] / 1e6, info["dtype"], info["device"], info["max_total_tokens"], info["max_model_len"],
    )
    name = args.served_model_name or model_path.name
    state = ServerState(client, tokenizer, name, str(model_path), args.api_key, args.max_body_bytes, domains=domains,
                        max_choices=args.max_choices_per_request, admin_keys=args.admin_api_key)
    app = create_app(state)
    log.info("serving %r on http://%s:%d", name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=5))
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
