"""Typed messages between the HTTP process and the engine process (pickled over ZMQ). Torch-free.

HTTP -> engine: GenerateReq, AbortReq, FlushCacheReq, PingReq, ShutdownReq.
engine -> HTTP: a list per iteration of Accepted / RequestOutput / RejectReq / FlushCacheResult / Pong, plus EngineReady once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redraft.engine.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    token: str


@dataclass
class PingReq:
    token: str


@dataclass
class ShutdownReq:
    pass


@dataclass
class RequestOutput:
    """Progress of one request: the output of its committed blocks so far (cumulative), final when finished."""

    rid: str
    output_ids: list[int]
    finished: bool
    finish_reason: dict | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Accepted:
    """The engine queued the request (sent at once, so a stream's HTTP status can wait for it)."""

    rid: str


@dataclass
class RejectReq:
    """The engine refused a request at admission (HTTP status and message for the client)."""

    rid: str
    status: int
    message: str
    code: str = "invalid_request_error"


@dataclass
class FlushCacheResult:
    token: str
    ok: bool
    message: str = ""


@dataclass
class Pong:
    token: str
    stats: dict[str, Any]


@dataclass
class EngineReady:
    info: dict[str, Any]


@dataclass
class EngineFailed:
    message: str
