"""`redraft serve`: start the engine process, then the HTTP server in this process.

SIGINT/SIGTERM stop uvicorn gracefully; its shutdown hook stops the engine process (and kills it if it
does not stop in time). The engine process also exits by itself if this process disappears.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import uvicorn

from redraft.engine.defaults import default_model_path
from redraft.engine.tokenizer import Tokenizer
from redraft.server.engine_client import EngineClient
from redraft.server.common import ServerState
from redraft.server.http_server import create_app
from redraft.server.metrics import DEFAULT_DOMAINS, parse_domains
from redraft.server.openai_api import OpenAISettings

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
    p.add_argument("--api-key", action="append", default=[],
                   help="require `Authorization: Bearer KEY` (repeat for several keys; /health and /metrics stay open)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="chat max_tokens when a request names none (capped by the context)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    p.add_argument("--domains", default=",".join(DEFAULT_DOMAINS),
                   help="the values of the metrics' `domain` label (a request's domain outside them counts as "
                        "`other`), comma-separated (default: %(default)s)")


def read_generation_config(model_path: Path) -> dict:
    """The checkpoint's generation_config.json (request defaults below the request, above the flags)."""
    path = model_path / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    known = ("temperature", "top_p", "top_k", "threshold", "edit_threshold", "editing_threshold", "max_post_steps",
             "max_new_tokens")
    return {k: raw[k] for k in known if raw.get(k) is not None}


def serve(args: argparse.Namespace, engine_kwargs: dict) -> int:
    domains = parse_domains(args.domains)  # before the engine starts: a bad flag fails at once
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
    state = ServerState(client, tokenizer, name, str(model_path), tuple(args.api_key), args.max_body_bytes,
                        domains=domains)
    settings = OpenAISettings(default_max_tokens=args.default_max_tokens,
                              generation_defaults=read_generation_config(model_path))
    app = create_app(state, settings)
    log.info("serving %r on http://%s:%d", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    finally:
        if client.proc is not None and client.proc.is_alive():
            client.proc.kill()
    return 0
