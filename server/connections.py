"""Limits on connections, below the ASGI app: a cap on open connections and deadlines for reading a request.

uvicorn closes only idle keep-alive connections (`timeout_keep_alive`); a client that connects and sends nothing,
or half its headers, or half its body, would hold its socket (a file descriptor) forever, and authentication
only runs once the headers are complete. `guarded_protocol` wraps uvicorn's HTTP protocol class:

- connections beyond `max_connections` are answered at once with a 503 `too_many_connections` and closed, so
  the process never runs out of file descriptors (where asyncio's accept() would fail and new clients hang);
- a request's headers must be complete `header_timeout_s` after its first byte (after the connect, for the first
  request), and its body `body_timeout_s` after its headers; otherwise a 408 `request_timeout` and the close;
- each connection's kernel send buffer is fixed (`send_buffer_bytes`): autotuned, a slow reader would leave up
  to 4 MiB there, and the stream's backlog limit (engine_client.py) would only start counting after it.

Every refusal names its flag. They are logged at most once per 10 s with a count (a flood must not flood the log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from dataclasses import dataclass
from typing import Any

from redraft.protocol.errors import RequestError

log = logging.getLogger("redraft.http")
FD_RESERVE = 64  # descriptors kept for everything but client connections (engine sockets, workers, files)
# connections accepted in one go (asyncio accepts up to the listen backlog per wake-up, before any is refused):
# uvicorn's backlog, and twice it is kept free (a batch being accepted, the refused one still being closed)
ACCEPT_BATCH = 128


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    send_buffer_bytes: int = 0  # SO_SNDBUF of each connection (0: the kernel's autotuning, up to 4 MiB)


def effective_max_connections(wanted: int) -> int:
    """--max-connections, lowered to fit the open-file limit with a warning: past that limit accept() fails and
    no client at all is served."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - FD_RESERVE - 2 * ACCEPT_BATCH
    if soft == resource.RLIM_INFINITY or room >= wanted:
        return wanted
    fitted = max(1, room)
    log.warning("--max-connections %d does not fit the open-file limit (ulimit -n %d): %d connections at most; "
                "raise the limit to allow more", wanted, soft, fitted)
    return fitted


class _Note:
    """A log line at most once per `interval_s`, with how many events it stands for."""

    def __init__(self, text: str, interval_s: float = 10.0):
        self.text, self.interval_s, self.count, self.last = text, interval_s, 0, -interval_s

    def __call__(self, *args: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            log.warning(self.text + " (%d since the last such line)", *args, self.count)
            self.count, self.last = 0, now


def _raw_error(err: RequestError) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape that closes the connection (written below the app)."""
    body = json.dumps(err.body()).encode()
    head = (f"HTTP/1.1 {err.status} {'Request Timeout' if err.status == 408 else 'Service Unavailable'}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n")
    head += "".join(f"{k}: {v}\r\n" for k, v in (err.headers or {}).items())
    return head.encode("latin-1") + b"\r\n" + body


class _Guarded:
    """The connection cap and read deadlines, mixed into uvicorn's HTTP protocol class by `guarded_protocol`
    (which sets `_limits` and the two log notes)."""

    _limits: ConnectionLimits
    _over_cap: _Note
    _timed_out: _Note
    _deadline: asyncio.TimerHandle | None = None
    _seen_cycle: Any = None  # the request whose headers we have seen complete

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if self._limits.send_buffer_bytes and sock is not None:  # what a slow reader can leave in the kernel
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._limits.send_buffer_bytes)
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            self._over_cap(len(self.connections) - 1)
            return self._refuse(RequestError(
                f"the server has {self._limits.max_connections} open connections, its limit (--max-connections); "
                "retry shortly", status=503, code="too_many_connections", headers={"Retry-After": "1"}))
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm("headers")  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen_cycle:  # its headers are complete
            self._seen_cycle = cycle
            self._disarm()
            if cycle.more_body:
                self._arm("body")
        elif cycle is not None and not cycle.more_body and self._phase == "body":
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # ---- deadlines ------------------------------------------------------------------------------------
    _phase = ""

    def _arm(self, phase: str) -> None:
        self._disarm()
        seconds = self._limits.header_timeout_s if phase == "headers" else self._limits.body_timeout_s
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if phase == "body" and (cycle is None or not cycle.more_body):
            return  # completed meanwhile (read by the app)
        flag = "header-timeout" if phase == "headers" else "body-timeout"
        seconds = self._limits.header_timeout_s if phase == "headers" else self._limits.body_timeout_s
        self._timed_out(phase, flag)
        if phase == "body" and cycle.response_started:
            self.transport.close()
            return
        self._refuse(RequestError(f"the request's {phase} did not arrive within {seconds:g}s (--{flag})",
                                  status=408, code="request_timeout"))

    def _refuse(self, err: RequestError) -> None:
        self.transport.write(_raw_error(err))
        self.transport.close()


def guarded_protocol(base: type[asyncio.Protocol], limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base` (h11 or httptools) with the connection cap and read deadlines."""
    return type("GuardedHTTPProtocol", (_Guarded, base), {
        "_limits": limits,
        "_over_cap": _Note("refused a connection: %d open, the limit (--max-connections)"),
        "_timed_out": _Note("closed a connection whose %s did not arrive in time (--%s)"),
    })
