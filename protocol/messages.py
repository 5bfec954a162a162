"""Typed messages between the HTTP process and the engine process (pickled over ZMQ). Torch-free.

HTTP -> engine: GenerateReq (one, or a GenerateBatchReq of every output of one HTTP request), AbortReq, ScoreReq, ScoreAbortReq, FlushCacheReq, PingReq, ShutdownReq;
the training control plane (docs/rl.md): WeightUpdateReq, WeightGroupReq, GenerationControlReq.
engine -> HTTP: EngineReady or EngineFailed once at start-up, then one list per iteration of Accepted /
Rejected / RequestOutput / ScoreResult / FlushCacheResult / Pong / ControlResult.

Outputs are incremental: a RequestOutput carries only what its request committed since its previous message
(whole blocks, never revised afterwards), so a message costs the same early and late in a long generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redraft.protocol.errors import INVALID_REQUEST, RequestError
from redraft.protocol.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams


@dataclass
class GenerateBatchReq:
    """Every engine request of one HTTP request (the choices of `n`, the prompts of a /generate list): admitted
    together, all or none (one refusal refuses them all, each with that refusal's error), in the same
    iteration, so that they start decoding side by side."""

    reqs: list[GenerateReq]


@dataclass
class AbortReq:
    """End a request now. `finish` replaces the finish reason "abort" (the HTTP side matched a stop string),
    and `keep_tokens` cuts the output there (tokens committed after the match are not part of the answer)."""

    rid: str
    finish: dict[str, Any] | None = None
    keep_tokens: int | None = None


@dataclass
class ScoreReq:
    """Run masked variants of blocks and read log-probabilities (engine/text/likelihood.py plans them)."""

    token: str
    sequences: list[list[int]]
    variants: list[Any]  # likelihood.Variant, or its plain tuple (seq, block, masked, targets)
    top_k: int = 0


@dataclass
class ScoreAbortReq:
    """Drop a likelihood job (its client left): its pages are released at once, no ScoreResult follows."""

    token: str


@dataclass
class ScoreResult:
    """Per variant, (logprob, top alternatives [(token, logprob)]) at each target; or why it failed."""

    token: str
    results: list[list[tuple[float, list[tuple[int, float]]]]] | None
    status: int = 200
    message: str = ""
    code: str | None = None
    param: str | None = None

    @classmethod
    def failed(cls, token: str, err: RequestError) -> "ScoreResult":
        return cls(token, None, err.status, err.message, err.code or INVALID_REQUEST, err.param)

    def error(self) -> RequestError:
        """Why the job failed (results None), as the error the engine raised."""
        return RequestError(self.message, status=self.status, code=self.code or INVALID_REQUEST, param=self.param)


@dataclass
class FlushCacheReq:
    token: str


@dataclass
class PingReq:
    token: str


@dataclass
class ShutdownReq:
    pass


# ---- the training control plane (engine/runtime/weight_update.py; SGLang's io_struct names) --------------------
@dataclass
class WeightUpdateReq:
    """New weights (or only a new version name): `source` "disk" (model_path, load_format), "distributed" (names,
    dtypes, shapes broadcast over group_name; load_format "flattened_bucket" or None) or "version". It runs once no
    request is running (new ones queue), after aborting every request when abort_all_requests."""

    token: str
    source: str
    model_path: str | None = None
    load_format: str | None = None
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_name: str = "weight_update_group"
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass
class WeightGroupReq:
    """Join (`op` "init") or leave ("destroy") a trainer's process group."""

    token: str
    op: str
    group_name: str = "weight_update_group"
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    backend: str = "nccl"


@dataclass
class GenerationControlReq:
    """`op`: "pause" (mode abort | retract | in_place), "continue", "abort_all", "release_memory" / "resume_memory"
    (tags: weights, kv_cache, cuda_graph; None = all), "status"."""

    token: str
    op: str
    mode: str = "abort"
    tags: list[str] | None = None


@dataclass
class ControlResult:
    """The engine's answer to a control message: SGLang's success and message, and what else the route returns."""

    token: str
    success: bool
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Accepted:
    """The engine queued the request (sent at once, so a stream's HTTP status can wait for it), with the
    values its defaults resolved to."""

    rid: str
    mode: str  # "S" or "Q"
    max_new_tokens: int


@dataclass
class Rejected:
    """The engine refused a request at admission: the fields of its RequestError (protocol/errors.py), the
    parameter named as in sampling_params (the routes rename it to their own field)."""

    rid: str
    status: int
    message: str
    code: str = INVALID_REQUEST
    param: str | None = None

    @classmethod
    def of(cls, rid: str, err: RequestError) -> "Rejected":
        """The message of an engine refusal; one without a code of its own carries its error type as the code."""
        return cls(rid, err.status, err.message, err.code or INVALID_REQUEST, err.param)

    def error(self) -> RequestError:
        return RequestError(self.message, status=self.status, code=self.code, param=self.param)


@dataclass
class RequestOutput:
    """What one request committed since its previous message, and its finish.

    finish_reason: {"type": "stop" | "length" | "abort" | "error", ...}; "error" (with "message") when a failure
                   inside the engine ended this request alone (the others run on)

    new_ids:      output tokens of the blocks committed since the last message (cut to max_new_tokens and
                  through the first EOS/stop token on the last one)
    new_logprobs: their log-probabilities, and the top alternatives [(token, logprob), ...] at each, when asked
    meta:         progress (`steps`, `blocks`) on every message; the whole meta_info once finished
    denoise:      stream_denoise: one raw event per forward since the last message (scheduler/denoise_trace.py;
                  the HTTP side adds the text, server/denoise.py), else None
    """

    rid: str
    new_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None = None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    denoise: list[dict[str, Any]] | None = None


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
class Heartbeat:
    """Sent by the engine loop when it has sent nothing else for HEARTBEAT_INTERVAL_S: a silent engine past
    --engine-heartbeat-timeout is hung (or stopped), and the HTTP process replaces it."""


HEARTBEAT_INTERVAL_S = 1.0


@dataclass
class EngineReady:
    info: dict[str, Any]


@dataclass
class EngineFailed:
    message: str
