"""The engine process's entry point, as the HTTP process names it (server/engine_client.py starts it with
multiprocessing's 'spawn'). Torch-free: the engine runtime is imported inside the function, which runs in the
child only, so the HTTP process never loads it (tests/test_architecture.py checks both)."""

from __future__ import annotations

from redraft.protocol.server_args import ServerArgs


def run_engine_process(args: ServerArgs, recv_addr: str, send_addr: str) -> None:
    """The child's main: the engine loop (engine/runtime/engine_process.py `serve_engine`) on these sockets."""
    from redraft.engine.runtime.engine_process import serve_engine  # (in the child: loads torch and the model)

    serve_engine(args, recv_addr, send_addr)
