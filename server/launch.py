"""`redraft serve`: start the engine process, then the HTTP server in this process.

SIGINT/SIGTERM stop uvicorn gracefully; its shutdown hook stops the engine process (and kills it if it
does not stop in time). The engine process also exits by itself if this process disappears.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from redraft.engine.defaults import default_model_path
from redraft.engine.tokenizer import Tokenizer
from redraft.server.engine_client import EngineClient
from redraft.server.http_server import ServerState, create_app

log = logging.getLogger("redraft.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the folder name)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-queued-requests", type=int, default=None, help="beyond this many waiting requests: 503")
    p.add_argument("--mem-fraction-static", type=float, default=0.85, help="GPU memory share for weights + KV cache")
    p.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    p.add_argument("--disable-radix-cache", action="store_true")


def serve(args: argparse.Namespace, engine_kwargs: dict) -> int:
    model_path = Path(args.model) if args.model else default_model_path()
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint (config.json) in {model_path}")
    tokenizer = Tokenizer.from_pretrained(model_path)
    engine_kwargs = {
        **engine_kwargs,
        "model_path": str(model_path),
        "max_running_requests": args.max_running_requests,
        "max_queued_requests": args.max_queued_requests,
        "mem_fraction_static": args.mem_fraction_static,
        "schedule_policy": args.schedule_policy,
        "enable_prefix_cache": not args.disable_radix_cache,
    }
    log.info("starting the engine process for %s", model_path)
    client = EngineClient(engine_kwargs, log_level=args.log_level)
    client.start()
    info = client.info
    log.info(
        "engine ready: %.1fM params, %s on %s, KV cache %d tokens, context %d",
        info["num_params"] / 1e6, info["dtype"], info["device"], info["max_total_tokens"], info["max_model_len"],
    )
    name = args.served_model_name or model_path.name
    app = create_app(ServerState(client, tokenizer, name))
    log.info("serving %r on http://%s:%d", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    finally:
        if client.proc is not None and client.proc.is_alive():
            client.proc.kill()
    return 0
